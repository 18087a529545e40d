"""Shared tier across nodes (Redis / Redis Cluster, Mooncake Store): see docs/scale-out.md."""

from .attach import PrefetchResult, SharedTier, attach_shared_tier
from .base import FetchResult, Header, SharedTierBackend, TierError
from .config import SharedTierConfig

__all__ = [
    "FetchResult",
    "Header",
    "PrefetchResult",
    "SharedTier",
    "SharedTierBackend",
    "SharedTierConfig",
    "TierError",
    "attach_shared_tier",
]
