"""The host pool's segment cut into fixed-size chunks, each registered with CUDA on its own.

A client registers its mapping of the pool piece by piece (``registered.py``), so the pool is
usable chunk by chunk long before all of it is, and a copy must know which chunks its bytes
lie in: a copy-engine copy resolves its source against one registration, so a byte run that
crosses a chunk boundary is copied as two pieces. This module is that arithmetic alone, with
no CUDA in it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# 256 MiB: registering one costs 20-200 ms (0.07-0.75 s per GiB, docs/same_node_reads.md), short
# enough that closing or exiting waits for at most one, and a 100 GiB pool is 400 chunks.
CHUNK_BYTES = 256 << 20


@dataclass(frozen=True, slots=True)
class Piece:
    """Part of a byte run that lies inside one chunk."""

    offset: int  # byte offset in the segment
    length: int  # bytes, > 0
    chunk: int  # index of the chunk holding all of it


@dataclass(frozen=True, slots=True)
class PoolChunks:
    """A segment of ``size`` bytes in chunks of ``chunk_bytes`` (the last may be shorter)."""

    size: int
    chunk_bytes: int = CHUNK_BYTES

    def __post_init__(self) -> None:
        if self.size <= 0:
            raise ValueError(f"size: must be positive, got {self.size}")
        # A multiple of 4 KiB keeps every chunk page-aligned (the mapping is), and of 16 keeps
        # a chunk's start a multiple of any copy row width.
        if self.chunk_bytes <= 0 or self.chunk_bytes % 4096:
            raise ValueError(
                f"chunk_bytes: must be a positive multiple of 4096, got {self.chunk_bytes}"
            )

    @property
    def num_chunks(self) -> int:
        return -(-self.size // self.chunk_bytes)

    def bounds(self, chunk: int) -> tuple[int, int]:
        """Byte range ``[start, end)`` of ``chunk`` in the segment."""
        assert 0 <= chunk < self.num_chunks, (chunk, self.num_chunks)
        start = chunk * self.chunk_bytes
        return start, min(start + self.chunk_bytes, self.size)

    def chunks_of(self, start: int, end: int) -> range:
        """The chunks overlapping ``[start, end)`` (empty for an empty range); the range must
        lie inside the segment."""
        assert 0 <= start <= end <= self.size, (start, end, self.size)
        if start == end:
            return range(0)
        return range(start // self.chunk_bytes, (end - 1) // self.chunk_bytes + 1)

    def split(self, runs: Sequence[tuple[int, int]]) -> list[Piece] | None:
        """``runs`` (byte offset, byte length) as pieces that each lie in one chunk, in order;
        empty runs are dropped. None when a run is negative or leaves the segment (a table
        slot read while it changed): the caller then asks the daemon."""
        pieces: list[Piece] = []
        size, step = self.size, self.chunk_bytes
        for offset, length in runs:
            if offset < 0 or length < 0 or offset + length > size:
                return None
            end = offset + length
            while offset < end:
                chunk = offset // step
                take = min(end, (chunk + 1) * step) - offset
                pieces.append(Piece(offset, take, chunk))
                offset += take
        return pieces
