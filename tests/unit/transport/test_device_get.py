"""How a device get (``transport/device_get.py``, every transport's) waits for its copies:
polled on the loop when short, in a worker thread when long or late; a call cancelled
meanwhile gives its leases back."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.service.config import Settings
from embcache.service.device.pool import DevicePool
from embcache.service.engine import CacheEngine
from embcache.service.transport import device_get
from embcache.service.transport.device_get import wait_copies
from embcache.service.transport.handlers.device import DevicePlane


class FakePending:
    def __init__(self, busy_polls: int, loaded_bytes: int) -> None:
        self.busy_polls = busy_polls
        self.loaded_bytes = loaded_bytes
        self.polls = 0
        self.waited_in: list[str] = []

    def done(self) -> bool:
        self.polls += 1
        return self.polls > self.busy_polls

    def wait(self) -> None:
        self.waited_in.append(threading.current_thread().name)


def test_a_short_copy_is_polled_on_the_loop() -> None:
    p = FakePending(busy_polls=5, loaded_bytes=4 << 20)
    asyncio.run(wait_copies(p))  # type: ignore[arg-type]
    assert p.polls == 6 and p.waited_in == []


def test_a_long_copy_is_waited_for_in_a_thread() -> None:
    p = FakePending(busy_polls=10**9, loaded_bytes=1 << 30)  # 1 GiB: ~50 ms at the spin rate
    asyncio.run(wait_copies(p))  # type: ignore[arg-type]
    assert p.polls == 1
    assert len(p.waited_in) == 1 and p.waited_in[0] != threading.main_thread().name


def test_a_late_short_copy_falls_back_to_a_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device_get, "SPIN_S", 0.001)
    p = FakePending(busy_polls=10**9, loaded_bytes=1 << 10)
    asyncio.run(wait_copies(p))  # type: ignore[arg-type]
    assert p.polls > 1 and len(p.waited_in) == 1


def test_a_cancelled_device_get_gives_its_leases_back(
    shm_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = Settings(host_pool_bytes=64 * 4096, page_bytes=4096, shm_name=shm_name,
                        device="cpu")  # fmt: skip
    pool = DevicePool(torch.device("cpu"), 16 * 4096, 4096, ipc_mode="none")
    with CacheEngine(settings, device_pools=[pool]) as engine:
        engine.put("a", torch.ones(100, dtype=torch.uint8))
        plane = DevicePlane(engine, settings)
        started = asyncio.Event()

        async def never(_pending: object) -> None:
            started.set()
            await asyncio.Event().wait()

        monkeypatch.setattr(device_get, "wait_copies", never)
        request = pb.GetRequest(keys=["a", "a"], gpu_uuid=pool.gpu_uuid)

        async def run() -> None:
            task = asyncio.ensure_future(plane.get(request, "client", lambda _owner: True))
            await started.wait()
            assert engine.stats().leases_active == 2
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        asyncio.run(run())
        assert engine.stats().leases_active == 0


def test_copies_replied_with_an_event_are_observed_from_loop_timers() -> None:
    """``observe_later`` polls until the copy is done (so its time reaches the metrics),
    stops at a device error, and never polls past its limit."""

    class Failing(FakePending):
        def done(self) -> bool:
            self.polls += 1
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    async def main() -> tuple[int, int, int]:
        done_later, failing, stuck = FakePending(3, 1), Failing(0, 1), FakePending(10**9, 1)
        device_get.observe_later(done_later, period_s=0.001)  # type: ignore[arg-type]
        device_get.observe_later(failing, period_s=0.001)  # type: ignore[arg-type]
        device_get.observe_later(stuck, period_s=0.001, limit_s=0.02)  # type: ignore[arg-type]
        await asyncio.sleep(0.2)
        return done_later.polls, failing.polls, stuck.polls

    done_polls, failing_polls, stuck_polls = asyncio.run(main())
    assert done_polls == 4 and failing_polls == 1
    assert 2 <= stuck_polls <= 25  # stopped near its 20 ms limit, not at 200
