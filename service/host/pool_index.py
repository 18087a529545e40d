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

log = logging.getLogger(__name__)

INDEX_SUFFIX = ".index"
_SLACK = 4096  # records written beyond twice the live ones before a compaction


def index_path(segment: Path) -> Path:
    """The index file of the segment at ``segment``."""
    return segment.with_name(segment.name + INDEX_SUFFIX)


@dataclass(slots=True)
class Replayed:
    """What an index held: its header, the live entries (in the order they were added) and
    the live holds, and whether a torn tail was dropped."""

    header: rec.Header
    adds: dict[str, rec.AddRecord] = field(default_factory=dict)
    raw: dict[str, bytes] = field(default_factory=dict)  # key -> its framed ADD, as read
    holds: dict[int, rec.HoldRecord] = field(default_factory=dict)
    torn: bool = False


def replay(path: Path) -> Replayed:
    """Read the index at ``path``; IndexFormatError when its header is not one (a missing
    file raises FileNotFoundError)."""
    data = path.read_bytes()
    out = Replayed(rec.Header.unpack(data))
    stop = rec.HEADER_BYTES  # where the replay stopped
    for record, end in rec.records(data):
        if isinstance(record, rec.AddRecord):
            out.adds.pop(record.key, None)  # a re-add goes to the most recent end
            out.adds[record.key] = record
            out.raw[record.key] = data[stop:end]
        elif isinstance(record, rec.HoldRecord):
            out.holds[record.hold_id] = record
        elif record[0] == rec.DEL:
            out.adds.pop(str(record[1]), None)
            out.raw.pop(str(record[1]), None)
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
        self._written = 0  # records in the file
        self._batch: list[bytes] | None = None  # records held back by batch()

    @classmethod
    def create(cls, path: Path, header: rec.Header, replayed: Replayed | None = None) -> PoolIndex:
        """A fresh index at ``path`` (replacing any), holding what ``replayed`` kept live."""
        index = cls(path, header)
        if replayed is not None:
            raw = replayed.raw
            index._adds = {k: raw.get(k) or rec.encode_add(a) for k, a in replayed.adds.items()}
            index._holds = {i: rec.encode_hold(h) for i, h in replayed.holds.items()}
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
        if self._written > 2 * (len(self._adds) + len(self._holds)) + _SLACK:
            self._rewrite()

    def _rewrite(self) -> None:
        """Write the live records to a new file that replaces the old one atomically."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        body = [self.header.pack(), *self._adds.values(), *self._holds.values()]
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            try:
                os.write(fd, b"".join(body))
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
            new = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW)
        except OSError:
            log.exception("cannot write the warm-restart index %s: removing it", self.path)
            tmp.unlink(missing_ok=True)
            self.remove()
            return
        self._close_fd()
        self._fd = new
        self._written = len(body) - 1

    def _close_fd(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None

    def close(self) -> None:
        """Stop writing; the file stays for the next daemon."""
        self._close_fd()

    def remove(self) -> None:
        """Stop writing and remove the file (the next start is cold)."""
        self._close_fd()
        self.path.unlink(missing_ok=True)
