"""Turn two byte-run lists over the same bytes into a ``transfer_ranges`` plan.

An entry's bytes sit in host page runs on one side and device page runs (or a client
buffer) on the other, with different page sizes, so range boundaries differ. The plan is
the merge of both boundary lists: each piece is contiguous on both sides. Lengths are
rounded up to whole rows (16 bytes by default): the copy may carry up to 15 bytes past an
entry's end, which stay inside pages that belong to the same entry on both sides.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

ByteRuns = Sequence[tuple[int, int]]  # (byte offset, byte length)


def row_bytes_for(*values: int, widest: int = 16) -> int:
    """The widest power-of-two row (<= ``widest``) dividing every value."""
    w = widest
    for v in values:
        while w > 1 and v % w:
            w //= 2
    return w


def truncate_runs(runs: ByteRuns, nbytes: int) -> list[tuple[int, int]]:
    """The first ``nbytes`` of ``runs``."""
    out: list[tuple[int, int]] = []
    left = nbytes
    for off, length in runs:
        if left <= 0:
            break
        take = min(length, left)
        out.append((off, take))
        left -= take
    assert left <= 0, f"runs hold fewer than {nbytes} bytes"
    return out


def pair_runs(src: ByteRuns, dst: ByteRuns, nbytes: int) -> tuple[list[int], list[int], list[int]]:
    """Byte pieces ``(src_offsets, dst_offsets, lengths)`` copying ``nbytes`` from src to dst."""
    so: list[int] = []
    do: list[int] = []
    ln: list[int] = []
    i = j = 0
    si = sj = 0  # bytes used of src[i], dst[j]
    left = nbytes
    while left > 0:
        s_off, s_len = src[i]
        d_off, d_len = dst[j]
        take = min(s_len - si, d_len - sj, left)
        if so and so[-1] + ln[-1] == s_off + si and do[-1] + ln[-1] == d_off + sj:
            ln[-1] += take  # contiguous on both sides: extend the previous piece
        else:
            so.append(s_off + si)
            do.append(d_off + sj)
            ln.append(take)
        si += take
        sj += take
        left -= take
        if si == s_len:
            i, si = i + 1, 0
        if sj == d_len:
            j, sj = j + 1, 0
    return so, do, ln


class PlanBuilder:
    """Accumulates pieces of several entries into one plan counted in rows of ``row`` bytes."""

    def __init__(self, row: int = 16) -> None:
        self.row = row
        self._src: list[int] = []
        self._dst: list[int] = []
        self._len: list[int] = []
        self.nbytes = 0

    def add(self, src: ByteRuns, dst: ByteRuns, nbytes: int) -> None:
        """Copy ``nbytes`` (rounded up to a row) from ``src`` runs to ``dst`` runs."""
        padded = -(-nbytes // self.row) * self.row
        so, do, ln = pair_runs(src, dst, padded)
        for value in (*so, *do, *ln):
            assert value % self.row == 0, f"{value} is not a multiple of the {self.row}-byte row"
        self._src += so
        self._dst += do
        self._len += ln
        self.nbytes += nbytes

    def __len__(self) -> int:
        return len(self._len)

    def rows(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        r = self.row
        return (
            np.asarray(self._src, dtype=np.int64) // r,
            np.asarray(self._dst, dtype=np.int64) // r,
            np.asarray(self._len, dtype=np.int64) // r,
        )
