"""Turn two byte-run lists over the same bytes into a ``transfer_ranges`` plan.

An entry's bytes sit in host page runs on one side and device page runs (or a client
buffer) on the other, with different page sizes, so range boundaries differ. The plan is
the merge of both boundary lists: each piece is contiguous on both sides. Lengths are
rounded up to whole rows (16 bytes by default): the copy may carry up to 15 bytes past an
entry's end, which stay inside pages that belong to the same entry on both sides.
"""

from __future__ import annotations

import bisect
import itertools
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


def merge_runs(src: ByteRuns, dst: ByteRuns) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pieces ``(src_offsets, dst_offsets, lengths)`` copying two run lists of equal length.

    Pieces start wherever either side's run starts; pieces contiguous on both sides are
    joined again. Cost is a handful of numpy calls, whatever the number of runs.
    """
    src_addr, src_len = _columns(src)
    dst_addr, dst_len = _columns(dst)
    return merge_arrays(src_addr, src_len, dst_addr, dst_len)


def merge_arrays(
    src_addr: np.ndarray, src_len: np.ndarray, dst_addr: np.ndarray, dst_len: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`merge_runs` on int64 columns (address, length) of each side."""
    total = int(src_len.sum())
    assert total == int(dst_len.sum()), "both sides must hold the same number of bytes"
    if total == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    src_start = np.cumsum(src_len) - src_len  # logical offset where each run starts
    dst_start = np.cumsum(dst_len) - dst_len
    cuts = np.union1d(src_start[src_len > 0], dst_start[dst_len > 0])
    ends = np.append(cuts[1:], total)
    si = np.searchsorted(src_start, cuts, side="right") - 1
    di = np.searchsorted(dst_start, cuts, side="right") - 1
    so = src_addr[si] + (cuts - src_start[si])
    do = dst_addr[di] + (cuts - dst_start[di])
    ln = ends - cuts
    if len(ln) > 1:
        joined = (so[1:] == so[:-1] + ln[:-1]) & (do[1:] == do[:-1] + ln[:-1])
        heads = np.flatnonzero(np.concatenate(([True], ~joined)))
        ln = np.add.reduceat(ln, heads)
        so, do = so[heads], do[heads]
    return so, do, ln


def page_runs_as_bytes(
    runs_per_entry: Sequence[Sequence[tuple[int, int]]], page: int, padded: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Byte runs (address, length) of several entries' page runs, each cut to its padded size.

    Every entry holds ``ceil(padded / page)`` pages, so only its last run is cut, by less than
    a page. Entries with no runs must be left out by the caller.
    """
    counts = np.fromiter(
        (len(r) for r in runs_per_entry), dtype=np.int64, count=len(runs_per_entry)
    )
    flat = np.fromiter(
        (x for runs in runs_per_entry for run in runs for x in run),
        dtype=np.int64,
        count=2 * int(counts.sum()),
    ).reshape(-1, 2)
    addr = flat[:, 0] * page
    length = flat[:, 1] * page
    last = np.cumsum(counts) - 1
    whole = np.add.reduceat(length, last - counts + 1)
    length[last] -= whole - padded
    assert (length > 0).all(), "an entry's pages do not match its size"
    return addr, length


SMALL_PLAN_RUNS = 64  # up to this many runs (both sides), plain Python beats numpy's call costs


def plan_entries(
    src_runs: Sequence[Sequence[tuple[int, int]]],
    src_page: int,
    dst_runs: Sequence[Sequence[tuple[int, int]]],
    dst_page: int,
    padded: Sequence[int],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Byte pieces ``(src, dst, length)`` copying several entries between page runs.

    Entry ``i`` spans ``padded[i]`` bytes of its page runs ``src_runs[i]`` (pages of
    ``src_page`` bytes) and ``dst_runs[i]``; entries with no bytes must be left out.
    """
    if sum(map(len, src_runs)) + sum(map(len, dst_runs)) > SMALL_PLAN_RUNS:
        sizes = np.asarray(padded, dtype=np.int64)
        s_addr, s_len = page_runs_as_bytes(src_runs, src_page, sizes)
        d_addr, d_len = page_runs_as_bytes(dst_runs, dst_page, sizes)
        return merge_arrays(s_addr, s_len, d_addr, d_len)
    so: list[int] = []
    do: list[int] = []
    ln: list[int] = []
    for s_runs, d_runs, size in zip(src_runs, dst_runs, padded, strict=True):
        a = truncate_runs([(p * src_page, k * src_page) for p, k in s_runs], size)
        b = truncate_runs([(p * dst_page, k * dst_page) for p, k in d_runs], size)
        a_at = list(itertools.accumulate((n for _, n in a), initial=0))
        b_at = list(itertools.accumulate((n for _, n in b), initial=0))
        cuts = sorted(set(a_at[:-1]) | set(b_at[:-1]))
        for cut, end in zip(cuts, [*cuts[1:], size], strict=True):
            i = bisect.bisect_right(a_at, cut) - 1
            j = bisect.bisect_right(b_at, cut) - 1
            src, dst = a[i][0] + cut - a_at[i], b[j][0] + cut - b_at[j]
            if so and so[-1] + ln[-1] == src and do[-1] + ln[-1] == dst:
                ln[-1] += end - cut  # contiguous on both sides (e.g. across entries)
            else:
                so.append(src)
                do.append(dst)
                ln.append(end - cut)
    return (np.array(so, dtype=np.int64), np.array(do, dtype=np.int64),
            np.array(ln, dtype=np.int64))  # fmt: skip


def _columns(runs: ByteRuns) -> tuple[np.ndarray, np.ndarray]:
    arr = np.asarray(runs, dtype=np.int64).reshape(-1, 2)
    return arr[:, 0], arr[:, 1]


class PlanBuilder:
    """Accumulates entries' runs, then plans them all at once in rows of ``row`` bytes."""

    def __init__(self, row: int = 16) -> None:
        self.row = row
        self._src: list[tuple[int, int]] = []
        self._dst: list[tuple[int, int]] = []
        self.nbytes = 0

    def add(self, src: ByteRuns, dst: ByteRuns, nbytes: int) -> None:
        """Copy ``nbytes`` (rounded up to a row) from ``src`` runs to ``dst`` runs."""
        padded = -(-nbytes // self.row) * self.row
        self._src += truncate_runs(src, padded)
        self._dst += truncate_runs(dst, padded)
        self.nbytes += nbytes

    def __len__(self) -> int:
        return len(self._src)

    def rows(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        so, do, ln = merge_runs(self._src, self._dst)
        r = self.row
        assert not ((so | do | ln) % r).any(), f"a piece is not a whole number of {r}-byte rows"
        return so // r, do // r, ln // r
