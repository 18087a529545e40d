"""A device pool's page-table updates, queued and launched together.

Gets bind the pages they load and evictions unbind them, but nothing on a get's path reads
the tables: copies use the page ids the host allocators hand out. So the updates wait in a
queue and are launched together (:meth:`TableUpdates.flush`) once the oldest has waited
``flush_every_s``, or once too many wait, or when someone is about to read the tables.
Without MPS each kernel launch of the daemon's takes a GPU time slice from the decoders'
kernels, so fewer launches cost the model less (docs/device.md).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from embcache import kernels


class Residency(Protocol):
    """What a binding needs of a residency (``pool.Residency``)."""

    @property
    def vstart(self) -> int: ...

    @property
    def npages(self) -> int: ...

    @property
    def runs(self) -> Sequence[tuple[int, int]]: ...


MAX_QUEUED_UPDATES = 4096  # residencies and vpage runs a flush may wait for, at most


class TableUpdates:
    """The queue of one pool's table updates, in order: ``("bind", residencies)`` or
    ``("unbind", vpage runs)``."""

    def __init__(
        self,
        v2p: torch.Tensor,
        p2v: torch.Tensor,
        on_stream: Callable[[], contextlib.AbstractContextManager[object]],
    ) -> None:
        self.v2p = v2p
        self.p2v = p2v
        self._on_stream = on_stream  # the pool's stream, for every launch
        self._ops: list[tuple[str, list[Any]]] = []
        self._since = 0.0  # monotonic time the oldest of them was queued
        self._items = 0
        self.flush_every_s = 0.0  # how long they may wait (the device tier sets it)

    @property
    def pending(self) -> bool:
        """True while updates wait for :meth:`flush`."""
        return bool(self._ops)

    def bind(self, batch: Sequence[Residency]) -> None:
        """Queue the bindings of new residencies (empty ones need none)."""
        batch = [res for res in batch if res.npages]
        if batch:
            self._queue("bind", batch)

    def unbind(self, vstart: int, npages: int) -> None:
        """Queue the tombstones of a dropped residency's virtual pages."""
        self._queue("unbind", [(vstart, npages)])

    def clear(self) -> None:
        """Drop what is queued (the pool failed or closed: its tables are not used again)."""
        self._ops.clear()
        self._items = 0

    def _queue(self, kind: str, items: list[Any]) -> None:
        if not self._ops:
            self._since = time.monotonic()
        self._items += len(items)
        if self._ops and self._ops[-1][0] == kind:
            self._ops[-1][1].extend(items)  # joins the previous op of its kind
        else:
            self._ops.append((kind, items))

    def flush(self) -> None:
        """Launch the queued updates: at most two launches, however many gets and evictions
        queued them. Only the net change reaches the device: the vpages whose binding from
        an earlier flush has ended are tombstoned (one ``free_unbind``), then the residencies
        still alive are bound (one ``bind``, or ``alloc_bind`` when their pages are one run).
        A residency bound and dropped between two flushes never touches the device. All of
        it is queued on the pool's stream, after the copies queued before it."""
        ops, self._ops = self._ops, []
        self._items = 0
        ended: list[tuple[int, int]] = []  # vpage runs bound on the device, now to tombstone
        alive: dict[int, Residency] = {}  # bound since the last flush, by first vpage
        for kind, items in ops:
            if kind == "bind":
                alive.update((r.vstart, r) for r in items)
                continue
            for vstart, npages in items:  # a residency is always unbound whole
                if alive.pop(vstart, None) is None:
                    ended.append((vstart, npages))
        if not ended and not alive:
            return
        with self._on_stream():
            if ended:
                vpages = self._ids(joined(sorted(ended)))
                kernels.free_unbind_inplace(vpages, self.v2p, self.p2v)
            if alive:
                items = list(alive.values())
                vpages = self._ids(joined([(r.vstart, r.npages) for r in items]))
                runs = joined([run for r in items for run in r.runs])
                if len(runs) == 1:  # no physical ids to upload
                    kernels.alloc_bind_inplace(vpages, runs[0][0], self.v2p, self.p2v)
                else:
                    kernels.bind_inplace(vpages, self._ids(runs), self.v2p, self.p2v)

    def flush_if_due(self) -> bool:
        """:meth:`flush` once the oldest queued update is ``flush_every_s`` old (or too many
        wait); True when it launched."""
        if not self._ops:
            return False
        if time.monotonic() - self._since < self.flush_every_s and self._items < MAX_QUEUED_UPDATES:
            return False
        self.flush()
        return True

    def _ids(self, runs: list[tuple[int, int]]) -> torch.Tensor:
        """The page ids of ``runs`` on the tables' device, queued on the current stream: one
        run is made there, several are uploaded (:func:`upload`)."""
        device = self.v2p.device
        if len(runs) == 1:
            s, k = runs[0]
            return torch.arange(s, s + k, dtype=torch.int64, device=device)
        ids = np.concatenate([np.arange(s, s + k, dtype=np.int64) for s, k in runs])
        return upload(torch.from_numpy(ids), device)


def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor on ``device``, queued on the current stream without the host waiting for
    the work queued before it (pinned staging; a pageable copy would wait)."""
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def joined(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``runs`` with each run that starts where the previous one ends joined to it."""
    out: list[tuple[int, int]] = []
    for s, k in runs:
        if out and out[-1][0] + out[-1][1] == s:
            out[-1] = (out[-1][0], out[-1][1] + k)
        else:
            out.append((s, k))
    return out
