"""The engine layer: :class:`CacheEngine`, the one API every transport uses."""

from embcache.service.engine.engine import CacheEngine, SharedTierFactory
from embcache.service.engine.hooks import SharedTierHooks, cuda_wanted, default_device_pools
from embcache.service.engine.reads import TouchWindow
from embcache.service.host.store import (
    SHARED_TIER_OWNER,
    EvictOutcome,
    EvictResults,
    raise_for_evict,
)

__all__ = [
    "SHARED_TIER_OWNER",
    "CacheEngine",
    "EvictOutcome",
    "EvictResults",
    "SharedTierFactory",
    "SharedTierHooks",
    "TouchWindow",
    "cuda_wanted",
    "default_device_pools",
    "raise_for_evict",
]
