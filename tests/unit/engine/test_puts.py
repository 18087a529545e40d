"""``begin_put(..., copy_in=...)``: the copy of a put from a device is queued the moment its
pages are reserved, before the entry is recorded; a failing copy_in leaves nothing behind."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from embcache.errors import MetadataConflict
from embcache.service.config import Settings
from embcache.service.engine import CacheEngine

PAGE = 4096
NBYTES = 3 * PAGE + 5


@pytest.fixture
def engine(shm_name: str):
    s = Settings(host_pool_bytes=16 * PAGE, page_bytes=PAGE, shm_name=shm_name, device="cpu")
    with CacheEngine(s) as e:
        yield e


def payload(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, NBYTES, dtype=np.uint8)


def test_copy_in_runs_first_and_fills_the_entry(engine: CacheEngine) -> None:
    data = payload(1)
    calls = []

    def copy(byte_runs: tuple[tuple[int, int], ...]) -> None:
        stats = engine.host_store.counts()  # copy_in runs under the engine's lock
        calls.append((stats.entries_filling, stats.reserved_filling_bytes))
        pool, done = engine.host_pool.array, 0
        for offset, count in byte_runs:  # what the copy engine does, on the host
            pool[offset : offset + count] = data[done : done + count]
            done += count
        assert done == NBYTES

    handle = engine.begin_put("k", "uint8", (NBYTES,), copy_in=copy)
    assert calls == [(0, 0)]  # before the entry was recorded as filling
    assert engine.stats().entries_filling == 1 and handle.written == NBYTES
    assert engine.exists(["k"]) == [False]  # invisible until committed
    handle.filled()
    assert handle.commit()
    (lease,) = engine.get(["k"], "r")
    assert lease is not None
    assert np.array_equal(engine.tensor(lease).view(torch.uint8).numpy(), data)


def test_a_failing_copy_in_leaves_nothing(engine: CacheEngine) -> None:
    def broken(byte_runs: tuple[tuple[int, int], ...]) -> None:
        raise RuntimeError("the copy could not be queued")

    with pytest.raises(RuntimeError, match="could not be queued"):
        engine.begin_put("k", "uint8", (NBYTES,), copy_in=broken)
    stats = engine.stats()
    assert stats.host.free_pages == stats.host.total_pages
    assert stats.entries_filling == 0 and stats.reserved_filling_bytes == 0
    assert engine.host_store.inflight == {}  # nothing counted against the owner's quota
    h = engine.begin_put("k", "uint8", (NBYTES,))  # the key is free
    h.write(payload(2).tobytes())
    assert h.commit()


def test_copy_in_is_not_called_for_an_existing_key(engine: CacheEngine) -> None:
    engine.put("k", torch.from_numpy(payload(3)))
    calls: list[object] = []
    handle = engine.begin_put("k", "uint8", (NBYTES,), copy_in=calls.append)
    assert handle.exists_already and calls == []
    handle.skip_bytes()
    assert handle.commit() is False
    with pytest.raises(MetadataConflict):  # checked before any page or copy
        engine.begin_put("k", "uint8", (NBYTES + 1,), copy_in=calls.append)
    assert calls == []
