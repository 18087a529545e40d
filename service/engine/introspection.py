"""Read-only views of the engine for stats, operators and the pool map."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from embcache.service.host.entries import Entry
from embcache.service.host.stats import EngineStats, EntryInfo, PoolStats

if TYPE_CHECKING:
    from embcache.service.engine import CacheEngine

PAGE_FREE, PAGE_FILLING, PAGE_READY, PAGE_LEASED = 0, 1, 2, 3


def stats(self: CacheEngine) -> EngineStats:
    with self._lock:
        self._expire_locked(self._clock())
        s = self.settings
        a = self._alloc
        landing = self._landing.pages  # free capacity on loan to device puts: counted free
        free_pages = a.num_free_pages + landing
        used_pages = a.num_pages - free_pages
        host = PoolStats(
            "host",
            s.host_pool_bytes,
            used_pages * s.page_bytes,
            free_pages * s.page_bytes,
            s.page_bytes,
            a.num_pages,
            used_pages,
            free_pages,
            a.largest_free_run,  # runs the allocator holds (the landing's not among them)
            a.num_free_runs,
        )
        c = self._counters
        return EngineStats(
            host=host,
            device=[pool.stats() for pool in self.device_tier.pools],
            entries_ready=len(self._entries),
            entries_filling=len(self._filling),
            reserved_filling_bytes=sum(e.num_pages for e, _ in self._filling.values())
            * s.page_bytes,
            hits=c["hits"],
            misses=c["misses"],
            evictions=c["evictions"],
            evicted_bytes=c["evicted_bytes"],
            puts_committed=c["puts_committed"],
            puts_aborted=c["puts_aborted"],
            put_bytes=c["put_bytes"],
            leases_active=len(self._leases),
            leases_expired=c["leases_expired"],
            lease_owners=self._leases.owners(),
            runs_per_entry={k: v for k, v in self._runs_hist.items() if v},
            bytes_copied={d: c[f"copy_{d}"] for d in ("h2d", "d2h", "d2d")},
            device_resident=[pool.resident_entries for pool in self.device_tier.pools],
            draining=self._draining,
            put_landing_bytes=landing * s.page_bytes,
        )


def entry_info(self: CacheEngine, key: str) -> EntryInfo | None:
    """Metadata, page runs, residency and lease holders of one READY entry."""
    with self._lock:
        entry = self._entries.get(key)
        if entry is None:
            return None
        now = self._clock()
        info = _info(self, entry, now)
        if entry.ref_cnt:
            holders = tuple(self._leases.holders(entry, now))
            info = dataclasses.replace(info, lease_holders=holders)
        return info


def list_entries(
    self: CacheEngine, offset: int = 0, limit: int = 100, state: str | None = None
) -> tuple[int, list[EntryInfo]]:
    """Entries in LRU-agnostic key order of insertion; ``state`` filters ready/filling."""
    with self._lock:
        now = self._clock()
        pool: list[Entry] = []
        if state in (None, "ready"):
            pool.extend(self._entries.by_key.values())
        if state in (None, "filling"):
            pool.extend(e for e, _ in self._filling.values())
        page = pool[max(offset, 0) : max(offset, 0) + max(limit, 0)]
        return len(pool), [_info(self, e, now) for e in page]


def _info(self: CacheEngine, entry: Entry, now: float) -> EntryInfo:
    pools = self.device_tier.pools
    devices = tuple(f"device:{p.index}" for p in pools if p.is_resident(entry))
    return EntryInfo(
        entry.key,
        entry.state.name.lower(),
        entry.dtype.name,
        entry.shape,
        entry.nbytes,
        entry.runs,
        entry.ref_cnt,
        max(0.0, now - entry.last_access),
        ("host", *devices),
    )


def page_states(self: CacheEngine) -> np.ndarray:
    """One uint8 per host page: 0 free, 1 filling, 2 ready, 3 leased."""
    states = np.zeros(self.host_pool.num_pages, dtype=np.uint8)
    with self._lock:
        for entry, _ in self._filling.values():
            for start, n in entry.runs:
                states[start : start + n] = PAGE_FILLING
        for entry in self._entries.by_key.values():
            value = PAGE_LEASED if entry.ref_cnt else PAGE_READY
            for start, n in entry.runs:
                states[start : start + n] = value
    return states


def device_page_states(self: CacheEngine, index: int = 0) -> np.ndarray:
    """One uint8 per page of device pool ``index``: 0 free, 1 resident, 2 leased (a pool
    out of service holds nothing). DeviceUnavailable when there is no such pool."""
    pool = self.device_tier._at(index)
    with self._lock:
        return pool.page_states()
