"""The warm-restart index's bytes: its header and its records (``docs/restart.md``).

The index is a file beside the host pool's segment (``<segment>.index``): a fixed header,
then records appended one after the other. Each record is framed as
``length u32 | crc32 u32 | payload`` so a record torn by a crash (a short write, or bytes
never written) fails its length or its CRC and ends the replay there. Payloads:

- ``ADD``: a READY entry: generation, CRC32 of its bytes, nbytes, dtype, shape, page runs,
  key. Written only after the entry's bytes are complete.
- ``DEL``: a key whose entry went. Written before its pages can be reused.
- ``HOLD``: a lease whose owner's process may read the entry's pages through a view: the
  hold's id, the pid and its start time, the key.
- ``UNHOLD``: that hold ended (the views are gone, or the process exited).
- ``WRITE``: pages a client process may still write through its own writable mapping (a
  reservation it fills itself, or one that ended while that process still ran): an id, the
  pid and its start time, the page runs. Written before the client is told the runs.
- ``UNWRITE``: that process is done with those pages (it committed or aborted, or exited).

A framed record whose CRC32 passes but which this daemon cannot use (an unknown dtype, a
key that is not UTF-8) is whole, not torn: the replay skips it (``Skipped``) and goes on.

Everything is little-endian. ``LAYOUT_VERSION`` changes whenever any of this does; a
daemon never adopts an index of another version (it starts cold and says so).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass

from embcache.proto.checksum import crc32
from embcache.proto.dtypes import DType, lookup

MAGIC = b"EMBCIDX\x00"
LAYOUT_VERSION = 2  # 2: WRITE and UNWRITE records
# magic, version, page_bytes, num_pages, segment inode, generation, then the header's CRC32
_HEADER = struct.Struct("<8sIQQQQ")
HEADER_BYTES = _HEADER.size + 4
_FRAME = struct.Struct("<II")  # payload length, CRC32 of the payload
MAX_RECORD = 1 << 20  # longer than any record can be: a torn length, not a record

ADD, DEL, HOLD, UNHOLD, WRITE, UNWRITE = 1, 2, 3, 4, 5, 6
_ADD = struct.Struct("<BIIQB")  # type, generation, crc32, nbytes, len(dtype name)
_HOLD = struct.Struct("<BQIQ")  # type, hold id, pid, start time
_UNHOLD = struct.Struct("<BQ")  # also UNWRITE
_WRITE = struct.Struct("<BQIQI")  # type, id, pid, start time, number of runs


class IndexFormatError(ValueError):
    """The index's header is not one this daemon reads (``reason`` says what differs)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Header:
    """What the index was written for: its layout, the pool's geometry and segment, and the
    generation (bumped by every daemon that adopts it)."""

    version: int
    page_bytes: int
    num_pages: int
    inode: int
    generation: int

    def pack(self) -> bytes:
        head = _HEADER.pack(
            MAGIC, self.version, self.page_bytes, self.num_pages, self.inode, self.generation
        )
        return head + struct.pack("<I", crc32(head))

    @classmethod
    def unpack(cls, data: bytes) -> Header:
        """The header at the start of ``data``; IndexFormatError when it is not one."""
        if len(data) < HEADER_BYTES:
            raise IndexFormatError("index shorter than its header")
        head = data[: _HEADER.size]
        (crc,) = struct.unpack_from("<I", data, _HEADER.size)
        magic, version, page, pages, inode, gen = _HEADER.unpack(head)
        if magic != MAGIC or crc32(head) != crc:
            raise IndexFormatError("not an embcache index (bad magic or header checksum)")
        return cls(version, page, pages, inode, gen)


@dataclass(frozen=True, slots=True)
class AddRecord:
    """One READY entry as the index holds it."""

    key: str
    dtype: DType
    shape: tuple[int, ...]
    nbytes: int
    runs: tuple[tuple[int, int], ...]
    crc: int
    generation: int


@dataclass(frozen=True, slots=True)
class HoldRecord:
    """A hold on ``key``'s pages for the process ``pid`` started at ``start``."""

    hold_id: int
    pid: int
    start: int
    key: str


@dataclass(frozen=True, slots=True)
class WriteRecord:
    """Pages the process ``pid`` started at ``start`` may still write (``runs``)."""

    write_id: int
    pid: int
    start: int
    runs: tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class Skipped:
    """A whole record this daemon cannot use (``reason``); ``key`` when one could be read."""

    reason: str
    key: str | None = None


def _key(key: str) -> bytes:
    raw = key.encode()
    return struct.pack("<H", len(raw)) + raw


