"""Shared tier across nodes (Redis / Redis Cluster, Mooncake Store): see docs/scale-out.md."""

from embcache.service.shared_tier.attach import PrefetchResult, SharedTier, shared_tier_hooks
from embcache.service.shared_tier.base import FetchResult, Header, SharedTierBackend, TierError
from embcache.service.tier_config import SharedTierConfig

__all__ = [
    "FetchResult",
    "Header",
    "PrefetchResult",
    "SharedTier",
    "SharedTierBackend",
    "SharedTierConfig",
    "TierError",
    "shared_tier_hooks",
]
