"""FILLING reservations, writer holds, and the in-flight quota both count against.

A put's pages are reserved before its bytes arrive; until it commits or aborts the entry is
FILLING and lives here, never in the key map, so no reader can see it. Pages a client
process writes itself, through its own mapping (its stashes, ``stash.py``), are writer
holds (``write_holds.py`` says why they matter): held here until that process is done with
them or gone, counting against the owner's quota meanwhile.

A part of :class:`~embcache.service.host.store.HostStore`, which owns it and calls it, over
the store's tables (``tables.py``): a hold is recorded in the warm-restart index before its
process is told the runs, and deleted from it before its pages can be reused. No lock.
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
        self.written.clear()
        self.inflight.clear()
