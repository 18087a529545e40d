"""The warm-restart index file: what the daemon appends, and what a starting one replays.

:class:`PoolIndex` is written only by the daemon that holds the segment's ``flock``, and
only under the engine's lock (the host store calls it), so it has one writer. Each change
is one ``write`` of one framed record (``index_records.py``) to a file opened
``O_APPEND``: a process that dies stops between two records, or inside one, which the
replay drops (its length or CRC fails). The ordering that makes the file crash-consistent
is the store's: an ``ADD`` once the bytes are complete, a ``DEL`` before the pages can be
reused.

When the file holds more than twice its live records (plus slack), the live ones are
written to a new file that replaces it atomically (``os.replace``); a starting daemon does
the same, so it also drops a torn tail. A write that fails (``/dev/shm`` full) removes the
index: the next start is cold, never wrong.

``/dev/shm`` is writable by every local user, so the new file is created exclusively with
mode 0600 (``shm_files.py``) and written through the descriptor that created it, never
reopened by name; a replay reads only an index this uid owns that nobody else may write.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from embcache.service.host import index_records as rec
from embcache.service.host.entries import Entry
from embcache.service.host.quarantine import ProcessRef
from embcache.service.host.shm_files import UntrustedFile, clear_own, create_exclusive, read_trusted

log = logging.getLogger(__name__)

INDEX_SUFFIX = ".index"
_SLACK = 4096  # records written beyond twice the live ones before a compaction


def index_path(segment: Path) -> Path:
    """The index file of the segment at ``segment``."""
    return segment.with_name(segment.name + INDEX_SUFFIX)


@dataclass(slots=True)
class Replayed:
    """What an index held: its header, the live entries (in the order they were added), the
    live holds and writes, the whole records it could not use, and whether a torn tail was
    dropped."""

    header: rec.Header
    adds: dict[str, rec.AddRecord] = field(default_factory=dict)
    raw: dict[str, bytes] = field(default_factory=dict)  # key -> its framed ADD, as read
    holds: dict[int, rec.HoldRecord] = field(default_factory=dict)
    writes: dict[int, rec.WriteRecord] = field(default_factory=dict)
    skipped: list[rec.Skipped] = field(default_factory=list)
    torn: bool = False


def replay(path: Path) -> Replayed:
    """Read the index at ``path``; IndexFormatError when its header is not one (a missing
    file raises FileNotFoundError; one this daemon did not write, UntrustedFile)."""
    data = read_trusted(path)
    out = Replayed(rec.Header.unpack(data))
    stop = rec.HEADER_BYTES  # where the replay stopped
    for record, end in rec.records(data):
        if isinstance(record, rec.AddRecord):
            out.adds.pop(record.key, None)  # a re-add goes to the most recent end
            out.adds[record.key] = record
            out.raw[record.key] = data[stop:end]
        elif isinstance(record, rec.HoldRecord):
            out.holds[record.hold_id] = record
        elif isinstance(record, rec.WriteRecord):
            out.writes[record.write_id] = record
        elif isinstance(record, rec.Skipped):
            out.skipped.append(record)
            if record.key is not None:  # the key's latest record is not usable: it goes
                out.adds.pop(record.key, None)
                out.raw.pop(record.key, None)
        elif record[0] == rec.DEL:
            out.adds.pop(str(record[1]), None)
            out.raw.pop(str(record[1]), None)
        elif record[0] == rec.UNWRITE:
            out.writes.pop(int(record[1]), None)
        else:
            out.holds.pop(int(record[1]), None)
        stop = end
    out.torn = stop != len(data)
    return out


class PoolIndex:
    """The index of one segment, open for appending (module docstring). Build it with
    :meth:`create`."""

    def __init__(self, path: Path, header: rec.Header) -> None:
        self.path = path
        self.header = header
        self._fd: int | None = None
        self._adds: dict[str, bytes] = {}  # key -> its framed ADD (for compaction)
        self._holds: dict[int, bytes] = {}  # hold id -> its framed HOLD
        self._writes: dict[int, bytes] = {}  # write id -> its framed WRITE
        self._written = 0  # records in the file
        self._batch: list[bytes] | None = None  # records held back by batch()
        self.refused = 0  # files at its names refused as another user's (shm_files.py)

    @classmethod
    def create(cls, path: Path, header: rec.Header, replayed: Replayed | None = None) -> PoolIndex:
        """A fresh index at ``path`` (replacing any), holding what ``replayed`` kept live."""
        index = cls(path, header)
        if replayed is not None:
            raw = replayed.raw
            index._adds = {k: raw.get(k) or rec.encode_add(a) for k, a in replayed.adds.items()}
            index._holds = {i: rec.encode_hold(h) for i, h in replayed.holds.items()}
            index._writes = {i: rec.encode_write(w) for i, w in replayed.writes.items()}
        index._rewrite()
        return index

    @property
    def active(self) -> bool:
        """False once closed, or after a write failed (the index was removed)."""
        return self._fd is not None

    def __len__(self) -> int:
        return len(self._adds)

    # -- changes (the store calls these under the engine's lock) -------------------------
    def add(self, entry: Entry, crc: int) -> None:
        """``entry`` is READY and its bytes complete, with CRC32 ``crc``."""
        record = rec.AddRecord(
            entry.key, entry.dtype, entry.shape, entry.nbytes, entry.runs, crc,
            self.header.generation,
        )  # fmt: skip
        data = rec.encode_add(record)
        self._adds[entry.key] = data
        self._append(data)

    def delete(self, key: str) -> None:
        """``key``'s entry goes; call before its pages can be reused."""
        if self._adds.pop(key, None) is not None:
            self._append(rec.encode_del(key))

    def hold(self, hold_id: int, process: ProcessRef, key: str) -> None:
        """``process`` may read ``key``'s pages through views (a lease it holds)."""
        if hold_id not in self._holds:
            data = rec.encode_hold(rec.HoldRecord(hold_id, process.pid, process.start, key))
            self._holds[hold_id] = data
            self._append(data)

    def unhold(self, hold_id: int) -> None:
        """That hold ended: its views are gone, or its process exited."""
        if self._holds.pop(hold_id, None) is not None:
            self._append(rec.encode_unhold(hold_id))

    def write(self, write_id: int, process: ProcessRef, runs: tuple[tuple[int, int], ...]) -> None:
        """``process`` may write ``runs`` through its own mapping from now on (a reservation
        it fills itself); call before it is told the runs."""
        if write_id not in self._writes:
            data = rec.encode_write(rec.WriteRecord(write_id, process.pid, process.start, runs))
            self._writes[write_id] = data
            self._append(data)

    def unwrite(self, write_id: int) -> None:
        """That process is done writing those pages (it said so, or it exited)."""
        if self._writes.pop(write_id, None) is not None:
            self._append(rec.encode_unwrite(write_id))

    # -- the file ------------------------------------------------------------------------
    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Write the records of the block in one ``write`` at its end (the holds of a batch
        get, the releases of many leases); the caller returns to its client after it."""
        if self._batch is not None:  # nested: the outer batch writes
            yield
            return
        self._batch = []
        try:
            yield
        finally:
            records, self._batch = self._batch, None
            if records:
                self._write(b"".join(records), len(records))

    def _append(self, data: bytes) -> None:
        if self._batch is not None:
            self._batch.append(data)
        else:
            self._write(data, 1)

    def _write(self, data: bytes, count: int) -> None:
        if self._fd is None:
            return
        try:
            if os.write(self._fd, data) != len(data):
                raise OSError("short write to the index")
        except OSError:
            log.exception("cannot write the warm-restart index %s: removing it", self.path)
            self.remove()
            return
        self._written += count
        live = len(self._adds) + len(self._holds) + len(self._writes)
        if self._written > 2 * live + _SLACK:
            self._rewrite()

    def _rewrite(self) -> None:
        """Write the live records to a new file that replaces the old one atomically. The
        file is created exclusively (never one planted at the name, never through a
        symlink) and appended to through the descriptor that created it."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        body = [self.header.pack(), *self._adds.values(), *self._holds.values()]
        body += self._writes.values()
        try:
            new = create_exclusive(tmp, 0o600, os.O_WRONLY | os.O_APPEND)
        except OSError as exc:
            self._refuse(exc)
            return
        try:
            data = b"".join(body)
            if os.write(new, data) != len(data):
                raise OSError("short write to the index")
            clear_own(self.path, remove=False)  # another user's file there: refused, kept
            os.replace(tmp, self.path)
        except OSError as exc:
            os.close(new)
            tmp.unlink(missing_ok=True)
            self._refuse(exc)
            return
        self._close_fd()
        self._fd = new
        self._written = len(body) - 1

    def _refuse(self, exc: OSError) -> None:
        """The index cannot be written safely: stop keeping one (the next start is cold)."""
        if isinstance(exc, UntrustedFile):  # another user's file is left as it is
            log.error("warm-restart index %s: %s; no index is kept", self.path.name, exc)
            self.refused += 1
        else:
            log.exception("cannot write the warm-restart index %s: removing it", self.path)
        self.remove()  # ours, no longer kept up to date: it would lie to the next start

    def _close_fd(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None

    def close(self) -> None:
        """Stop writing; the file stays for the next daemon."""
        self._close_fd()

    def remove(self) -> None:
        """Stop writing and remove the file (the next start is cold); a file at the name
        that another user owns is left alone."""
        self._close_fd()
        try:
            clear_own(self.path)
        except UntrustedFile as exc:
            log.error("warm-restart index %s: %s", self.path.name, exc)
