"""The host store: every table about the host page pool, kept in step.

One object owns the page allocator, the pages set aside for puts from a device (the
prealloc), the READY entries and their LRU, the FILLING reservations, the leases, the pages
held for client processes that may still write them (``store_writes.py``) and the
counters. Keeping them together is what lets each operation update all of them at once: a
page is free, or held by exactly one reservation, entry, writer hold or the prealloc.

Nothing here locks: the engine holds its one lock around every call. Shortfalls (no room,
an owner over its quota) come back as ``None`` or ``False`` for the engine to turn into
errors; a broken invariant is an ``AssertionError``.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Iterable, Sequence

from embcache.service.host.allocator import PageRunAllocator, Run
from embcache.service.host.entries import Entry, EntryState, EntryTable
from embcache.service.host.evict import EvictOutcome, EvictResults, raise_for_evict
from embcache.service.host.host_pool import HostPool
from embcache.service.host.leases import Lease, LeaseCaps, LeaseTable
from embcache.service.host.pool_index import PoolIndex
from embcache.service.host.prealloc import PutPrealloc
from embcache.service.host.quarantine import Held, ProcessRef, Quarantine
from embcache.service.host.read_table import ReadTable
from embcache.service.host.stats import run_bucket
from embcache.service.host.store_views import HostCounts, StoreViews
from embcache.service.host.store_writes import StoreWrites
from embcache.service.host.verify import entry_crc
from embcache.service.host.write_holds import WriteHolds

SHARED_TIER_OWNER = "shared-tier"  # owner of the shared tier's own leases and fills
__all__ = ["EvictOutcome", "EvictResults", "HostCounts", "HostStore", "raise_for_evict"]


class HostStore(StoreViews, StoreWrites):
    """Pages, entries, reservations and leases of the host pool (module docstring).

    ``on_evict(entry)`` runs before an entry's pages are freed (the engine drops its device
    copies there); ``clock`` gives the time leases expire by. ``caps``: each owner's most
    leases and leased bytes (None: none); ``max_entries``: READY and FILLING entries
    together, zero-byte ones included (past it, LRU entries are evicted).
    """

    def __init__(
        self,
        pool: HostPool,
        *,
        prealloc_pages: int,
        on_evict: Callable[[Entry], None],
        clock: Callable[[], float],
        caps: LeaseCaps | None = None,
        max_entries: int | None = None,
    ) -> None:
        self.pool = pool
        self.page_bytes = pool.page_bytes
        self.alloc = PageRunAllocator(pool.num_pages)  # free pages (the prealloc's are out)
        self.prealloc = PutPrealloc(min(prealloc_pages, pool.num_pages // 16))
        self.entries = EntryTable()  # READY entries and the LRU of the unleased ones
        self.leases = LeaseTable()
        self.quarantine = Quarantine()  # holds of leases that ended by force (quarantine.py)
        self.processes: dict[str, ProcessRef] = {}  # owner -> its process, where known
        self._filling: dict[int, tuple[Entry, str]] = {}  # put id -> (entry, owner)
        self._writers: dict[int, tuple[ProcessRef, int]] = {}  # put id -> its client filler
        self.written = WriteHolds()  # pages such a client may still write (store_writes.py)
        self._put_ids = itertools.count(1)
        self.inflight: Counter[str] = Counter()  # owner -> bytes in its open puts
        self._runs_hist: Counter[str] = Counter()  # READY entries by number of page runs
        self.counters: Counter[str] = Counter()  # hits, misses, evictions, puts, ...
        self._on_evict = on_evict
        self.clock = clock
        self.caps = caps
        self.max_entries = max_entries if max_entries is not None else pool.num_pages + 1024
        self.index: PoolIndex | None = None  # the warm-restart index (restart.py sets it)
        self.reads: ReadTable | None = None  # where same-node clients copy entries from

    # -- pages ---------------------------------------------------------------------------
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

    def entry_room(self) -> bool:
        """Make room for one more entry under ``max_entries`` by evicting LRU entries (any
        size, zero-byte ones included); False, nothing evicted, when all are leased."""
        over = len(self.entries) + len(self._filling) + 1 - self.max_entries
        if over > 0 and self.entries.evictable_count < over:
            return False
        for _ in range(max(over, 0)):
            victim = self.entries.lru_oldest()
            assert victim is not None, "evictable count out of step with the LRU"
            self.evict(victim)
        return True

    # -- puts ----------------------------------------------------------------------------
    def quota_left(self, owner: str, limit: int) -> int:
        """Bytes ``owner`` may still reserve in open puts under ``limit``."""
        return limit - self.inflight[owner]

    def open_fill(self, entry: Entry, owner: str) -> int:
        """Record a FILLING reservation (invisible to readers); returns its put id."""
        put_id = next(self._put_ids)
        while put_id in self.written:  # an adopted writer hold keeps its id
            put_id = next(self._put_ids)
        self._filling[put_id] = (entry, owner)
        self.inflight[owner] += entry.nbytes
        return put_id

    def close_fill(self, put_id: int) -> tuple[Entry, str] | None:
        """End a reservation (its pages stay with the entry); None if it ended already
        (the engine closed meanwhile)."""
        found = self._filling.pop(put_id, None)
        if found is None:
            return None
        entry, owner = found
        self.inflight[owner] -= entry.nbytes
        if not self.inflight[owner]:
            del self.inflight[owner]
        return found

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
        self._runs_hist[run_bucket(len(entry.runs))] += 1
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
        self._withdraw(entry)
        self._runs_hist[run_bucket(len(entry.runs))] -= 1
        self.counters["adopt_dropped_checksum"] += 1
        self.counters["adopt_dropped_checksum_bytes"] += entry.nbytes
        if entry.ref_cnt:
            self.entries.forget(entry)
            return
        self.entries.remove(entry)
        self.alloc.free(entry.runs)

    def _withdraw(self, entry: Entry) -> None:
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

    def _release_hold(self, entry: Entry) -> None:
        """Drop a quarantine hold's reference; the last one frees a DROPPED entry's pages."""
        self.entries.release(entry)
        if entry.state is EntryState.DROPPED and not entry.ref_cnt:
            self.alloc.free(entry.runs)
            entry.state = EntryState.FREED

    def discard(self, entry: Entry) -> None:
        """Free the pages of an entry that never became READY."""
        self.alloc.free(entry.runs)
        entry.state = EntryState.FREED

    # -- pins and leases -----------------------------------------------------------------
    def pin(self, keys: Sequence[str], owner: str, now: float) -> list[Entry | None]:
        """Look ``keys`` up, count hits and misses, and take a reference on each entry
        found, so nothing evicts it; a pin becomes a lease (:meth:`lease`) or is undone
        (:meth:`unpin`)."""
        self.expire(now)
        counted = owner != SHARED_TIER_OWNER  # write-through reads are not client hits
        found = self.lookup
        out = [found(key) if isinstance(key, str) else None for key in keys]
        if counted and self.caps is not None:
            self.leases.check_caps(owner, out, self.caps)  # refused: nothing pinned
        for entry in out:
            if entry is None:
                self.counters["misses"] += counted
                continue
            self.counters["hits"] += counted
            self.counters["hit_bytes"] += entry.nbytes if counted else 0
            self.entries.acquire(entry)
            entry.last_access = now
        return out

    def unpin(self, entries: Iterable[Entry | None]) -> None:
        """Undo :meth:`pin` for entries that will not be leased (a failed placement)."""
        for entry in entries:
            if entry is not None:
                self.entries.release(entry)

    def lease(
        self, entries: Sequence[Entry | None], owner: str, expires_at: float
    ) -> list[Lease | None]:
        """One lease per pinned entry (the pin becomes the lease's reference)."""
        add, page = self.leases.add, self.page_bytes
        out = [None if e is None else add(e, owner, expires_at, page) for e in entries]
        process = self.processes.get(owner)
        if self.index is not None and process is not None:  # views may outlive this daemon
            with self.index.batch():
                for lease in out:
                    if lease is not None:
                        self.index.hold(lease.lease_id, process, lease.key)
        return out

    def end_lease(self, lease_id: int, owner: str | None = None) -> bool:
        """End one lease and drop its reference; False for an unknown or ended id, or one
        ``owner`` (when given) does not hold. An id that ended by force and was quarantined
        ends its hold now (the views are gone) when ``owner`` is of the same process."""
        lease = self.leases.get(lease_id)
        if lease is None:
            self._end_held(lease_id, owner)
            return False
        if owner is not None and lease.owner != owner:
            return False
        self.leases.pop(lease_id)
        self.entries.release(lease.entry)
        if self.index is not None:
            self.index.unhold(lease_id)
        return True

    def _end_held(self, lease_id: int, owner: str | None) -> None:
        """The client's views of a quarantined lease are gone: end its hold, if ``owner``
        (when given) is the process it was kept for (no other client may end it)."""
        held = self.quarantine.get(lease_id)
        if held is None or (owner is not None and self.processes.get(owner) != held.process):
            return
        self.quarantine.pop(lease_id)
        self._release_hold(held.entry)
        if self.index is not None:
            self.index.unhold(lease_id)

    def end_by_force(self, lease: Lease) -> None:
        """End a lease its owner did not release (a TTL, the end of its session, an
        operator): while the owner's process may still read the pages, its hold moves to
        the quarantine (quarantine.py), else it ends."""
        process = self.processes.get(lease.owner)
        if process is None:
            self.entries.release(lease.entry)
            return
        nbytes = lease.entry.num_pages * self.page_bytes
        self.quarantine.add(Held(lease.lease_id, lease.entry, process, nbytes))
        if self.index is not None:  # kept across a restart too, until the process exits
            self.index.hold(lease.lease_id, process, lease.key)
        self.counters["leases_quarantined"] += 1

    def end_owner(self, owner: str) -> int:
        """End every lease of ``owner`` by force and forget its process; returns how many."""
        ids = self.leases.owned_by(owner)
        for lease_id in ids:
            lease = self.leases.pop(lease_id)
            assert lease is not None, "owner's lease missing from the table"
            self.end_by_force(lease)
        self.processes.pop(owner, None)
        return len(ids)

    def free_quarantine(self, process: ProcessRef) -> int:
        """``process`` has exited: end every hold kept for it; returns how many."""
        held = self.quarantine.pop_process(process)
        for h in held:
            self._release_hold(h.entry)
            if self.index is not None:
                self.index.unhold(h.lease_id)
        return len(held)

    def release(self, lease_ids: Iterable[int], owner: str | None = None) -> int:
        """End these leases (unknown ids, and with ``owner`` others' ids, skipped); returns
        how many ended."""
        if self.index is None:
            return sum(self.end_lease(i, owner) for i in lease_ids)
        with self.index.batch():
            return sum(self.end_lease(i, owner) for i in lease_ids)

    def renew(self, lease_ids: Iterable[int], expires_at: float, owner: str | None = None) -> int:
        """Move the expiry of the live ones (with ``owner``: of its own only) to
        ``expires_at``; returns how many."""
        renewed = 0
        for lease_id in lease_ids:
            lease = self.leases.get(lease_id)
            if lease is not None and (owner is None or lease.owner == owner):
                self.leases.renew(lease, expires_at)
                renewed += 1
        return renewed

    def alive(self, lease: Lease, now: float) -> bool:
        """Whether ``lease`` is still held and not past its expiry (its pages are its own)."""
        return self.leases.get(lease.lease_id) is lease and lease.expires_at > now

    def expire(self, now: float) -> int:
        """End the leases whose TTL has passed; returns how many."""
        expired = self.leases.pop_expired(now)
        for lease in expired:
            self.end_by_force(lease)
        self.counters["leases_expired"] += len(expired)
        return len(expired)

    # -- eviction ------------------------------------------------------------------------
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

    def evict_keys(self, keys: Sequence[str], now: float) -> EvictResults:
        """Evict each key that is not leased (:meth:`evictable`): the outcome of each and
        the bytes of the pages freed."""
        self.expire(now)
        out = self.evictable(keys)
        freed = sum(self.evict(entry) for _, entry in out if entry is not None)
        return EvictResults((outcome for outcome, _ in out), freed)

    def evict(self, entry: Entry) -> int:
        """Remove an unleased READY entry and free its pages (its device copies first);
        returns the bytes of those pages."""
        self._on_evict(entry)
        if self.index is not None:
            self.index.delete(entry.key)  # before the pages can be reused
        self._withdraw(entry)  # the same: no reader may copy them once they are free
        self.entries.remove(entry)
        self.alloc.free(entry.runs)
        self._runs_hist[run_bucket(len(entry.runs))] -= 1
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

    def drop_all(self) -> None:
        """The engine is closing: end every lease and forget every reservation. The index
        is let go first: the holds in it stay for the next daemon (views may outlive us)."""
        self.index = None
        for lease_id in self.leases.all_ids():
            self.end_lease(lease_id)
        for held in self.quarantine.clear():
            self._release_hold(held.entry)
        self.processes.clear()
        self._filling.clear()
        self.drop_writers()
        self.inflight.clear()
