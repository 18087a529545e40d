"""What the host store shows of itself: its counters and sizes, its pages' states.

Functions over the parts the store hands them (``HostStore.counts``, ``page_states``): they
read, never change, and return plain values. Called under the engine's lock, like every
store method.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from embcache.service.host.allocator import PageRunAllocator
from embcache.service.host.entries import Entry, EntryTable
from embcache.service.host.leases import LeaseTable
from embcache.service.host.prealloc import PutPrealloc
from embcache.service.host.quarantine import Quarantine
from embcache.service.host.read_table import ReadTable
from embcache.service.host.reservations import Reservations
from embcache.service.host.stats import PoolStats

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
    # device copies offered in it / withdrawn / not offered (too many runs, sections full)
    table_device: tuple[int, int, int] = (0, 0, 0)


def host_counts(
    page: int,
    alloc: PageRunAllocator,
    prealloc: PutPrealloc,
    entries: EntryTable,
    filling: Reservations,
    leases: LeaseTable,
    quarantine: Quarantine,
    reads: ReadTable | None,
    runs_hist: Counter[str],
    counters: Counter[str],
    max_entries: int,
) -> HostCounts:
    """A snapshot for the stats, in pages of ``page`` bytes; the prealloc's pages count as
    free (capacity on loan to device puts)."""
    pre = prealloc.pages
    free_pages = alloc.num_free_pages + pre
    used_pages = alloc.num_pages - free_pages
    pool = PoolStats(
        "host",
        alloc.num_pages * page,
        used_pages * page,
        free_pages * page,
        page,
        alloc.num_pages,
        used_pages,
        free_pages,
        alloc.largest_free_run,  # runs the allocator holds (the prealloc's not among them)
        alloc.num_free_runs,
    )
    return HostCounts(
        pool=pool,
        entries_ready=len(entries),
        entries_filling=len(filling),
        reserved_filling_bytes=sum(e.num_pages for e in filling.entries()) * page,
        metadata_bytes=entries.meta_bytes,
        max_entries=max_entries,
        leases_active=len(leases),
        lease_owners=leases.owners(),
        runs_per_entry={k: v for k, v in runs_hist.items() if v},
        counters=dict(counters),
        prealloc_bytes=pre * page,
        quarantined=len(quarantine),
        # pages kept out of reuse for live processes: their views, and their writes
        quarantined_bytes=quarantine.nbytes + filling.written.pages * page,
        table_entries=len(reads) if reads is not None else 0,
        table_skipped=reads.skipped if reads is not None else 0,
        table_device=(
            (reads.device_published, reads.device_withdrawn, reads.device_skipped)
            if reads is not None
            else (0, 0, 0)
        ),
    )


def page_states(num_pages: int, ready: Iterable[Entry], filling: Iterable[Entry]) -> np.ndarray:
    """One uint8 per host page: 0 free, 1 filling, 2 ready, 3 leased."""
    states = np.zeros(num_pages, dtype=np.uint8)
    for entry in filling:
        for start, n in entry.runs:
            states[start : start + n] = PAGE_FILLING
    for entry in ready:
        value = PAGE_LEASED if entry.ref_cnt else PAGE_READY
        for start, n in entry.runs:
            states[start : start + n] = value
    return states
