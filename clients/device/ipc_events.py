"""Interprocess CUDA events of this process, reused from call to call.

``PutFromDevice``, ``PutFromDeviceBatch`` and ``GetInto`` carry an event recorded after the
work that writes (or still reads) the client's tensor; the daemon waits on it before it
copies. Opening an event handle costs the daemon hundreds of microseconds, waiting on a
fired one a few, so the daemon keeps what it opened and this process reuses its events:
an event goes back to the pool once the call that carried it returned (the daemon has
waited on it by then). An event whose call failed is never reused, since the daemon might
still be about to wait on it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch


@dataclass(eq=False, slots=True)
class Recorded:
    """An event recorded on a stream, with its IPC handle; give it back with :meth:`done`."""

    event: torch.cuda.Event
    handle: bytes
    device: int
    pool: IpcEvents
    lent: bool = True

    def done(self) -> None:
        """The call that carried the event returned: the event may be recorded again."""
        if self.lent:
            self.lent = False
            self.pool.give_back(self)


class IpcEvents:
    """The process's free events, per GPU: one is lent to each call and comes back when
    the call returned."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: dict[int, list[Recorded]] = {}
        self.created = 0

    def record(self, device: torch.device) -> Recorded:
        """An event recorded now on ``device``'s current stream. RuntimeError when this
        process cannot make interprocess events."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        with self._lock:
            free = self._free.get(index)
            rec = free.pop() if free else None
        stream = torch.cuda.current_stream(torch.device("cuda", index))
        if rec is None:
            event = torch.cuda.Event(interprocess=True)
            event.record(stream)
            rec = Recorded(event, bytes(event.ipc_handle()), index, self)
            self.created += 1
        else:
            rec.event.record(stream)
            rec.lent = True
        return rec

    def give_back(self, rec: Recorded) -> None:
        """``rec``'s call returned: its event may be recorded for another call."""
        with self._lock:
            self._free.setdefault(rec.device, []).append(rec)


EVENTS = IpcEvents()  # one pool per process: handles are per process, whoever the client
