"""Page ids a gather kernel reads straight from pinned host memory (no copy call).

A client's gather of fragmented entries needs the batch's page ids on the GPU. Uploading them
costs a ``cudaMemcpyAsync`` per reply, whose host time grows while the daemon's copy into the
same GPU runs: most of a large reply's decode (docs/device.md). Instead, each device keeps a
small ring of pinned host slots that the GPU also sees as a CUDA tensor (unified addressing):
the ids are written with numpy and the gather kernel reads them over PCIe (2 KiB for 256
pages).

A slot is reused only after the gather that read it has run (one event per slot, recorded
after the launch; usually long done when the ring comes round). The first ring of a process
checks itself once against an uploaded index; where it fails, or the ids do not fit a slot,
callers upload as before (:func:`ring_for` returns None).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

SLOTS = 16  # gathers in flight per device before a slot must wait for its last reader
CAPACITY = 1 << 14  # ids per slot: 16384 pages, 4 GiB of 256 KiB pages per reply

_BUSY = object()  # a slot handed out whose gather has not been launched yet
_UNSET = object()


class _CaiView:
    """A ``__cuda_array_interface__`` over a device-visible address (no ownership)."""

    def __init__(self, ptr: int, shape: tuple[int, ...]) -> None:
        self.__cuda_array_interface__ = {
            "shape": shape,
            "typestr": "<i8",
            "data": (ptr, False),
            "version": 2,
            "strides": None,
        }


class UvaIds:
    """The ring of one device."""

    def __init__(self, device: torch.device) -> None:
        from embcache import kernels

        self.device = device
        self.host = torch.empty((SLOTS, CAPACITY), dtype=torch.int64, pin_memory=True)
        self._np = self.host.numpy()
        rt = kernels.cuda_runtime()
        with torch.cuda.device(device):
            ptr = self.host.data_ptr()
            if rt is not None:
                ptr = rt.host_device_pointer(ptr)
            self.view = torch.as_tensor(_CaiView(ptr, (SLOTS, CAPACITY)), device=device)
        self._events = [torch.cuda.Event() for _ in range(SLOTS)]
        self._state: list[Any] = [None] * SLOTS  # None: free, _BUSY, or an Event recorded
        self._next = 0
        self._lock = threading.Lock()

    def put(self, ids: np.ndarray) -> tuple[torch.Tensor, int] | None:
        """A CUDA tensor over a slot holding ``ids`` and the slot number (give it back with
        :meth:`launched`), or None when the ids do not fit or every slot is busy."""
        n = int(ids.size)
        if n > CAPACITY:
            return None
        with self._lock:
            for k in range(SLOTS):
                slot = (self._next + k) % SLOTS
                if self._state[slot] is not _BUSY:
                    break
            else:
                return None
            last, self._state[slot] = self._state[slot], _BUSY
            self._next = (slot + 1) % SLOTS
        if last is not None:
            last.synchronize()  # the gather that read this slot has run
        self._np[slot, :n] = ids
        return self.view[slot, :n], slot

    def launched(self, slot: int, stream: torch.cuda.Stream) -> None:
        """The gather reading ``slot`` is queued on ``stream``: the slot is free once it
        has run."""
        event = self._events[slot]
        event.record(stream)
        with self._lock:
            self._state[slot] = event

    def abandon(self, slot: int) -> None:
        """``slot`` was handed out but nothing will read it: free it."""
        with self._lock:
            self._state[slot] = None

    def check(self) -> bool:
        """Once per ring: a gather through a slot equals one through an uploaded index."""
        rows = torch.arange(64, dtype=torch.int64, device=self.device).view(16, 4)
        ids = np.array([5, 0, 15, 7], dtype=np.int64)
        got = self.put(ids)
        if got is None:
            return False
        index, slot = got
        out = rows.index_select(0, index)
        self.launched(slot, torch.cuda.current_stream(self.device))
        want = rows.index_select(0, torch.from_numpy(ids).to(self.device))
        return bool(torch.equal(out, want))


_rings: dict[int, UvaIds | None] = {}
_rings_lock = threading.Lock()


def ring_for(device: torch.device) -> UvaIds | None:
    """The device's ring, made (and checked) on first use; None where it cannot work."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    ring = _rings.get(index, _UNSET)
    if ring is not _UNSET:
        return ring  # type: ignore[return-value]
    with _rings_lock:
        if index not in _rings:
            made: UvaIds | None = None
            try:
                made = UvaIds(torch.device("cuda", index))
                if not made.check():
                    log.warning("page ids read from pinned memory came out wrong; uploading")
                    made = None
            except (RuntimeError, TypeError, ValueError) as exc:
                log.info("no pinned page-id ring on cuda:%d (%s); uploading ids", index, exc)
                made = None
            _rings[index] = made
        return _rings[index]
