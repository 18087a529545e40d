"""FILLING reservations, the in-flight quota they count against, and their writers.

A put's pages are reserved before its bytes arrive; until it commits or aborts the entry is
FILLING and lives here, never in the key map, so no reader can see it. A reservation that
a client fills through its own mapping has a writer (``write_holds.py`` says why that
matters): when the reservation ends while that process may still be writing, its pages are
held here until it is done or gone, and keep counting against the owner's quota.

A part of :class:`~embcache.service.host.store.HostStore`, which owns it and calls it, over
the store's tables (``tables.py``): a writer is recorded in the warm-restart index before it
is told the runs, and deleted from it before its pages can be reused. No lock.
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter
from collections.abc import Iterator

from embcache.service.host.allocator import Run
from embcache.service.host.entries import Entry
from embcache.service.host.quarantine import ProcessRef
from embcache.service.host.tables import Tables
from embcache.service.host.write_holds import WriteHolds, Written

log = logging.getLogger(__name__)


class Reservations:
    """Open puts by put id, their owners' in-flight bytes, and writer holds."""

    def __init__(self, tables: Tables) -> None:
        self._t = tables
        self._filling: dict[int, tuple[Entry, str]] = {}  # put id -> (entry, owner)
        self._writers: dict[int, tuple[ProcessRef, int]] = {}  # put id -> (writer, its id)
        self.written = WriteHolds()  # pages a client may still write (read-only outside)
        self._put_ids = itertools.count(1)
        self.inflight: Counter[str] = Counter()  # owner -> bytes (read-only outside)

    def __len__(self) -> int:
        return len(self._filling)

    def entries(self) -> Iterator[Entry]:
        """The FILLING entries, oldest first."""
        return (entry for entry, _ in self._filling.values())

    def quota_left(self, owner: str, limit: int) -> int:
        """Bytes ``owner`` may still reserve in open puts under ``limit``."""
        return limit - self.inflight[owner]

    def next_id(self) -> int:
        """A put id no reservation or hold has (an adopted writer hold keeps its id)."""
        put_id = next(self._put_ids)
        while put_id in self.written:
            put_id = next(self._put_ids)
        return put_id

    def open(self, entry: Entry, owner: str) -> int:
        """Record a FILLING reservation; returns its put id."""
        put_id = self.next_id()
        self._filling[put_id] = (entry, owner)
        self.inflight[owner] += entry.nbytes
        return put_id

    def close(self, put_id: int) -> tuple[Entry, str] | None:
        """End a reservation (its pages stay with the entry); None if it ended already."""
        found = self._filling.pop(put_id, None)
        if found is None:
            return None
        entry, owner = found
        self._uncount(owner, entry.nbytes)
        return found

    def open_writer(self, put_id: int, process: ProcessRef, token: int, entry: Entry) -> None:
        """``process`` fills reservation ``put_id`` itself and knows it by ``token``:
        recorded before it is told the runs (the index too, so that a daemon killed
        meanwhile does not reuse them)."""
        self._writers[put_id] = (process, token)
        if self._t.index is not None:
            self._t.index.write(put_id, process, entry.runs)

    def close_writer(self, put_id: int, entry: Entry, owner: str, *, stopped: bool) -> bool:
        """Reservation ``put_id`` ended (closed already). True when its pages are now held
        for a writer that may still write them (``stopped`` False and its process runs):
        they count against ``owner``'s quota until it is done or gone. False when it had no
        writer or its writer is done: the store gives the pages back or keeps them."""
        found = self._writers.pop(put_id, None)
        if found is None:
            return False
        process, token = found
        if stopped or not process.alive():
            if self._t.index is not None:
                self._t.index.unwrite(put_id)
            return False
        self.written.add(Written(put_id, process, entry.runs, owner, entry.nbytes, token))
        log.info(
            "put of %r ended while pid %d may still write its pages: %d bytes held until it "
            "is done or exits",
            entry.key[:64], process.pid, entry.nbytes,
        )  # fmt: skip
        self.inflight[owner] += entry.nbytes
        self._t.counters["puts_write_held"] += 1
        self._t.counters["write_held_bytes"] += entry.nbytes
        return True

    def hold(self, written: Written) -> None:
        """Hold pages for a process that writes them itself (a stash, ``stash.py``):
        counted against its owner's quota, and in the index before it is told of them."""
        assert written.owner is not None, written
        self.written.add(written)
        self.inflight[written.owner] += written.nbytes
        if self._t.index is not None:
            self._t.index.write(written.write_id, written.process, written.runs)

    def rehold(self, written: Written, runs: tuple[Run, ...], nbytes: int) -> None:
        """Shrink a hold to ``runs`` (``nbytes`` of quota): the rest left it, to an entry or
        the allocator, by the caller. The index's record is replaced under a new id."""
        assert written.owner is not None, written
        self.written.pop(written.write_id)
        self._uncount(written.owner, written.nbytes)
        if self._t.index is not None:
            self._t.index.unwrite(written.write_id)
        if runs:
            self.hold(Written(self.next_id(), written.process, runs, written.owner, nbytes,
                              written.token))  # fmt: skip

    def writer_done(self, process: ProcessRef, token: int) -> bool:
        """``process`` says it stopped writing the pages of the ended reservation it knows
        by ``token``: they go back now. False when it holds none by that id."""
        written = self.written.find(process, token)
        if written is None:
            return False
        self.written.pop(written.write_id)
        self._give_back(written)
        return True

    def free_written(self, process: ProcessRef) -> int:
        """``process`` has exited: its held pages go back; returns how many holds ended."""
        held = self.written.pop_process(process)
        for written in held:
            self._give_back(written)
        return len(held)

    def _give_back(self, written: Written) -> None:
        if self._t.index is not None:
            self._t.index.unwrite(written.write_id)  # before the pages can be reused
        self._t.alloc.free(written.runs)
        if written.owner is not None:
            self._uncount(written.owner, written.nbytes)

    def _uncount(self, owner: str, nbytes: int) -> None:
        self.inflight[owner] -= nbytes
        if not self.inflight[owner]:
            del self.inflight[owner]

    def clear(self) -> None:
        """The store is closing: forget every reservation and writer (the index, let go
        first, keeps the writers' records for the next daemon)."""
        self._filling.clear()
        self._writers.clear()
        self.written.clear()
        self.inflight.clear()
