"""The client's pool of interprocess events (clients/device/ipc_events.py), with a fake CUDA.

An event is lent for one call and comes back only when the call says it returned; an event
that never comes back (its call failed) is never handed out again; each GPU has its own.
"""

from __future__ import annotations

import itertools
import threading

import pytest
import torch

from embcache.clients.device import ipc_events


class FakeEvent:
    ids = itertools.count()

    def __init__(self, interprocess: bool = False) -> None:
        assert interprocess
        self.handle = b"%02d" % next(FakeEvent.ids) * 32
        self.records: list[object] = []

    def record(self, stream: object) -> None:
        self.records.append(stream)

    def ipc_handle(self) -> bytes:
        assert self.records, "a handle needs a recorded event"
        return self.handle


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> ipc_events.IpcEvents:
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: f"stream-{device.index}")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return ipc_events.IpcEvents()


def test_an_event_is_reused_only_after_its_call_returned(events: ipc_events.IpcEvents) -> None:
    a = events.record(torch.device("cuda", 0))
    b = events.record(torch.device("cuda", 0))  # a is still lent: a new one
    assert a.handle != b.handle and events.created == 2
    a.done()
    a.done()  # twice is once: a must not be lent to two calls
    c = events.record(torch.device("cuda", 0))
    assert c is a and c.event.records == ["stream-0", "stream-0"]
    d = events.record(torch.device("cuda", 0))
    assert d is not a and events.created == 3  # b never came back (its call failed)


def test_each_gpu_has_its_own_events(events: ipc_events.IpcEvents) -> None:
    a = events.record(torch.device("cuda", 1))
    a.done()
    b = events.record(torch.device("cuda"))  # no index: the current device, 0
    assert b is not a and b.device == 0 and b.event.records == ["stream-0"]
    c = events.record(torch.device("cuda", 1))
    assert c is a and c.event.records == ["stream-1", "stream-1"]


def test_threads_never_share_a_lent_event(events: ipc_events.IpcEvents) -> None:
    lent: set[int] = set()
    clash = []
    lock = threading.Lock()

    def worker() -> None:
        for _ in range(200):
            rec = events.record(torch.device("cuda", 0))
            with lock:
                if id(rec) in lent:
                    clash.append(rec)
                lent.add(id(rec))
            with lock:
                lent.discard(id(rec))
            rec.done()

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not clash and events.created <= 4
