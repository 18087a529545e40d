"""The daemon's cache of client allocations opened through IPC, and the worker-thread helper
of the device RPCs (a cancelled call gives back what its thread took)."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from embcache.errors import DeviceUnavailable, InvalidArgument
from embcache.service.device.ipc.cache import IpcCache, check_ipc_handle
from embcache.service.transport.device_get import in_thread
from embcache.service.transport.handlers.ipc_tensors import contiguous_strides


class Mapping:
    def __init__(self, nbytes: int) -> None:
        self.buf = torch.arange(nbytes, dtype=torch.int32).to(torch.uint8)
        self.nbytes = nbytes
        self.closed = False

    def tensor(self, offset: int = 0, nbytes: int | None = None) -> torch.Tensor:
        assert not self.closed
        return self.buf[offset : offset + (nbytes or 0)]

    def close(self) -> None:
        self.closed = True


class Event:
    def __init__(self) -> None:
        self.waits = 0

    def synchronize(self) -> None:
        self.waits += 1

    def query(self) -> bool:
        self.waits += 1
        return True


class Backend:
    def __init__(self) -> None:
        self.opened: dict[bytes, list[Mapping]] = {}

    def available(self) -> bool:
        return True

    def gpu_index(self, gpu_uuid: str) -> int | None:
        return 0

    def open(self, handle: bytes, device: int, alloc_size: int) -> Mapping:
        live = [m for m in self.opened.get(handle, []) if not m.closed]
        assert not live, "a handle must never be opened twice while mapped"
        mapping = Mapping(alloc_size)
        self.opened.setdefault(handle, []).append(mapping)
        return mapping

    def open_event(self, handle: bytes, device: int) -> Event:
        return Event()


def h(i: int) -> bytes:
    return bytes([i]) * 64


def use(cache: IpcCache, owner: str, handle: bytes, nbytes: int = 64) -> torch.Tensor:
    with cache.tensor(owner, handle, 0, 1024, 16, nbytes) as t:
        return t.clone()


def test_opened_once_shared_by_owners_closed_with_the_last() -> None:
    backend = Backend()
    cache = IpcCache(backend, max_mappings=8)
    first = use(cache, "s1", h(1))
    assert torch.equal(first, torch.arange(16, 80).to(torch.uint8))
    use(cache, "s2", h(1))
    use(cache, "s1", h(2))
    assert cache.opens == 2 and len(cache) == 2
    assert cache.drop_owner("s1") == 1  # h(2) had no other owner; h(1) is still s2's
    assert backend.opened[h(2)][0].closed and not backend.opened[h(1)][0].closed
    assert cache.drop_owner("s2") == 1 and len(cache) == 0
    use(cache, "s3", h(1))  # opened again after it was closed
    assert len(backend.opened[h(1)]) == 2


def test_stats_and_their_metrics() -> None:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from embcache.service.observability.metrics import IpcCollector

    backend = EventBackend()
    cache = IpcCache(backend, max_mappings=8)
    use(cache, "s1", h(1))
    use(cache, "s2", h(2))
    cache.wait_event("s1", h(5), 0)
    cache.drop_owner("s2")
    s = cache.stats()
    assert (s.mappings, s.mapped_bytes, s.opens, s.closes) == (1, 1024, 2, 1)
    assert (s.events, s.event_opens) == (1, 1)
    registry = CollectorRegistry()
    registry.register(IpcCollector(cache))
    samples = {
        sample.name: sample.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for sample in family.samples
    }
    assert samples == {
        "embcache_ipc_mappings": 1,
        "embcache_ipc_mapped_bytes": 1024,
        "embcache_ipc_opens_total": 2,
        "embcache_ipc_closes_total": 1,
        "embcache_ipc_events": 1,
        "embcache_ipc_event_opens_total": 1,
    }


def test_lru_bound_skips_mappings_in_use() -> None:
    backend = Backend()
    cache = IpcCache(backend, max_mappings=2)
    with cache.tensor("a", h(1), 0, 1024, 0, 8):
        use(cache, "a", h(2))
        use(cache, "a", h(3))  # over the bound: h(2) goes, h(1) is in use
        assert backend.opened[h(2)][0].closed and not backend.opened[h(1)][0].closed
        use(cache, "a", h(4))  # over again: h(3) goes (h(1) still in use)
        assert backend.opened[h(3)][0].closed and len(cache) == 2
        cache.close()  # h(1) is in use: it closes when released, not before
        assert not backend.opened[h(1)][0].closed
        with pytest.raises(DeviceUnavailable, match="being closed"):
            use(cache, "b", h(1))  # never open a handle that is still mapped
    assert backend.opened[h(1)][0].closed and len(cache) == 0


def test_bounds_and_devices() -> None:
    cache = IpcCache(Backend(), max_mappings=2)
    with (
        pytest.raises(InvalidArgument, match="outside"),
        cache.tensor("a", h(1), 0, 1024, 1000, 25),
    ):
        pass
    with (
        pytest.raises(InvalidArgument, match="another GPU"),
        cache.tensor("a", h(1), 1, 1024, 0, 8),
    ):
        pass
    with pytest.raises(ValueError):
        IpcCache(Backend(), max_mappings=0)
    with pytest.raises(InvalidArgument):
        check_ipc_handle(b"x" * 63, "ipc_handle")
    assert check_ipc_handle(h(1), "ipc_handle") == h(1)


class EventBackend(Backend):
    def __init__(self) -> None:
        super().__init__()
        self.event_opens: list[tuple[bytes, int]] = []
        self.events: dict[bytes, Event] = {}

    def open_event(self, handle: bytes, device: int) -> Event:
        if handle == h(99):
            raise InvalidArgument("cannot open event_handle")
        self.event_opens.append((handle, device))
        return self.events.setdefault(handle, Event())


class BrokenEvent(Event):
    def synchronize(self) -> None:
        raise RuntimeError("device-side assert")


def test_events_opened_once_per_owner_and_handle() -> None:
    backend = EventBackend()
    cache = IpcCache(backend)
    for _ in range(3):
        cache.wait_event("a", h(1), 0)
    cache.wait_event("b", h(1), 0)  # another owner opens its own
    cache.wait_event("a", h(1), 1)  # the same bytes on another GPU are another event
    assert backend.event_opens == [(h(1), 0), (h(1), 0), (h(1), 1)]
    assert backend.events[h(1)].waits == 5 and cache.event_opens == 3
    cache.drop_owner("a")  # forgets a's events, keeps b's
    cache.wait_event("a", h(1), 0)
    cache.wait_event("b", h(1), 0)
    assert len(backend.event_opens) == 4
    with pytest.raises(InvalidArgument):
        cache.wait_event("a", h(99), 0)
    # callers without a session (a peer many processes may share) get no cached events
    for _ in range(2):
        cache.wait_event("anon:unix:", h(3), 0)
    assert backend.event_opens.count((h(3), 0)) == 2 and backend.events[h(3)].waits == 2


def test_event_cache_is_bounded_and_forgets_an_event_that_fails() -> None:
    from embcache.service.device.ipc.cache import MAX_EVENTS

    backend = EventBackend()
    cache = IpcCache(backend)
    for i in range(MAX_EVENTS + 5):
        cache.wait_event(f"o{i}", h(1), 0)
    assert len(cache._events) == MAX_EVENTS
    cache.wait_event("o0", h(1), 0)  # the least recently used went first
    assert len(backend.event_opens) == MAX_EVENTS + 6
    backend.events[h(2)] = BrokenEvent()
    for _ in range(2):
        with pytest.raises(InvalidArgument, match="wait"):
            cache.wait_event("x", h(2), 0)
    assert backend.event_opens.count((h(2), 0)) == 2  # not kept after it failed


class LateEvent(Event):
    """Fires on its third query; raises on a query once broken."""

    def __init__(self) -> None:
        super().__init__()
        self.queries = 0
        self.broken = False

    def query(self) -> bool:
        if self.broken:
            raise RuntimeError("device-side assert")
        self.queries += 1
        return self.queries >= 3


def test_a_polled_event_is_opened_once_per_call() -> None:
    """The daemon polls a put's event on its loop: one open per call even for a caller
    without a session (whose events are not kept), however many polls."""
    backend = EventBackend()
    cache = IpcCache(backend)
    for owner in ("anon:unix:", "s1"):
        backend.events[h(4)] = late = LateEvent()
        event = cache.event(owner, h(4), 0)
        polls = 1
        while not event.fired():
            polls += 1
        assert polls == 3 and late.queries == 3
    assert backend.event_opens == [(h(4), 0)] * 2
    late.broken = True  # a failing query: InvalidArgument, and the session forgets it
    with pytest.raises(InvalidArgument, match="wait"):
        cache.event("s1", h(4), 0).fired()
    cache.event("s1", h(4), 0)
    assert backend.event_opens == [(h(4), 0)] * 3


@pytest.mark.parametrize(
    ("shape", "strides", "contiguous"),
    [
        ([4, 3], [3, 1], True),
        ([4, 3], [1, 4], False),
        ([4, 1], [1, 99], True),  # a dim of size 1 may carry any stride
        ([0, 3], [7, 7], True),  # no elements
        ([4, 3], [3], False),
        ([5], [2], False),
    ],
)
def test_contiguity(shape: list[int], strides: list[int], contiguous: bool) -> None:
    assert (contiguous_strides(shape, strides) == strides) is contiguous


def test_cancelled_call_gives_back_what_its_thread_took() -> None:
    started, finish = threading.Event(), threading.Event()
    undone: list[int] = []

    def work() -> int:
        started.set()
        finish.wait(5)
        return 42

    async def scenario() -> None:
        task = asyncio.ensure_future(in_thread(work, undone.append))
        while not started.is_set():
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        finish.set()
        for _ in range(500):
            if undone:
                break
            await asyncio.sleep(0.01)
        assert await in_thread(lambda: 7, undone.append) == 7  # not cancelled: kept

    asyncio.run(scenario())
    assert undone == [42]