def frame(payload: bytes) -> bytes:
    """A payload framed with its length and CRC32."""
    return _FRAME.pack(len(payload), crc32(payload)) + payload


def encode_add(rec: AddRecord) -> bytes:
    name = rec.dtype.name.encode()
    head = _ADD.pack(ADD, rec.generation, rec.crc, rec.nbytes, len(name)) + name
    shape = struct.pack(f"<B{len(rec.shape)}Q", len(rec.shape), *rec.shape)
    flat = [x for run in rec.runs for x in run]
    runs = struct.pack(f"<I{len(flat)}I", len(rec.runs), *flat)
    return frame(head + shape + runs + _key(rec.key))


def encode_del(key: str) -> bytes:
    return frame(bytes([DEL]) + _key(key))


def encode_hold(rec: HoldRecord) -> bytes:
    return frame(_HOLD.pack(HOLD, rec.hold_id, rec.pid, rec.start) + _key(rec.key))


def encode_unhold(hold_id: int) -> bytes:
    return frame(_UNHOLD.pack(UNHOLD, hold_id))


def encode_write(rec: WriteRecord) -> bytes:
    flat = [x for run in rec.runs for x in run]
    head = _WRITE.pack(WRITE, rec.write_id, rec.pid, rec.start, len(rec.runs))
    return frame(head + struct.pack(f"<{len(flat)}I", *flat))


def encode_unwrite(write_id: int) -> bytes:
    return frame(_UNHOLD.pack(UNWRITE, write_id))


# (DEL, key), (UNHOLD, id) or (UNWRITE, id)
Record = AddRecord | HoldRecord | WriteRecord | Skipped | tuple[int, str | int]


def _decode(p: bytes) -> Record:
    kind = p[0]
    if kind == ADD:
        _, gen, crc, nbytes, nlen = _ADD.unpack_from(p)
        at = _ADD.size
        name = p[at : at + nlen].decode()
        dtype = lookup(name)
        at += nlen
        ndim = p[at]
        shape = struct.unpack_from(f"<{ndim}Q", p, at + 1)
        at += 1 + 8 * ndim
        (nruns,) = struct.unpack_from("<I", p, at)
        flat = struct.unpack_from(f"<{2 * nruns}I", p, at + 4)
        at += 4 + 8 * nruns
        runs = tuple(zip(flat[::2], flat[1::2], strict=True))
        key = _read_key(p, at)
        if dtype is None:  # whole, but not a dtype this daemon knows: skipped, not torn
            return Skipped(f"unknown dtype {name!r}", key)
        return AddRecord(key, dtype, tuple(shape), nbytes, runs, crc, gen)
    if kind == DEL:
        return (DEL, _read_key(p, 1))
    if kind == HOLD:
        _, hold_id, pid, start = _HOLD.unpack_from(p)
        return HoldRecord(hold_id, pid, start, _read_key(p, _HOLD.size))
    if kind in (UNHOLD, UNWRITE):
        return (kind, _UNHOLD.unpack_from(p)[1])
    if kind == WRITE:
        _, write_id, pid, start, nruns = _WRITE.unpack_from(p)
        if _WRITE.size + 8 * nruns != len(p):
            raise ValueError("record length does not match its runs")
        flat = struct.unpack_from(f"<{2 * nruns}I", p, _WRITE.size)
        return WriteRecord(write_id, pid, start, tuple(zip(flat[::2], flat[1::2], strict=True)))
    return Skipped(f"unknown record type {kind}")


def _read_key(p: bytes, at: int) -> str:
    (n,) = struct.unpack_from("<H", p, at)
    if at + 2 + n != len(p):
        raise ValueError("record length does not match its key")
    return p[at + 2 : at + 2 + n].decode()


def records(data: bytes, offset: int = HEADER_BYTES) -> Iterator[tuple[Record, int]]:
    """Each whole record from ``offset`` on, with the offset just past it. Stops at the
    first torn one (short, too long, or bad CRC): a crash's tail. A whole one (its CRC
    passes) that does not decode comes as :class:`Skipped`, and the replay goes on."""
    view = memoryview(data)
    while offset + _FRAME.size <= len(data):
        length, crc = _FRAME.unpack_from(data, offset)
        start = offset + _FRAME.size
        if length == 0 or length > MAX_RECORD or start + length > len(data):
            return
        payload = bytes(view[start : start + length])
        if crc32(payload) != crc:
            return
        try:
            rec = _decode(payload)
        except (ValueError, struct.error, UnicodeDecodeError, IndexError) as exc:
            rec = Skipped(f"undecodable record ({exc})")
        offset = start + length
        yield rec, offset
