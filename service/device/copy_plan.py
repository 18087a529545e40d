"""Turn two byte-run lists over the same bytes into a ``transfer_ranges`` plan.

An entry's bytes sit in host page runs on one side and device page runs (or a client
buffer) on the other, with different page sizes, so range boundaries differ. The plan is
the merge of both boundary lists: each piece is contiguous on both sides. Lengths are
rounded up to whole rows (16 bytes by default): the copy may carry up to 15 bytes past an
entry's end, which stay inside pages that belong to the same entry on both sides.
"""

from __future__ import annotations

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
    joined again. Cost is a handful of numpy calls, whatever the number of runs; up to
    ``SMALL_PLAN`` runs (both sides together) the same walk in plain Python is cheaper.
    """
    if len(src) + len(dst) <= SMALL_PLAN:
        return _merge_lists(src, dst)
    src_addr, src_len = _columns(src)
    dst_addr, dst_len = _columns(dst)
    return merge_arrays(src_addr, src_len, dst_addr, dst_len)


def merge_arrays(
    src_addr: np.ndarray, src_len: np.ndarray, dst_addr: np.ndarray, dst_len: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`merge_runs` on int64 columns (address, length) of each side.

    Written for few numpy calls (each has a fixed cost larger than the work on a few runs):
    a sort instead of ``union1d``, and the join and empty-run steps only when needed.
    """
    total = int(src_len.sum())
    assert total == int(dst_len.sum()), "both sides must hold the same number of bytes"
    if total == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    src_start = np.cumsum(src_len) - src_len  # logical offset where each run starts
    dst_start = np.cumsum(dst_len) - dst_len
    cuts = np.concatenate(
        (
            src_start if src_len.all() else src_start[src_len > 0],
            dst_start if dst_len.all() else dst_start[dst_len > 0],
        )
    )
    cuts.sort()
    new = cuts[1:] != cuts[:-1]
    if not new.all():
        cuts = cuts[np.concatenate(([True], new))]
    ln = np.diff(cuts, append=total)
    si = np.searchsorted(src_start, cuts, side="right") - 1
    di = np.searchsorted(dst_start, cuts, side="right") - 1
    so = src_addr[si] + (cuts - src_start[si])
    do = dst_addr[di] + (cuts - dst_start[di])
    if len(ln) > 1:
        joined = (so[1:] == so[:-1] + ln[:-1]) & (do[1:] == do[:-1] + ln[:-1])
        if joined.any():
            heads = np.flatnonzero(np.concatenate(([True], ~joined)))
            ln = np.add.reduceat(ln, heads)
            so, do = so[heads], do[heads]
    return so, do, ln


def entry_columns(runs: Sequence[tuple[int, int]], page: int, nbytes: int, row: int) -> np.ndarray:
    """An entry's page runs as a ``(3, k)`` int64 array in rows of ``row`` bytes: where each
    run starts, its length (the last one cut to the entry's size rounded up to a row), and
    where it starts within the entry. Runs never change, so callers keep this with the
    entry (:func:`plan_entries` takes it). ``nbytes`` > 0; the runs hold exactly the pages
    that size needs."""
    assert page % row == 0 and nbytes > 0, (page, row, nbytes)
    rows = page // row
    starts = [p * rows for p, _ in runs]
    lengths = [k * rows for _, k in runs]
    lengths[-1] -= sum(lengths) - -(-nbytes // row)  # less than a page: the last run stays
    at = list(itertools.accumulate(lengths[:-1], initial=0))
    return np.array((starts, lengths, at), dtype=np.int64)


def plan_entries(
    src: Sequence[np.ndarray],
    dst_runs: Sequence[Sequence[tuple[int, int]]],
    dst_page: int,
    row: int,
    rows: Sequence[int],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Row pieces ``(src, dst, length)`` copying several entries into page runs.

    ``src[i]`` is entry ``i``'s :func:`entry_columns` (rows of ``row`` bytes), ``rows[i]``
    its size in rows (rounded up) and ``dst_runs[i]`` its destination page runs (pages of
    ``dst_page`` bytes, a multiple of ``row``, enough to hold the entry). Entries with no
    bytes must be left out.

    When every entry's destination is one run (the usual case: the device pool keeps entries
    whole), each source run is one piece and the plan is a few array operations on the
    cached columns; otherwise both sides are merged (:func:`merge_arrays`).
    """
    assert dst_page % row == 0, (dst_page, row)
    page = dst_page // row  # rows per destination page
    if all(len(runs) == 1 for runs in dst_runs):
        if len(src) == 1:
            return src[0][0], src[0][2] + dst_runs[0][0][0] * page, src[0][1]
        cols = np.concatenate(src, axis=1)
        bases = np.repeat([runs[0][0] * page for runs in dst_runs], [c.shape[1] for c in src])
        return cols[0], cols[2] + bases, cols[1]
    d: list[tuple[int, int]] = []  # the destination runs, each entry's cut to its rows
    for left, runs in zip(rows, dst_runs, strict=True):
        for p, k in runs:
            take = min(k * page, left)
            d.append((p * page, take))
            left -= take
    if sum(c.shape[1] for c in src) + len(d) <= SMALL_PLAN:
        s = [run for c in src for run in zip(c[0].tolist(), c[1].tolist(), strict=True)]
        return _merge_lists(s, d)
    cols = src[0] if len(src) == 1 else np.concatenate(src, axis=1)
    dst = np.array(d, dtype=np.int64).reshape(-1, 2)
    return merge_arrays(cols[0], cols[1], dst[:, 0], dst[:, 1])


# Up to this many runs (both sides together), :func:`merge_runs` and :func:`plan_entries`
# merge in plain Python (:func:`_merge_lists`): the numpy merge's fixed cost (some ten
# calls) is more than the work on small plans, and it is paid before a get's copy can start
# (docs/device.md, "Engine API").
SMALL_PLAN = 128


def _merge_lists(src: ByteRuns, dst: ByteRuns) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`merge_arrays` of two short run lists, walked in Python (the same pieces)."""
    assert sum(n for _, n in src) == sum(n for _, n in dst), "both sides must hold as much"
    so: list[int] = []
    do: list[int] = []
    ln: list[int] = []
    i = j = s_used = d_used = 0
    while i < len(src) and j < len(dst):
        (s_at, s_len), (d_at, d_len) = src[i], dst[j]
        take = min(s_len - s_used, d_len - d_used)
        if take > 0:
            s, d = s_at + s_used, d_at + d_used
            if ln and so[-1] + ln[-1] == s and do[-1] + ln[-1] == d:
                ln[-1] += take  # contiguous on both sides: one piece
            else:
                so.append(s)
                do.append(d)
                ln.append(take)
            s_used += take
            d_used += take
        if s_used == s_len:
            i, s_used = i + 1, 0
        if d_used == d_len:
            j, d_used = j + 1, 0
    return (
        np.array(so, dtype=np.int64),
        np.array(do, dtype=np.int64),
        np.array(ln, dtype=np.int64),
    )


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
        """The plan of everything added: ``(src, dst, length)`` in rows of ``row`` bytes."""
        so, do, ln = merge_runs(self._src, self._dst)
        r = self.row
        assert not ((so | do | ln) % r).any(), f"a piece is not a whole number of {r}-byte rows"
        return so // r, do // r, ln // r
