"""Streaming fill of one reserved entry: write chunks in order, then commit or abort.

A handle owns its FILLING reservation, so chunk copies run without the engine lock; the
handle's own lock only orders a copy against a concurrent abort (a dropped client, a
closing engine), so an aborted reservation is never written after its pages are freed.
(Pages a client fills itself, through its own mapping, are a stash: ``host/stash.py``.)

Where a put declares a CRC32, it is computed over the pages, after each piece of them is
written (in cache): what is checked is what will be served, not the bytes as they arrived.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from embcache.errors import ChecksumMismatch, Draining, InvalidArgument, LeaseExpired
from embcache.proto.checksum import crc32

if TYPE_CHECKING:
    from embcache.service.host.entries import Entry


@dataclass(frozen=True, slots=True)
class FillTarget:
    """Where a reservation's bytes go and whom the handle tells: the pool's bytes, and the
    engine's calls that commit or abort the reservation and say whether it closed."""

    pool: np.ndarray  # the host pool (uint8)
    commit: Callable[[], bool]
    abort: Callable[[], None]
    closed: Callable[[], bool]


def as_byte_array(data: Any) -> np.ndarray:
    """A flat uint8 view of a bytes-like object, numpy array or CPU tensor (no copy)."""
    if isinstance(data, torch.Tensor):
        if data.device.type != "cpu":
            raise InvalidArgument("chunk tensors must be on the CPU", device=str(data.device))
        data = data.detach().contiguous().view(-1).view(torch.uint8).numpy()
    if isinstance(data, np.ndarray):
        if not data.flags.c_contiguous:
            data = np.ascontiguousarray(data)
        return data.reshape(-1).view(np.uint8)
    try:
        return np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
    except TypeError as exc:
        raise InvalidArgument("chunk is not bytes-like", type=type(data).__name__) from exc


