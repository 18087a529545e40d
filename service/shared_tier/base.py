"""The shared-tier interface: what every adapter (Redis, Mooncake Store) implements.

A shared tier stores one object per entry: a fixed 256-byte header (dtype, shape, nbytes,
CRC32 of the payload, a digest of the key, chunk layout) followed by the payload. The
header lets a node that has never seen the key reserve the right pages before the payload
arrives, and lets the reader reject anything that is not exactly what was written
(checksum mismatch = a miss, never corrupt data).

Adapters move bytes between the store and byte runs ``(offset, length)`` of the host pool
(one flat uint8 buffer), so a payload goes straight into, or out of, the pages of an entry.
Every method may raise on an outage; the caller (``attach.py``) turns that into degraded
mode, never into a failed local operation.
"""

from __future__ import annotations

import enum
import hashlib
import struct
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from embcache.proto.checksum import crc32

HEADER_BYTES = 256
MAGIC = b"EMBC"
VERSION = 1
MAX_NDIM = 8
# magic, version, ndim, flags, dtype, nbytes, crc32, chunk_bytes, nchunks, gen, key digest,
# shape; a CRC32 of those bytes follows, then zero padding up to HEADER_BYTES.
_FMT = struct.Struct("<4sHBB16sQIQIQ16s8q")
_CRC = struct.Struct("<I")

ByteRuns = Sequence[tuple[int, int]]  # (offset, length) in the host pool, in payload order


class TierError(RuntimeError):
    """The shared tier could not be reached or answered with an error (an outage)."""


class FetchResult(enum.Enum):
    """What a fetch of one key found."""

    FILLED = "filled"  # payload is in the reserved runs (the checksum is checked on commit)
    MISSING = "missing"  # not in the shared tier
    CORRUPT = "corrupt"  # header or sizes do not match: treated as a miss
    SKIPPED = "skipped"  # the sink did not want it (e.g. filled locally meanwhile)


def key_digest(key: str) -> bytes:
    """16-byte digest naming a key in the store: bounded length, no special characters."""
    return hashlib.blake2b(key.encode(), digest_size=16).digest()


def object_name(prefix: str, key: str) -> str:
    """The store's name for ``key``'s object: ``prefix`` and the key's digest in hex."""
    return prefix + key_digest(key).hex()


@dataclass(frozen=True, slots=True)
class Header:
    """The fixed header in front of every stored payload (module docstring)."""

    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    crc32: int
    digest: bytes
    chunk_bytes: int = 0  # Redis: payload split in chunks of this size (0: one object)
    nchunks: int = 1
    gen: int = 0  # Redis: names the chunk keys of one write

    def pack(self) -> bytes:
        """``HEADER_BYTES`` bytes, with a CRC32 of their own; ValueError past ``MAX_NDIM``."""
        if len(self.shape) > MAX_NDIM:
            raise ValueError(f"shape has more than {MAX_NDIM} dimensions: {self.shape}")
        shape = list(self.shape) + [0] * (MAX_NDIM - len(self.shape))
        body = _FMT.pack(
            MAGIC,
            VERSION,
            len(self.shape),
            0,
            self.dtype.encode(),
            self.nbytes,
            self.crc32,
            self.chunk_bytes,
            self.nchunks,
            self.gen,
            self.digest,
            *shape,
        )
        body += _CRC.pack(crc32(body))
        return body + bytes(HEADER_BYTES - len(body))

    @classmethod
    def unpack(cls, data: bytes | memoryview | np.ndarray) -> Header | None:
        """The header at the start of ``data``, or None if it is not a valid one."""
        raw = bytes(memoryview(data)[:HEADER_BYTES])  # type: ignore[arg-type]
        if len(raw) < HEADER_BYTES:
            return None
        body = raw[: _FMT.size]
        (crc,) = _CRC.unpack_from(raw, _FMT.size)
        if crc32(body) != crc:
            return None
        f = _FMT.unpack(body)
        magic, version, ndim, _flags, dtype, nbytes, payload_crc, chunk, nchunks, gen, digest = f[
            :11
        ]
        if magic != MAGIC or version != VERSION or ndim > MAX_NDIM or nchunks < 1:
            return None
        return cls(
            dtype.rstrip(b"\0").decode(),
            tuple(f[11 : 11 + ndim]),
            nbytes,
            payload_crc,
            digest,
            chunk,
            nchunks,
            gen,
        )


@dataclass(frozen=True, slots=True)
class PutItem:
    """One entry to write: its key, header and where its payload is in the host pool."""

    key: str
    header: Header
    runs: ByteRuns


# Called by an adapter once it knows an entry's header: the byte runs to fill, or None to
# skip the key. The adapter writes exactly ``header.nbytes`` bytes into the runs.
Reserve = Callable[[str, Header], ByteRuns | None]


def payload_crc(pool: np.ndarray, runs: ByteRuns) -> int:
    """The CRC32 of the payload held in ``runs`` of the host pool, in order."""
    crc = 0
    for off, length in runs:
        crc = crc32(pool[off : off + length].data, crc)
    return crc


def scatter(pool: np.ndarray, runs: ByteRuns, pieces: Sequence[memoryview]) -> int:
    """Copy consecutive ``pieces`` into the byte runs in order; returns bytes copied."""
    run, run_off, copied = 0, 0, 0
    for piece in pieces:
        src = np.frombuffer(piece, dtype=np.uint8)
        pos = 0
        while pos < src.size:
            off, length = runs[run]
            take = min(length - run_off, src.size - pos)
            pool[off + run_off : off + run_off + take] = src[pos : pos + take]
            pos += take
            run_off += take
            copied += take
            if run_off == length:
                run, run_off = run + 1, 0
    return copied


class SharedTierBackend(ABC):
    """Batch put / get-into-page-runs / exists / delete / ping over one distributed store."""

    name: str = "base"

    @abstractmethod
    def attach_pool(self, pool: np.ndarray) -> None:
        """Bind the host pool buffer (registered with the store's transport where it can)."""

    @abstractmethod
    def put_batch(self, items: Sequence[PutItem]) -> list[bool]:
        """Write each entry (header + payload read from the pool); True where stored."""

    @abstractmethod
    def get_batch(self, keys: Sequence[str], reserve: Reserve) -> list[FetchResult]:
        """Fetch each key's payload into the runs ``reserve`` returns for it."""

    @abstractmethod
    def exists(self, keys: Sequence[str]) -> list[bool]: ...

    @abstractmethod
    def delete(self, keys: Sequence[str], *, force: bool = False) -> int:
        """Remove entries (``force``: even if the store holds a read lease on them)."""

    @abstractmethod
    def ping(self) -> None:
        """Raise TierError unless the store answers."""

    @abstractmethod
    def describe(self) -> dict[str, object]:
        """Static facts for health detail (backend, endpoints, mode); no secrets."""

    @abstractmethod
    def close(self) -> None: ...
