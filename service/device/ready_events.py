"""Interprocess "ready" events: a device get may reply before its copies finish.

A client that asks for it (``GetRequest.ready_event``) receives a ``cudaIpcEventHandle``
with its reply, opens it once, and makes its stream wait on it on the GPU; the daemon then
need not wait for the copy before replying, so the copy overlaps the reply's trip, its
decoding and the client's gather launch.

Each pool keeps a ring of events, recorded on the pool's stream in turn. A client waits for
the event's latest record at the time it waits; if the daemon has recorded the same event
again meanwhile (the ring went round), that later record follows the first one on the same
stream, so the client waits a little longer, never too little. Handles are read once per
event, so a client opens each at most once.
"""

from __future__ import annotations

import threading

import torch

RING = 32  # events per pool; more only means more handles for a client to open


class ReadyEvents:
    """The ring of interprocess events of one device pool (CUDA only)."""

    def __init__(self, device: torch.device, ring: int = RING) -> None:
        assert device.type == "cuda", device
        self.device = device
        self._events: list[torch.cuda.Event] = []
        self._handles: list[bytes] = []
        self._ring = ring
        self._next = 0
        self._lock = threading.Lock()  # the loop and worker threads both record

    def mark(self, stream: torch.cuda.Stream, after: list[torch.cuda.Event]) -> bytes:
        """Record the next event of the ring on ``stream`` once ``after`` have fired (they
        may belong to other streams) and return its handle."""
        for ev in after:
            stream.wait_event(ev)
        with self._lock:
            slot = self._next
            self._next = (slot + 1) % self._ring
            if slot == len(self._events):
                with torch.cuda.device(self.device):
                    ev = torch.cuda.Event(interprocess=True)  # timing off, as IPC requires
                    ev.record(stream)
                    self._events.append(ev)
                    self._handles.append(bytes(ev.ipc_handle()))
                return self._handles[slot]
            self._events[slot].record(stream)
            return self._handles[slot]
