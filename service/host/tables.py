"""The host store's tables and what keeps them in step: pages, READY entries, counters.

A part of :class:`~embcache.service.host.store.HostStore` (``store.py``), which owns it
and hands it to its other parts (``lease_book.py``); nothing outside the store's package
sees it. The allocator, the key map with its LRU, the counters, the read table and the
warm-restart index change together here: an entry made READY is published, one evicted is
withdrawn and deleted from the index before its pages go back. No lock (the engine's).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

from embcache.service.host.allocator import PageRunAllocator, Run
from embcache.service.host.entries import Entry, EntryState, EntryTable
from embcache.service.host.evict import EvictOutcome
from embcache.service.host.host_pool import HostPool
from embcache.service.host.pool_index import PoolIndex
from embcache.service.host.prealloc import PutPrealloc
from embcache.service.host.read_table import ReadTable
from embcache.service.host.stats import run_bucket
from embcache.service.host.verify import entry_crc

Runs = tuple[tuple[int, int], ...]  # byte runs (offset, length) in the pool
CopyIn = Callable[[Runs], None]  # queues the copy of a put's bytes into those runs


class Tables:
    """The pages and READY entries of the host pool, with their counters (module docstring)."""

    def __init__(
        self,
        pool: HostPool,
        prealloc: PutPrealloc,
        on_evict: Callable[[Entry], None],
        reads: ReadTable | None,
        max_entries: int,
    ) -> None:
        self.pool = pool
        self.page_bytes = pool.page_bytes
        self.alloc = PageRunAllocator(pool.num_pages)  # free pages (the prealloc's are out)
        self.prealloc = prealloc
        self.entries = EntryTable()  # READY entries and the LRU of the unleased ones
        self.counters: Counter[str] = Counter()  # hits, misses, evictions, puts, ...
        self.runs_hist: Counter[str] = Counter()  # READY entries by number of page runs
        self.index: PoolIndex | None = None  # the warm-restart index, if the store keeps one
        self.reads = reads  # where same-node clients copy entries from
        self.max_entries = max_entries
        self._on_evict = on_evict

    def pages_for(self, nbytes: int) -> int:
        """Host pages an entry of ``nbytes`` takes."""
        return -(-nbytes // self.page_bytes)

    def byte_runs(self, runs: Sequence[Run], nbytes: int) -> tuple[tuple[int, int], ...]:
        """Byte ranges ``(offset, length)`` in the pool holding the first ``nbytes`` of ``runs``."""
        return tuple(self.pool.byte_runs(runs, nbytes))

    def reserve(self, npages: int) -> list[Run] | None:
        """Pages for a new entry, taking the prealloc's back before evicting anything;
        None (nothing evicted) when even evicting every unleased entry would not do."""
        if self.alloc.num_free_pages < npages and self.prealloc.pages:
            self.alloc.free(self.prealloc.drain())  # free capacity on loan: room first
        return self.take_pages(npages)

    def take_pages(self, npages: int) -> list[Run] | None:
        """``npages`` pages from the allocator, evicting LRU entries until they are free;
        None (nothing evicted) when even evicting every unleased entry would not do."""
        if self.alloc.num_free_pages + self.entries.evictable_pages < npages:
            return None
        while self.alloc.num_free_pages < npages:
            victim = self.entries.lru_oldest()
            assert victim is not None, "evictable page count out of step with the LRU"
            self.evict(victim)
        runs = self.alloc.allocate(npages)
        assert runs is not None, "allocation failed with enough free pages"
        return runs

    def top_up_prealloc(self) -> None:
        """Refill the prealloc to what the last puts asked for, evicting LRU entries as a
        put would; nothing when the pool has no room to spare."""
        n = self.prealloc.shortfall()
        if n and (runs := self.take_pages(n)) is not None:
            self.prealloc.add(runs)

    def entry_room(self, filling: int) -> bool:
        """Make room for one more entry under ``max_entries`` by evicting LRU entries (any
        size, zero-byte ones included); False, nothing evicted, when all are leased."""
        over = len(self.entries) + filling + 1 - self.max_entries
        if over > 0 and self.entries.evictable_count < over:
            return False
        for _ in range(max(over, 0)):
            victim = self.entries.lru_oldest()
            assert victim is not None, "evictable count out of step with the LRU"
            self.evict(victim)
        return True

    def take_prealloc(self, key: str, nbytes: int, copy_in: CopyIn) -> Runs | None:
        """Pages from the prealloc for a put of ``nbytes`` with its copy queued into them
        (``copy_in(byte_runs)``), for :meth:`reserve_put` with ``pages=``; None, nothing
        copied, when the prealloc has too few or the key is stored already."""
        if key in self.entries.by_key:
            return None
        pages = self.prealloc.take(self.pages_for(nbytes))
        if pages is None:
            return None
        try:
            copy_in(self.byte_runs(pages, nbytes))
        except BaseException:
            self.prealloc.give_back(pages)  # copy_in left no copy running
            raise
        return pages

    def add_ready(self, entry: Entry, now: float) -> None:
        """A complete entry becomes visible to readers."""
        self.adopt(entry, now)
        if self.index is not None and entry.crc32 is not None:
            self.index.add(entry, entry.crc32)  # its bytes are complete: a restart keeps it
        self.counters["puts_committed"] += 1
        self.counters["put_bytes"] += entry.nbytes

    def adopt(self, entry: Entry, now: float) -> None:
        """Make an entry READY without counting a put (a put's commit, or a warm restart)."""
        entry.state = EntryState.READY
        entry.last_access = now
        self.entries.add_ready(entry)
        self.runs_hist[run_bucket(len(entry.runs))] += 1
        if self.reads is not None and not entry.unverified:  # adopted ones once checked
            self.reads.publish(entry)

    def lookup(self, key: str) -> Entry | None:
        """The READY entry of ``key``; one adopted at a warm restart is checked against its
        CRC32 first, and a mismatch is dropped (:meth:`drop_corrupt`) and answers None."""
        entry = self.entries.get(key)
        if entry is not None and entry.unverified and not self.verify(entry):
            return None
        return entry

    def verify(self, entry: Entry) -> bool:
        """Check an adopted entry's bytes against its CRC32 (dropping it if they differ)."""
        entry.unverified = False
        self.counters["adopt_checked"] += 1
        ok = entry_crc(self.pool, entry) == entry.crc32
        if not ok:
            self.drop_corrupt(entry)
        elif self.reads is not None and entry.state is EntryState.READY:
            self.reads.publish(entry)
        return ok

    def drop_corrupt(self, entry: Entry) -> None:
        """An adopted entry whose bytes fail their CRC32: never served; its pages go back
        now, or once the views still held on them are gone."""
        if self.index is not None:
            self.index.delete(entry.key)
        self.withdraw(entry)
        self.runs_hist[run_bucket(len(entry.runs))] -= 1
        self.counters["adopt_dropped_checksum"] += 1
        self.counters["adopt_dropped_checksum_bytes"] += entry.nbytes
        if entry.ref_cnt:
            self.entries.forget(entry)
            return
        self.entries.remove(entry)
        self.alloc.free(entry.runs)

    def withdraw(self, entry: Entry) -> None:
        if self.reads is not None:
            self.reads.withdraw(entry.key)

    def touch(self, keys: Sequence[str], now: float) -> int:
        """Count hits that clients served themselves from the read table, and move those
        entries to the most-recently-used end; returns how many are still here."""
        found = 0
        for key in keys:
            entry = self.entries.get(key)
            if entry is not None:  # gone since (or never here: a client's mistake)
                found += 1
                self.counters["hit_bytes"] += entry.nbytes
                self.entries.touch(entry)
                entry.last_access = now
        self.counters["hits"] += found
        self.counters["table_reads"] += found
        return found

    def release_hold(self, entry: Entry) -> None:
        """Drop a quarantine hold's reference; the last one frees a DROPPED entry's pages."""
        self.entries.release(entry)
        if entry.state is EntryState.DROPPED and not entry.ref_cnt:
            self.alloc.free(entry.runs)
            entry.state = EntryState.FREED

    def discard(self, entry: Entry) -> None:
        """Free the pages of an entry that never became READY."""
        self.alloc.free(entry.runs)
        entry.state = EntryState.FREED

    def evictable(self, keys: Sequence[str]) -> list[tuple[EvictOutcome, Entry | None]]:
        """Each key's outcome, with its entry when it may go (EVICTED); a key named again
        is NOT_FOUND the second time (gone by then)."""
        out: list[tuple[EvictOutcome, Entry | None]] = []
        seen: set[int] = set()
        for key in keys:
            entry = self.entries.get(key) if isinstance(key, str) else None
            if entry is None or id(entry) in seen:
                out.append((EvictOutcome.NOT_FOUND, None))
            elif entry.ref_cnt:
                out.append((EvictOutcome.LEASED, None))
            else:
                seen.add(id(entry))
                out.append((EvictOutcome.EVICTED, entry))
        return out

    def evict(self, entry: Entry) -> int:
        """Remove an unleased READY entry and free its pages (its device copies first);
        returns the bytes of those pages."""
        self._on_evict(entry)
        if self.index is not None:
            self.index.delete(entry.key)  # before the pages can be reused
        self.withdraw(entry)  # the same: no reader may copy them once they are free
        self.entries.remove(entry)
        self.alloc.free(entry.runs)
        self.runs_hist[run_bucket(len(entry.runs))] -= 1
        self.counters["evictions"] += 1
        self.counters["evicted_bytes"] += entry.nbytes
        return entry.num_pages * self.page_bytes

    def evict_bytes(self, nbytes: int) -> tuple[int, int]:
        """Evict LRU entries until ``nbytes`` of pages are freed or none is left."""
        count = freed = 0
        while freed < nbytes and (victim := self.entries.lru_oldest()) is not None:
            freed += self.evict(victim)
            count += 1
        return count, freed
