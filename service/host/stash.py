"""Stashes: free pages handed to a same-node client in advance, which it fills and commits.

A client of the daemon's uid writes its puts itself, through its own writable mapping of the
pool. Reserving pages entry by entry costs a round trip per put, so the daemon hands such a
client a *stash*: a batch of free pages, with no key yet, refilled in batches. The client
copies an entry into pages of its stash and commits them under a key; the commit makes the
entry READY and publishes it. The pages of a stash are held for the client's process
exactly as the pages of a reservation it fills are (``write_holds.py``):

- From the refill on, a stash is a writer hold: out of the allocator, counted against its
  owner's in-flight put quota (so a stash never takes more than a client's fair share), and
  recorded in the warm-restart index as a ``WRITE`` of that process, so a daemon killed
  meanwhile does not reuse its pages either.
- A commit takes the pages it names out of the stash, whatever its outcome: the client has
  written them and moved on. A new entry adopts them; a put of a key that exists (same
  metadata), or one refused (its checksum, another entry's metadata, no room for another
  entry), gives them back to the allocator. The index records the stash's smaller hold
  and the new entry in one write.
- What is left of a stash goes back when its process says it is done with it (its client's
  close, a ``put_abort`` of the stash's id) or has exited (the daemon's reaper), never
  while the process may still be writing. A session that ends does not end its stash.

A part of :class:`~embcache.service.host.store.HostStore`, over its tables and
reservations; no lock (the engine's gate is held around every call).
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

from embcache.errors import EmbCacheError, InvalidArgument, NotFound, PoolExhausted, QuotaExceeded
from embcache.service.host.admission import EntryMeta, check_same_meta
from embcache.service.host.allocator import Run
from embcache.service.host.entries import Entry, EntryState
from embcache.service.host.quarantine import ProcessRef
from embcache.service.host.reservations import Reservations
from embcache.service.host.tables import Tables
from embcache.service.host.write_holds import Written


@dataclass(frozen=True, slots=True)
class StashedPut:
    """One put as a client asks for it: the entry, and where in its stash it wrote it."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    byte_runs: tuple[tuple[int, int], ...]  # (offset, length) in the pool, in order
    nbytes: int | None = None  # checked against dtype and shape when given
    checksum: int | None = None  # CRC32 of the bytes, checked over the pages when given


@dataclass(frozen=True, slots=True)
class Stashed:
    """One put a client wrote into its stash, checked by the put path before the commit."""

    key: str
    meta: EntryMeta
    runs: tuple[Run, ...]  # the entry's pages, in order (``pages_of``)
    crc: int | None  # CRC32 of the bytes, for the warm-restart index (None: not computed)
    refused: EmbCacheError | None = None  # e.g. a checksum that does not match the pages
    checksum: int | None = None  # the CRC32 the client declared (checked: ``crc``)


def pages_of(
    byte_runs: Sequence[tuple[int, int]], nbytes: int, page_bytes: int, num_pages: int
) -> tuple[Run, ...]:
    """The page runs that ``byte_runs`` (an entry's bytes, in order) cover.

    Every run starts on a page and lies in the pool's ``num_pages``; every run but the last
    fills whole pages; together they hold exactly ``nbytes``, so the entry's pages are the
    ones a reservation of that size takes.

    Raises:
        InvalidArgument: naming the run that breaks one of those rules.
    """
    runs: list[Run] = []
    total = 0
    last = len(byte_runs) - 1
    for i, (offset, length) in enumerate(byte_runs):
        if offset < 0 or length <= 0 or offset % page_bytes:
            raise InvalidArgument(
                "a stashed run must start on a page and hold bytes",
                offset=offset, length=length, page_bytes=page_bytes,
            )  # fmt: skip
        if i != last and length % page_bytes:
            raise InvalidArgument(
                "only an entry's last run may end inside a page",
                offset=offset, length=length, page_bytes=page_bytes,
            )  # fmt: skip
        first, count = offset // page_bytes, -(-length // page_bytes)
        if first + count > num_pages:
            raise InvalidArgument("a stashed run leaves the pool", offset=offset, length=length)
        runs.append((first, count))
        total += length
    if total != nbytes:
        raise InvalidArgument("the runs do not hold the entry's bytes", nbytes=nbytes, runs=total)
    return tuple(runs)


