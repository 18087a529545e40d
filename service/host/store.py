"""The host store: every table about the host page pool, kept in step.

One object owns the page allocator, the prealloc (pages set aside for puts from a device),
the READY entries and their LRU, the FILLING reservations, the pages held for client
processes that write them (reservations, stashes), the leases and the counters, so that
each operation updates all of them at once: a page is free, or held by exactly one
reservation, entry, writer hold or the prealloc. The tables are private: every change goes
through a method here (a warm restart's adoption too: :meth:`HostStore.adopting`).

The store is composed, by concern, of parts it owns and calls: ``Tables`` (``tables.py``:
the allocator, READY entries, counters, read table, warm-restart index), ``LeaseBook``
(``lease_book.py``: leases, quarantined holds), ``Reservations`` (``reservations.py``:
FILLING puts, their quota and writers) and ``Stashes`` (``stash.py``: pages clients fill in
advance). The views are functions over them (``store_views.py``). Nothing here locks: the
engine holds its gate around every call. A put that cannot be reserved raises the typed
error that says why; other shortfalls are ``None`` or ``False``; a broken invariant is an
``AssertionError``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from types import MappingProxyType

import numpy as np

from embcache.errors import Draining, PoolExhausted, QuotaExceeded
from embcache.service.host.admission import EntryMeta, check_same_meta
from embcache.service.host.adoption import Adoption
from embcache.service.host.allocator import PageRunAllocator, Run
from embcache.service.host.entries import Entry, EntryState
from embcache.service.host.evict import EvictOutcome, EvictResults
from embcache.service.host.evict import raise_for_evict as raise_for_evict  # re-exported
from embcache.service.host.host_pool import HostPool
from embcache.service.host.lease_book import SHARED_TIER_OWNER as SHARED_TIER_OWNER  # re-exported
from embcache.service.host.lease_book import LeaseBook
from embcache.service.host.leases import Lease, LeaseCaps, LeaseTable
from embcache.service.host.pool_index import PoolIndex
from embcache.service.host.prealloc import PutPrealloc
from embcache.service.host.quarantine import ProcessRef, Quarantine
from embcache.service.host.read_table import ReadTable
from embcache.service.host.reservations import Reservations
from embcache.service.host.stash import Stashed, Stashes
from embcache.service.host.store_views import HostCounts, host_counts, page_states
from embcache.service.host.tables import CopyIn, Runs, Tables


class HostStore:
    """Pages, entries, reservations and leases of the host pool (module docstring).

    ``on_evict(entry)`` runs before an entry's pages are freed (its device copies go
    there); ``clock``: the time leases expire by; ``caps``: each owner's most leases and
    leased bytes; ``max_entries``: READY and FILLING entries, zero-byte ones included."""

    def __init__(
        self,
        pool: HostPool,
        *,
        prealloc_pages: int,
        on_evict: Callable[[Entry], None],
        clock: Callable[[], float],
        caps: LeaseCaps | None = None,
        max_entries: int | None = None,
        reads: ReadTable | None = None,
    ) -> None:
        self.pool = pool
        self.page_bytes = pool.page_bytes
        self.prealloc = PutPrealloc(min(prealloc_pages, pool.num_pages // 16))
        limit = max_entries if max_entries is not None else pool.num_pages + 1024
        self._t = Tables(pool, self.prealloc, on_evict, reads, limit)  # pages, entries
        self._book = LeaseBook(self._t, caps)  # leases, quarantined holds, owners' processes
        self._puts = Reservations(self._t)  # FILLING reservations, their quota and writers
        self._stash = Stashes(self._t, self._puts)  # pages handed to clients in advance
        self.clock = clock

    @classmethod
    def adopting(cls, pool: HostPool, adoption: Adoption, now: float, **kw: object) -> HostStore:
        """A store that starts from what a warm restart kept (``restart.py``): the adopted
        entries READY (checked before first served), the holds of live processes on them,
        the pages live client processes may still write, and the fresh index it keeps up to
        date. The allocator holds every other page. ``kw``: as the constructor's."""
        store = cls(pool, **kw)  # type: ignore[arg-type]
        used = [run for w in adoption.writes for run in w.runs]
        used.extend(run for entry in adoption.entries for run in entry.runs)
        tables = store._t
        tables.alloc = PageRunAllocator.with_used(pool.num_pages, used)
        for entry in adoption.entries:
            tables.adopt(entry, now)
        for held in adoption.holds:
            tables.entries.acquire(held.entry)
            store.quarantine.add(held)
        for written in adoption.writes:
            store._puts.written.add(written)
        tables.counters.update(adoption.counters)
        tables.index = adoption.index
        return store

    @property
    def reads(self) -> ReadTable | None:
        """Where same-node clients copy entries from (None: no read table)."""
        return self._t.reads

    @property
    def max_entries(self) -> int:
        """READY and FILLING entries together at most (past it, LRU ones are evicted)."""
        return self._t.max_entries

    @max_entries.setter
    def max_entries(self, value: int) -> None:
        self._t.max_entries = value

    @property
    def leases(self) -> LeaseTable:
        """The live leases (read-only outside: :meth:`lease`, :meth:`release`)."""
        return self._book.leases

    @property
    def quarantine(self) -> Quarantine:
        """Holds of leases that ended by force (read-only outside)."""
        return self._book.quarantine

    @property
    def processes(self) -> Mapping[str, ProcessRef]:
        """Owner -> its process, where known (read-only: :meth:`bind_process`)."""
        return MappingProxyType(self._book.processes)

    def bind_process(self, owner: str, process: ProcessRef | None) -> None:
        """Tie ``owner``'s leases to ``process`` (None: forget it, it has exited)."""
        if process is None:
            self._book.processes.pop(owner, None)
        else:
            self._book.processes[owner] = process

    def held_for(self) -> set[ProcessRef]:
        """The processes pages are held for: views of ended leases, writes, stashes."""
        return {*self._book.quarantine.processes(), *self._puts.written.processes()}

    @property
    def inflight(self) -> dict[str, int]:
        """Bytes each owner has in open puts and writer holds (a copy)."""
        return dict(self._puts.inflight)

    @property
    def index(self) -> PoolIndex | None:
        """The warm-restart index this store keeps up to date (None: none)."""
        return self._t.index

    def counter(self, name: str) -> int:
        """One of the store's counters (hits, evictions, ...; 0 if never counted)."""
        return self._t.counters.get(name, 0)

    def peek(self, key: str) -> Entry | None:
        """The READY entry of ``key``, as it is (neither checked nor counted as a hit)."""
        return self._t.entries.get(key)

    def unverified(self) -> list[Entry]:
        """The adopted entries whose bytes were not checked yet (``Verifier``)."""
        return [e for e in self._t.entries.by_key.values() if e.unverified]

    # -- the parts' calls ---------------------------------------------------------------
    def pages_for(self, nbytes: int) -> int:
        """Host pages an entry of ``nbytes`` takes."""
        return self._t.pages_for(nbytes)

    def top_up_prealloc(self) -> None:
        """Refill the prealloc to what the last puts asked for (evicting as a put would)."""
        self._t.top_up_prealloc()

    def lookup(self, key: str) -> Entry | None:
        """The READY entry of ``key``, an adopted one checked first (``tables.py``)."""
        return self._t.lookup(key)

    def verify(self, entry: Entry) -> bool:
        """Check an adopted entry's bytes against its CRC32 (dropping it if they differ)."""
        return self._t.verify(entry)

    def touch(self, keys: Sequence[str], now: float) -> int:
        """Count hits clients served from the read table; how many are still here."""
        return self._t.touch(keys, now)

    def pin(self, keys: Sequence[str], owner: str, now: float) -> list[Entry | None]:
        """Look up and reference each key's entry, counting hits and misses: nothing evicts
        it until it becomes a lease (:meth:`lease`) or is undone (:meth:`unpin`)."""
        return self._book.pin(keys, owner, now)

    def unpin(self, entries: Iterable[Entry | None]) -> None:
        """Undo :meth:`pin` for entries that will not be leased (a failed placement)."""
        self._book.unpin(entries)

    def take_prealloc(self, key: str, nbytes: int, copy_in: CopyIn) -> Runs | None:
        """Prealloc pages with a put's copy queued, for :meth:`reserve_put` (``tables.py``)."""
        return self._t.take_prealloc(key, nbytes, copy_in)

    def give_back_prealloc(self, pages: Runs) -> None:
        """Pages from :meth:`take_prealloc` that no entry adopted (their copy complete)."""
        self._t.prealloc.give_back(pages)

    def lease(
        self, entries: Sequence[Entry | None], owner: str, expires_at: float
    ) -> list[Lease | None]:
        """One lease per pinned entry (the pin becomes the lease's reference)."""
        return self._book.lease(entries, owner, expires_at)

    def release(self, lease_ids: Iterable[int], owner: str | None = None) -> int:
        """End these leases (with ``owner``: its own only); returns how many ended."""
        return self._book.release(lease_ids, owner)

    def renew(self, lease_ids: Iterable[int], expires_at: float, owner: str | None = None) -> int:
        """Move the expiry of the live ones (with ``owner``: its own) to ``expires_at``."""
        return self._book.renew(lease_ids, expires_at, owner)

    def alive(self, lease: Lease, now: float) -> bool:
        """Whether ``lease`` is still held and not past its expiry."""
        return self._book.alive(lease, now)

    def expire(self, now: float) -> int:
        """End the leases whose TTL has passed; returns how many."""
        return self._book.expire(now)

    def end_owner(self, owner: str) -> int:
        """End every lease of ``owner`` by force and forget its process; returns how many."""
        return self._book.end_owner(owner)

    def free_quarantine(self, process: ProcessRef) -> int:
        """``process`` has exited: end every hold kept for it; returns how many."""
        return self._book.free_quarantine(process)

    def evictable(self, keys: Sequence[str]) -> list[tuple[EvictOutcome, Entry | None]]:
        """Each key's outcome, with its entry when it may go (``tables.py``)."""
        return self._t.evictable(keys)

    def evict_bytes(self, nbytes: int) -> tuple[int, int]:
        """Evict LRU entries until ``nbytes`` of pages are freed or none is left."""
        return self._t.evict_bytes(nbytes)

    def evict_keys(self, keys: Sequence[str], now: float) -> EvictResults:
        """Evict each key that is not leased (:meth:`evictable`): the outcome of each and
        the bytes of the pages freed."""
        self._book.expire(now)
        out = self._t.evictable(keys)
        freed = sum(self._t.evict(entry) for _, entry in out if entry is not None)
        return EvictResults((outcome for outcome, _ in out), freed)

    # -- puts ----------------------------------------------------------------------------
    def reserve_put(
        self,
        key: str,
        meta: EntryMeta,
        crc: int | None,
        owner: str,
        *,
        quota: int,
        now: float,
        copy_in: CopyIn | None = None,
        pages: Runs | None = None,
    ) -> Entry | tuple[Entry, int, Runs]:
        """Reserve pages for a new entry (evicting LRU entries if need be) and record it as
        FILLING, invisible to readers: ``(entry, put id, byte runs)``; or the READY entry
        of that key when its metadata matches (MetadataConflict when it does not).

        Args:
            quota: the most bytes ``owner`` may have in open puts.
            copy_in: queues the copy of every byte as soon as the pages are reserved, before
                the entry is recorded (if it raises, the pages go back at once); it must not
                call the engine (its lock is held).
            pages: runs from the prealloc (:meth:`take_prealloc`) being copied into already;
                the entry adopts them.
        Raises:
            QuotaExceeded, PoolExhausted (no room, or ``max_entries`` reached, even after
            evicting every unleased entry), MetadataConflict; nothing reserved.
        """
        existing = self.lookup(key)  # an adopted entry whose bytes fail their CRC is replaced
        if existing is not None:
            check_same_meta(existing, meta.dtype, meta.shape)
            self._t.entries.touch(existing)
            return existing
        left = self._puts.quota_left(owner, quota)
        if meta.nbytes > left:
            raise QuotaExceeded(
                "too many bytes in unfinished puts",
                owner=owner, inflight=quota - left, nbytes=meta.nbytes, limit=quota,
            )  # fmt: skip
        if not self._t.entry_room(len(self._puts)):  # max_entries: evicts LRU ones, any size
            raise PoolExhausted(
                "no room for another entry: every entry is leased or filling",
                max_entries=self.max_entries,
            )
        npages = self.pages_for(meta.nbytes)
        if pages is None:
            runs = self._t.reserve(npages)
            if runs is None:
                raise PoolExhausted(
                    "no room: the pool is full of leased or filling entries",
                    nbytes=meta.nbytes,
                    free_pages=self._t.alloc.num_free_pages,
                    evictable_pages=self._t.entries.evictable_pages,
                )
        else:
            assert sum(n for _, n in pages) == npages, (pages, npages)
            runs = list(pages)
        byte_runs = self._t.byte_runs(runs, meta.nbytes)
        if copy_in is not None:
            try:
                copy_in(byte_runs)
            except BaseException:
                self._t.alloc.free(runs)
                raise
        state = EntryState.FILLING
        entry = Entry(key, meta.dtype, meta.shape, meta.nbytes, tuple(runs), state, crc, 0, now)
        return entry, self._puts.open(entry, owner), byte_runs

    def commit_put(self, put_id: int, now: float) -> tuple[Entry, str] | None:
        """Make a filled reservation READY: its entry and owner, or None when a put of the
        same key committed first (its pages go back); Draining once the engine closed."""
        found = self._puts.close(put_id)
        if found is None:
            raise Draining("engine closed before the put committed")
        entry, owner = found
        existing = self._t.entries.get(entry.key)
        if existing is not None:
            self._t.alloc.free(entry.runs)
            check_same_meta(existing, entry.dtype, entry.shape)
            return None
        self._t.add_ready(entry, now)
        return entry, owner

    def abort_put(self, put_id: int) -> None:
        """End a reservation, nothing of it visible: its pages go back."""
        found = self._puts.close(put_id)
        if found is None:
            return  # already dropped by drop_all()
        self._t.discard(found[0])
        self._t.counters["puts_aborted"] += 1

    def refill_stash(
        self,
        owner: str,
        process: ProcessRef,
        token: int,
        npages: int,
        *,
        quota: int,
        extra: int = 0,
    ) -> list[Run]:
        """Pages held for ``process``, a stash it knows by ``token``: ``npages``, and up to
        ``extra`` more of those free now (``Stashes.refill``)."""
        return self._stash.refill(owner, process, token, npages, quota, extra)

    def commit_stashed(
        self, process: ProcessRef, token: int, puts: Sequence[Stashed], now: float
    ) -> list[tuple[Entry, bool]]:
        """Stashed puts made READY, all or nothing (``Stashes.commit``)."""
        return self._stash.commit(process, token, puts, now)

    def writer_done(self, process: ProcessRef, token: int) -> bool:
        """``process`` stopped writing the pages of the ended reservation it knows by
        ``token``: they go back now. False when it holds none by that id."""
        return self._puts.writer_done(process, token)

    def free_written(self, process: ProcessRef) -> int:
        """``process`` has exited: its held pages go back; returns how many holds ended."""
        return self._puts.free_written(process)

    # -- views -------------------------------------------------------------------------
    def snapshot(self, state: str | None) -> list[Entry]:
        """The entries now: READY in insertion order, then FILLING (``state`` keeps
        ``ready`` or ``filling`` only); one copy of the tables (``engine/listing.py``)."""
        found: list[Entry] = []
        if state in (None, "ready"):
            found = list(self._t.entries.by_key.values())
        if state in (None, "filling"):
            found.extend(self._puts.entries())
        return found

    def counts(self) -> HostCounts:
        """The counters and sizes now, for the stats (``store_views.py``)."""
        t = self._t
        return host_counts(
            self.page_bytes, t.alloc, self.prealloc, t.entries, self._puts, self.leases,
            self.quarantine, t.reads, t.runs_hist, t.counters, t.max_entries,
        )  # fmt: skip

    def page_states(self) -> np.ndarray:
        """One uint8 per host page: 0 free, 1 filling, 2 ready, 3 leased."""
        ready = self._t.entries.by_key.values()
        return page_states(self._t.alloc.num_pages, ready, self._puts.entries())

    def drop_all(self) -> PoolIndex | None:
        """The engine is closing: end every lease and forget every reservation; returns the
        index, let go first: the holds in it stay for the next daemon (views may outlive
        us), and the engine closes or removes it."""
        index, self._t.index = self._t.index, None
        self._book.clear()
        self._puts.clear()
        return index
