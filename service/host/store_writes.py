"""The host store's bookkeeping of pages that client processes write themselves.

A reservation filled by a client through its own mapping has a writer (``write_holds.py``
says why that matters); the store records it with the reservation, and in the warm-restart
index, and decides at the reservation's end whether its pages may go back now or must be
held until the writer is done or gone. Mixed into ``HostStore``; no lock of its own (the
engine's lock is held around every call).
"""

from __future__ import annotations

import logging
from collections import Counter

from embcache.service.host.allocator import PageRunAllocator
from embcache.service.host.entries import Entry
from embcache.service.host.pool_index import PoolIndex
from embcache.service.host.quarantine import ProcessRef
from embcache.service.host.write_holds import WriteHolds, Written

log = logging.getLogger(__name__)


class StoreWrites:
    """The writer side of ``HostStore`` (module docstring)."""

    alloc: PageRunAllocator
    inflight: Counter[str]
    counters: Counter[str]
    index: PoolIndex | None
    written: WriteHolds
    _writers: dict[int, tuple[ProcessRef, int]]  # put id -> (its writer, the client's id)

    def open_writer(self, put_id: int, process: ProcessRef, token: int, entry: Entry) -> None:
        """``process`` fills reservation ``put_id`` itself, and knows it by ``token``:
        recorded before it is told the runs (the index too, so a daemon killed meanwhile
        does not reuse them)."""
        self._writers[put_id] = (process, token)
        if self.index is not None:
            self.index.write(put_id, process, entry.runs)

    def close_writer(self, put_id: int, entry: Entry, owner: str, *, stopped: bool) -> bool:
        """Reservation ``put_id`` ended (its fill record closed already). ``stopped``: its
        writer said it is done (a commit, or its own abort). True when the pages were held
        for a writer that may still write them: they count against ``owner``'s in-flight
        quota until it has exited; False when the caller may give them back or keep them."""
        found = self._writers.pop(put_id, None)
        if found is None:
            return False
        process, token = found
        if stopped or not process.alive():
            if self.index is not None:
                self.index.unwrite(put_id)
            return False
        self.written.add(Written(put_id, process, entry.runs, owner, entry.nbytes, token))
        log.info(
            "put of %r ended while pid %d may still write its pages: %d bytes held until it "
            "is done or exits",
            entry.key[:64], process.pid, entry.nbytes,
        )  # fmt: skip
        self.inflight[owner] += entry.nbytes
        self.counters["puts_write_held"] += 1
        self.counters["write_held_bytes"] += entry.nbytes
        return True

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
        if self.index is not None:
            self.index.unwrite(written.write_id)  # before the pages can be reused
        self.alloc.free(written.runs)
        owner = written.owner
        if owner is not None:
            self.inflight[owner] -= written.nbytes
            if not self.inflight[owner]:
                del self.inflight[owner]

    def drop_writers(self) -> None:
        """The engine is closing: forget every writer (the index, let go first, keeps their
        records for the next daemon: the processes may still write)."""
        self._writers.clear()
        self.written.clear()