class Stashes:
    """The stashes of every client process, as writer holds (module docstring)."""

    def __init__(self, tables: Tables, puts: Reservations) -> None:
        self._t = tables
        self._puts = puts

    def refill(
        self, owner: str, process: ProcessRef, token: int, npages: int, quota: int, extra: int = 0
    ) -> list[Run]:
        """``npages`` free pages (evicting LRU entries as a put does), and up to ``extra``
        more, held for ``process``, which knows them by ``token``; recorded in the index
        before anyone is told of them. The spare pages evict nothing unless ``npages``
        had to: a pool with room left keeps every entry while clients fill it, and a full
        one, where every put evicts anyway, hands out a whole refill at a time.

        Raises:
            QuotaExceeded: ``owner`` would have more than ``quota`` bytes in unfinished puts
                and stashes. PoolExhausted: no room. Nothing taken either way.
        """
        page_bytes = self._t.pool.page_bytes
        nbytes = npages * page_bytes
        left = self._puts.quota_left(owner, quota)
        if nbytes > left:
            raise QuotaExceeded(
                "too many bytes in unfinished puts and stashes",
                owner=owner, inflight=quota - left, nbytes=nbytes, limit=quota,
            )  # fmt: skip
        full = self._t.alloc.num_free_pages + self._t.prealloc.pages < npages
        runs = self._t.reserve(npages)
        if runs is None:
            raise PoolExhausted(
                "no room for a stash: the pool is full of leased or filling entries",
                nbytes=nbytes, free_pages=self._t.alloc.num_free_pages,
            )  # fmt: skip
        spare = min(extra, (left - nbytes) // page_bytes)
        if self._t.alloc.num_free_pages < spare and self._t.prealloc.pages:
            self._t.alloc.free(self._t.prealloc.drain())  # free capacity on loan
        if not full:
            spare = min(spare, self._t.alloc.num_free_pages)
        if spare > 0 and (more := self._t.take_pages(spare)) is not None:
            runs = [*runs, *more]
            npages += spare
            nbytes += spare * page_bytes
        self._puts.hold(Written(self._puts.next_id(), process, tuple(runs), owner, nbytes, token))
        self._t.counters["stash_refills"] += 1
        self._t.counters["stash_pages"] += npages
        return runs

    def commit(
        self, process: ProcessRef, token: int, puts: Sequence[Stashed], now: float
    ) -> list[tuple[Entry, bool]]:
        """Make stashed puts READY, all or nothing: ``(entry, created)`` per put, in order;
        a key that exists with the same metadata is not created (its pages go back).

        Raises:
            NotFound, InvalidArgument: the stash or its pages (nothing changed).
            A put's ``refused`` error, MetadataConflict, PoolExhausted (no room for the
            entries under ``max_entries``): none becomes visible, and every page named
            leaves the stash for the allocator.
        """
        index = self._t.index
        with index.batch() if index is not None else contextlib.nullcontext():
            self._take(process, token, [p.runs for p in puts])
            try:
                return self._commit_taken(puts, now)
            except BaseException:
                for put in puts:  # taken out of the stash: the writer is done with them
                    if put.runs:
                        self._t.alloc.free(list(put.runs))
                raise

    def _take(self, process: ProcessRef, token: int, wanted: Sequence[tuple[Run, ...]]) -> None:
        """Take each put's pages out of the stash, all or nothing: every page must be in it,
        once. What is left stays held (a new index record replaces the old)."""
        stash = self._puts.written.find(process, token)
        if stash is None:
            raise NotFound("no such stash (given back, or its process has exited)", stash_id=token)
        free = _merged(stash.runs)
        npages = 0
        for runs in wanted:
            for first, n in runs:
                if not _cut(free, first, n):
                    raise InvalidArgument(
                        "pages not in this stash (or named twice)",
                        stash_id=token, first_page=first, pages=n,
                    )  # fmt: skip
                npages += n
        self._puts.rehold(stash, tuple(free), stash.nbytes - npages * self._t.pool.page_bytes)

    def _commit_taken(self, puts: Sequence[Stashed], now: float) -> list[tuple[Entry, bool]]:
        existing: list[Entry | None] = []
        for put in puts:
            if put.refused is not None:
                raise put.refused
            found = self._t.lookup(put.key)
            if found is not None:
                check_same_meta(found, put.meta.dtype, put.meta.shape)
            existing.append(found)
        new = sum(found is None for found in existing)
        if new and not self._t.entry_room(len(self._puts) + new - 1):
            raise PoolExhausted(
                "no room for another entry: every entry is leased or filling",
                max_entries=self._t.max_entries,
            )
        out: list[tuple[Entry, bool]] = []
        for put, found in zip(puts, existing, strict=True):
            if found is not None:
                if put.runs:
                    self._t.alloc.free(list(put.runs))
                self._t.entries.touch(found)
                out.append((found, False))
                continue
            meta = put.meta
            entry = Entry(put.key, meta.dtype, meta.shape, meta.nbytes, put.runs,
                          EntryState.FILLING, put.checksum, crc32=put.crc)  # fmt: skip
            self._t.add_ready(entry, now)
            out.append((entry, True))
        self._t.counters["stash_puts"] += len(puts)
        return out


def _merged(runs: Sequence[Run]) -> list[Run]:
    """``runs`` sorted, with runs that touch made one."""
    out: list[Run] = []
    for first, n in sorted(runs):
        if out and out[-1][0] + out[-1][1] == first:
            out[-1] = (out[-1][0], out[-1][1] + n)
        elif n:
            out.append((first, n))
    return out


def _cut(held: list[Run], first: int, n: int) -> bool:
    """Take pages ``[first, first + n)`` out of ``held`` (sorted runs, none touching
    another), in place; False, nothing changed, unless every one of them is in it.
    Linear in the runs held, not in their pages."""
    i = bisect.bisect_right(held, first, key=lambda run: run[0]) - 1
    if n <= 0 or i < 0:
        return False
    start, count = held[i]
    if first + n > start + count:
        return False
    pieces = []
    if first > start:
        pieces.append((start, first - start))
    if start + count > first + n:
        pieces.append((first + n, start + count - first - n))
    held[i : i + 1] = pieces
    return True
