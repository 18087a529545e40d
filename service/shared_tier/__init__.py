"""Shared tier across nodes (Redis / Redis Cluster, Mooncake Store): see docs/scale-out.md."""

from embcache.service.shared_tier.attach import PrefetchResult, SharedTier, attach_shared_tier
from embcache.service.shared_tier.base import FetchResult, Header, SharedTierBackend, TierError
from embcache.service.shared_tier.config import SharedTierConfig

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
