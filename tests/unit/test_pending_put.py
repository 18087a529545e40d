"""Puts from device memory started now and ended later (``pending_put.py``), on a CPU
"device": nothing is visible before ``finish``; ``abort`` and failures give every page back,
and not before the copies into them are complete."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import zlib

import pytest
import torch

from embcache.service.config import Settings
from embcache.service.device_pool import DevicePool
from embcache.service.engine import CacheEngine
from embcache.service.errors import ChecksumMismatch
from embcache.service.pending_put import PendingPut
from embcache.service.transport import grpc_device_puts

PAGE = 4096


@pytest.fixture
def engine(shm_name: str):
    s = Settings(host_pool_bytes=64 * PAGE, page_bytes=PAGE, shm_name=shm_name, device="cpu")
    pool = DevicePool(torch.device("cpu"), 8 * PAGE, PAGE)
    with CacheEngine(s, device_pools=[pool]) as e:
        yield e


def blob(nbytes: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


class SlowCopy:
    """An event that fires when the test says so (a copy still running)."""

    def __init__(self) -> None:
        self.fired = threading.Event()
        self.waited = False

    def query(self) -> bool:
        return self.fired.is_set()

    def synchronize(self) -> None:
        self.waited = True
        assert self.fired.wait(10), "the copy never ended"


def running(pending: PendingPut) -> SlowCopy:
    copy = SlowCopy()
    pending._events.append(copy)  # type: ignore[arg-type]
    return copy


def test_nothing_visible_before_finish(engine: CacheEngine) -> None:
    items = [("a", blob(3 * PAGE, 1)), ("b", blob(100, 2))]
    before = engine.stats().host.used_pages
    pending = engine.start_put_from_device_many(items)
    assert engine.exists(["a", "b"]) == [False, False]
    assert engine.stats().entries_filling == 2 and pending.loaded_bytes == 3 * PAGE + 100
    copy = running(pending)
    assert not pending.done()
    copy.fired.set()
    assert pending.done()
    assert pending.finish() == [True, True]
    assert engine.exists(["a", "b"]) == [True, True]
    assert engine.stats().host.used_pages == before + 4
    with pytest.raises(RuntimeError, match="ended"):
        pending.finish()
    pending.abort()  # after finish: nothing to give back
    assert engine.exists(["a", "b"]) == [True, True]


def test_abort_gives_back_every_page_after_the_copies(engine: CacheEngine) -> None:
    before = engine.stats()
    pending = engine.start_put_from_device_many([("a", blob(5 * PAGE, 1)), ("b", blob(9, 2))])
    copy = running(pending)
    copy.fired.set()
    pending.abort()
    assert copy.waited  # waited for the copy before the pages went back
    pending.abort()
    after = engine.stats()
    assert engine.exists(["a", "b"]) == [False, False]
    assert after.entries_filling == 0 and after.host.used_pages == before.host.used_pages
    with pytest.raises(RuntimeError, match="ended"):
        pending.finish()


def test_a_checksum_failing_at_finish_leaves_nothing(engine: CacheEngine) -> None:
    t = blob(2 * PAGE, 3)
    before = engine.stats().host.used_pages
    pending = engine.start_put_from_device_many(
        [("a", t), ("b", t)], checksums=[zlib.crc32(t.numpy().tobytes()), 1]
    )
    with pytest.raises(ChecksumMismatch):
        pending.finish()
    assert engine.exists(["a", "b"]) == [False, False]
    assert engine.stats().host.used_pages == before and engine.stats().entries_filling == 0


def test_a_cancelled_call_gives_pages_back_once_its_copies_end(engine: CacheEngine) -> None:
    """The gRPC plane's path when a PutFromDevice is cancelled while its copy runs."""
    before = engine.stats().host.used_pages

    async def cancelled() -> tuple[PendingPut, SlowCopy, contextlib.ExitStack]:
        pending = engine.start_put_from_device_many([("a", blob(4 * PAGE, 1))])
        copy = running(pending)
        stack = contextlib.ExitStack()
        closed: list[bool] = []
        stack.callback(closed.append, True)  # the client's mappings
        grpc_device_puts._abort_when_copied(pending, stack)
        await asyncio.sleep(0.05)
        # still copying: the pages and the mappings are held
        assert engine.stats().entries_filling == 1 and not closed
        copy.fired.set()
        for _ in range(200):
            await asyncio.sleep(0.01)
            if closed:
                break
        assert closed == [True]
        return pending, copy, stack

    asyncio.run(cancelled())
    assert engine.exists(["a"]) == [False]
    assert engine.stats().host.used_pages == before and engine.stats().entries_filling == 0
