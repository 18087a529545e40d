"""Shared tier across nodes (Redis / Redis Cluster, Mooncake Store): see docs/scale-out.md."""

from embcache.service.tiers.attach import PrefetchResult, SharedTier, attach_shared_tier
from embcache.service.tiers.base import FetchResult, Header, SharedTierBackend, TierError
from embcache.service.tiers.config import SharedTierConfig

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