class PutHandle:
    """Returned by :meth:`CacheEngine.begin_put`. Use as a context manager to abort on error."""

    def __init__(
        self,
        target: FillTarget | None,
        entry: Entry,
        byte_runs: tuple[tuple[int, int], ...],
        checksum: int | None,
        written: int = 0,
    ) -> None:
        self._target = target  # None: the key already exists; bytes are checked, then dropped
        self.entry = entry
        self._byte_runs = byte_runs
        self._checksum = checksum
        self._crc = 0
        self._lock = threading.Lock()
        self._run = 0  # index of the byte run the next byte goes to
        self._run_off = 0  # offset inside that run
        self.written = written  # all of it when begin_put's copy_in queued the copy
        self.done = False

    @property
    def key(self) -> str:
        return self.entry.key

    @property
    def nbytes(self) -> int:
        return self.entry.nbytes

    @property
    def exists_already(self) -> bool:
        """The key is stored with the same metadata: the bytes are checked, then dropped."""
        return self._target is None

    @property
    def byte_runs(self) -> tuple[tuple[int, int], ...]:
        """``(offset, length)`` in the host pool the entry's bytes go to, in order."""
        return self._byte_runs

    @property
    def has_checksum(self) -> bool:
        """A checksum came with the put: :meth:`filled` has bytes to check."""
        return self._checksum is not None

    def write(self, data: Any) -> None:
        """Append ``data`` to the entry; raises InvalidArgument past the declared size."""
        chunk = as_byte_array(data)
        n = chunk.size
        with self._lock:
            if self.done:
                raise LeaseExpired("put is no longer in progress", key=self.key)
            if self.written + n > self.nbytes:
                raise InvalidArgument(
                    "more bytes than declared",
                    key=self.key,
                    nbytes=self.nbytes,
                    received=self.written + n,
                )
            if self._target is not None:
                if self._target.closed():
                    raise Draining("engine closed during the put", key=self.key)
                self._copy_in(chunk)  # the CRC32 over the pages, as each piece lands
            elif self._checksum is not None:  # stored already: the bytes checked, dropped
                self._crc = crc32(chunk.data, self._crc)
            self.written += n

    def _copy_in(self, chunk: np.ndarray) -> None:
        assert self._target is not None
        pool = self._target.pool
        pos = 0
        n = chunk.size
        while pos < n:
            off, length = self._byte_runs[self._run]
            take = min(length - self._run_off, n - pos)
            start = off + self._run_off
            pool[start : start + take] = chunk[pos : pos + take]
            if self._checksum is not None:  # what the pages hold now, while in cache
                self._crc = crc32(pool[start : start + take].data, self._crc)
            pos += take
            self._run_off += take
            if self._run_off == length:
                self._run += 1
                self._run_off = 0

    def fill_with(
        self, copy: Callable[[tuple[tuple[int, int], ...]], None], *, complete: bool = True
    ) -> None:
        """Fill every byte at once with ``copy(byte_runs)`` (e.g. a device-to-host copy).
        ``complete=False``: the copy is still running when ``copy`` returns; call
        :meth:`filled` once it is done (the checksum is computed then)."""
        with self._lock:
            if self.done:
                raise LeaseExpired("put is no longer in progress", key=self.key)
            if self.written:
                raise InvalidArgument("fill_with needs a handle with nothing written yet")
            if self._target is None:
                raise InvalidArgument("the entry exists already: use skip_bytes()")
            copy(self._byte_runs)
            self.written = self.nbytes
            if complete:
                self._checksum_pool()

    def filled(self) -> None:
        """The copy of a ``fill_with(..., complete=False)`` is done: checksum the bytes;
        ChecksumMismatch now if they do not match (so a batch checks every entry before it
        commits any; the handle stays open for the caller to abort)."""
        with self._lock:
            if self._target is not None and self.written == self.nbytes:
                self._checksum_pool()
        self._verify()

    def _verify(self) -> None:
        if self._checksum is not None and self._crc != self._checksum:
            raise ChecksumMismatch(
                "payload does not match its checksum",
                key=self.key,
                expected=self._checksum,
                actual=self._crc,
            )

    def _checksum_pool(self) -> None:
        if self._checksum is not None and self._target is not None:
            pool = self._target.pool
            for off, length in self._byte_runs:
                self._crc = crc32(pool[off : off + length].data, self._crc)

    def verify(self) -> None:
        """Raise what :meth:`commit` would (too few bytes: InvalidArgument; a bad CRC32:
        ChecksumMismatch) without committing, so a batch checks every entry before it
        commits any; the handle stays open for the caller to abort."""
        if self.written != self.nbytes:
            raise InvalidArgument(
                "put ended before all bytes arrived",
                key=self.key,
                nbytes=self.nbytes,
                received=self.written,
            )
        self._verify()

    def skip_bytes(self) -> None:
        """For a put of an existing identical entry: accept without reading the bytes."""
        with self._lock:
            if self._target is not None:
                raise InvalidArgument("skip_bytes is only for existing entries")
            self.written = self.nbytes
            self._checksum = None

    def commit(self) -> bool:
        """Make the entry visible. True if created, False if an identical one existed."""
        with self._lock:
            if self.done:
                raise LeaseExpired("put is no longer in progress", key=self.key)
            self.done = True
        if self.written != self.nbytes:
            self._discard()
            raise InvalidArgument(
                "put ended before all bytes arrived",
                key=self.key,
                nbytes=self.nbytes,
                received=self.written,
            )
        try:
            self._verify()
        except ChecksumMismatch:
            self._discard()
            raise
        if self._target is None:
            return False
        return self._target.commit()

    def abort(self) -> None:
        """Drop the reservation; nothing becomes visible. Idempotent."""
        with self._lock:
            if self.done:
                return
            self.done = True
        self._discard()

    def _discard(self) -> None:
        if self._target is not None:
            self._target.abort()

    def __enter__(self) -> PutHandle:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if not self.done:  # an exception, or no commit: nothing becomes visible
            self.abort()
