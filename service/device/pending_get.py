"""What a get-to-device hands out.

- :class:`Placement`: where the device tier put a batch of pinned entries, before the
  engine leases them;
- :class:`DeviceLease`: a leased entry's place in a device pool;
- :class:`PendingGet`: a get whose copies may still run.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from embcache.service.host.entries import Entry
from embcache.service.host.leases import Lease

if TYPE_CHECKING:
    from embcache.service.device.pool import DevicePool
    from embcache.service.device.residency import Residency


@dataclass(slots=True)
class Placement:
    """A batch of pinned entries made resident in one pool (``DeviceTier.place``): per
    entry of the batch (None: a miss) its residency and whether it was there already, the
    events its copies record, and the bytes copied by direction."""

    pool: DevicePool
    entries: list[Entry | None]
    residencies: list[Residency | None]
    hits: list[bool]
    events: list[torch.cuda.Event]
    copied: dict[str, int]


@dataclass(frozen=True, slots=True)
class DeviceLease:
    """Where a leased entry's bytes are in a device pool."""

    lease: Lease
    pool_id: str
    gpu_uuid: str
    page_bytes: int
    page_ids: tuple[int, ...]  # physical device pages, in order
    offset: int | None  # byte offset when the pages are one run, else None
    resident_hit: bool  # True: no copy was needed

    @property
    def key(self) -> str:
        return self.lease.key


class PendingGet:
    """A get-to-device whose leases are taken and whose copies are queued.

    ``results`` may be handed out only after ``wait()`` (or once ``done()`` is True): until
    then the pages of loaded entries are still being written. The leases are the caller's
    either way (release them if it gives up).
    """

    def __init__(
        self,
        results: list[DeviceLease | None],
        table: torch.Tensor | None,
        events: list[torch.cuda.Event],
        copied: dict[str, int],
        observe: Callable[[str, int, float], None],
    ) -> None:
        self.results = results
        self.table = table
        self._events = events
        self.copied = copied  # bytes this get copies into the pool by direction ("h2d", "d2d")
        self._observe = observe
        self._start: float | None = time.perf_counter()  # None once observed

    @property
    def loaded_bytes(self) -> int:
        """Bytes this get copies into the device pool (0: all resident hits)."""
        return sum(self.copied.values())

    def done(self) -> bool:
        """True once every copy the results depend on has completed (never blocks)."""
        return not self.unfinished()

    def unfinished(self) -> list[torch.cuda.Event]:
        """The copy events that have not fired yet (never blocks; empty: ``done()``)."""
        left = [ev for ev in self._events if not ev.query()]
        if not left:
            self._finish()
        return left

    def wait(self) -> tuple[list[DeviceLease | None], torch.Tensor | None]:
        """Block until the copies are complete; then ``(results, table)`` may be handed out."""
        for ev in self._events:
            ev.synchronize()
        self._finish()
        return self.results, self.table

    def _finish(self) -> None:
        if self._start is not None:
            seconds = time.perf_counter() - self._start
            for direction, nbytes in self.copied.items():
                if nbytes:
                    self._observe(direction, nbytes, seconds)
        self._start = None
        self._events = []
