"""The engine layer: :class:`CacheEngine`, the one API every transport uses."""

from embcache.service.engine.engine import (
    SHARED_TIER_OWNER,
    CacheEngine,
    EvictOutcome,
    cuda_wanted,
    default_device_pools,
    raise_for_evict,
)

__all__ = [
    "SHARED_TIER_OWNER",
    "CacheEngine",
    "EvictOutcome",
    "cuda_wanted",
    "default_device_pools",
    "raise_for_evict",
]
