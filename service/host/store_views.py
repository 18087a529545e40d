"""What the host store shows of itself: its entries, its counters, its pages' states.

A mixin of :class:`~embcache.service.host.store.HostStore` (the attributes it reads are
the store's), kept apart so the store's module holds its operations only. The engine calls
these under its lock, like every store method.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from embcache.service.host.allocator import PageRunAllocator
from embcache.service.host.entries import Entry, EntryTable
from embcache.service.host.leases import LeaseTable
from embcache.service.host.prealloc import PutPrealloc
from embcache.service.host.quarantine import Quarantine
from embcache.service.host.read_table import ReadTable
from embcache.service.host.stats import PoolStats
from embcache.service.host.write_holds import WriteHolds

PAGE_FREE, PAGE_FILLING, PAGE_READY, PAGE_LEASED = 0, 1, 2, 3


@dataclass(frozen=True, slots=True)
class HostCounts:
    """The store's counters and sizes at one moment (for the engine's stats)."""

    pool: PoolStats
    entries_ready: int
    entries_filling: int
    reserved_filling_bytes: int
    metadata_bytes: int
    max_entries: int
    leases_active: int
    lease_owners: int
    runs_per_entry: dict[str, int]
    counters: dict[str, int]
    prealloc_bytes: int
    quarantined: int = 0  # holds kept after a forced end (quarantine.py)
    quarantined_bytes: int = 0
    table_entries: int = 0  # entries in the read table (read_table.py)
    table_skipped: int = 0  # entries that did not fit it


class StoreViews:
    """Snapshots of the store's tables (module docstring)."""

    page_bytes: int
    alloc: PageRunAllocator
    reads: ReadTable | None
    prealloc: PutPrealloc
    entries: EntryTable
    leases: LeaseTable
    quarantine: Quarantine
    written: WriteHolds
    counters: Counter[str]
    max_entries: int
    _filling: dict[int, tuple[Entry, str]]
    _runs_hist: Counter[str]

    # -- views ---------------------------------------------------------------------------
    def snapshot(self, state: str | None) -> list[Entry]:
        """The entries now: READY in insertion order, then FILLING (``state`` keeps
        ``ready`` or ``filling`` only); one copy of the tables (``engine/listing.py``)."""
        found: list[Entry] = []
        if state in (None, "ready"):
            found = list(self.entries.by_key.values())
        if state in (None, "filling"):
            found.extend(entry for entry, _ in self._filling.values())
        return found

    def counts(self) -> HostCounts:
        """A snapshot for the stats; the prealloc's pages count as free (on loan)."""
        a, page = self.alloc, self.page_bytes
        prealloc = self.prealloc.pages  # free capacity on loan to device puts: counted free
        free_pages = a.num_free_pages + prealloc
        used_pages = a.num_pages - free_pages
        pool = PoolStats(
            "host",
            a.num_pages * page,
            used_pages * page,
            free_pages * page,
            page,
            a.num_pages,
            used_pages,
            free_pages,
            a.largest_free_run,  # runs the allocator holds (the prealloc's not among them)
            a.num_free_runs,
        )
        return HostCounts(
            pool=pool,
            entries_ready=len(self.entries),
            entries_filling=len(self._filling),
            reserved_filling_bytes=sum(e.num_pages for e, _ in self._filling.values()) * page,
            metadata_bytes=self.entries.meta_bytes,
            max_entries=self.max_entries,
            leases_active=len(self.leases),
            lease_owners=self.leases.owners(),
            runs_per_entry={k: v for k, v in self._runs_hist.items() if v},
            counters=dict(self.counters),
            prealloc_bytes=prealloc * page,
            quarantined=len(self.quarantine),
            # pages kept out of reuse for live processes: their views, and their writes
            quarantined_bytes=self.quarantine.nbytes + self.written.pages * page,
            table_entries=len(self.reads) if self.reads is not None else 0,
            table_skipped=self.reads.skipped if self.reads is not None else 0,
        )

    def page_states(self) -> np.ndarray:
        """One uint8 per host page: 0 free, 1 filling, 2 ready, 3 leased."""
        states = np.zeros(self.alloc.num_pages, dtype=np.uint8)
        for entry, _ in self._filling.values():
            for start, n in entry.runs:
                states[start : start + n] = PAGE_FILLING
        for entry in self.entries.by_key.values():
            value = PAGE_LEASED if entry.ref_cnt else PAGE_READY
            for start, n in entry.runs:
                states[start : start + n] = value
        return states
