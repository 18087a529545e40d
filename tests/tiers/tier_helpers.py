"""Helpers for the shared-tier tests (engines, payloads, reads)."""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np
import torch

from embcache.service.config import Settings
from embcache.service.engine import CacheEngine, SharedTierFactory
from embcache.service.shared_tier import SharedTier, SharedTierConfig, shared_tier_hooks

PAGE = 64 * 1024
POOL = 16 * 1024 * 1024


def new_engine(
    tag: str, pool_bytes: int = POOL, shared_tier: SharedTierFactory | None = None
) -> CacheEngine:
    return CacheEngine(
        Settings(
            host_pool_bytes=pool_bytes,
            page_bytes=PAGE,
            shm_name=f"embcache-tier-{tag}-{uuid.uuid4().hex[:10]}",
            device="cpu",
        ),
        shared_tier=shared_tier,
    )


def new_node(
    tag: str, config: SharedTierConfig, pool_bytes: int = POOL, **hooks: Any
) -> tuple[CacheEngine, SharedTier]:
    """An engine with a shared tier (``shared_tier_hooks(config, **hooks)``), and the tier."""
    engine = new_engine(tag, pool_bytes, shared_tier_hooks(config, **hooks))
    tier = engine.shared_tier
    assert isinstance(tier, SharedTier)
    return engine, tier


def payload(nbytes: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.integers(0, 256, nbytes, dtype=np.uint8)).view(torch.float16)


def read_entry(engine: CacheEngine, key: str) -> bytes | None:
    lease = engine.get([key], "test")[0]
    if lease is None:
        return None
    try:
        return b"".join(engine.iter_bytes(lease))
    finally:
        engine.release([lease.lease_id])


def fragment(engine: CacheEngine) -> None:
    """Fill the pool with one-page entries, then free every other page: new entries span
    several runs."""
    n = engine.host_pool.num_pages
    keys = [f"filler-{i}" for i in range(n)]
    for key in keys:
        engine.put(key, torch.zeros(PAGE // 2, dtype=torch.float16), owner="shared-tier")
    engine.evict(keys[::2])


Node = tuple[CacheEngine, SharedTier]
