from __future__ import annotations

import itertools

import hypothesis.strategies as st
import numpy as np
from hypothesis import given, settings

from embcache.service.device.copy_plan import (
    ByteRuns,
    PlanBuilder,
    merge_arrays,
    merge_runs,
    row_bytes_for,
    truncate_runs,
)


def pair_runs(src: ByteRuns, dst: ByteRuns, nbytes: int) -> tuple[list[int], list[int], list[int]]:
    """The spec of merge_runs, as a plain loop: pieces copying ``nbytes`` from src to dst."""
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


def test_row_bytes_for() -> None:
    assert row_bytes_for(4096, 8192) == 16
    assert row_bytes_for(4096, 74) == 2
    assert row_bytes_for(4096, 7) == 1
    assert row_bytes_for() == 16


def test_pair_runs_merges_boundaries() -> None:
    src = [(0, 100), (1000, 100)]
    dst = [(5000, 50), (6000, 150)]
    assert pair_runs(src, dst, 200) == ([0, 50, 1000], [5000, 6000, 6050], [50, 50, 100])
    # contiguous on both sides: one piece
    assert pair_runs([(0, 64), (64, 64)], [(128, 128)], 128) == ([0], [128], [128])
    assert truncate_runs([(0, 10), (20, 10)], 15) == [(0, 10), (20, 5)]


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.integers(1, 9), min_size=1, max_size=8),
    st.lists(st.integers(1, 9), min_size=1, max_size=8),
    st.data(),
)
def test_pair_runs_copies_every_byte_once(a: list[int], b: list[int], data) -> None:  # type: ignore[no-untyped-def]
    total = min(sum(a), sum(b))
    nbytes = data.draw(st.integers(0, total))

    def runs(lengths: list[int], gap: int) -> list[tuple[int, int]]:
        out, pos = [], 0
        for n in lengths:
            out.append((pos, n))
            pos += n + gap
        return out

    src, dst = runs(a, 3), runs(b, 5)
    so, do, ln = pair_runs(src, dst, nbytes)
    src_runs, dst_runs = truncate_runs(src, nbytes), truncate_runs(dst, nbytes)
    vs, vd, vn = merge_runs(src_runs, dst_runs)  # short lists: the walk in Python
    assert (vs.tolist(), vd.tolist(), vn.tolist()) == (so, do, ln)
    columns = [np.array(r, dtype=np.int64).reshape(-1, 2) for r in (src_runs, dst_runs)]
    vs, vd, vn = merge_arrays(
        columns[0][:, 0], columns[0][:, 1], columns[1][:, 0], columns[1][:, 1]
    )
    assert (vs.tolist(), vd.tolist(), vn.tolist()) == (so, do, ln)  # same pieces, vectorised
    assert sum(ln) == nbytes
    src_mem = np.arange(200, dtype=np.int64)
    dst_mem = np.full(200, -1, dtype=np.int64)
    for s, d, n in zip(so, do, ln, strict=True):
        dst_mem[d : d + n] = src_mem[s : s + n]
    want = np.concatenate([src_mem[o : o + n] for o, n in truncate_runs(src, nbytes)] or [[]])
    got = np.concatenate([dst_mem[o : o + n] for o, n in truncate_runs(dst, nbytes)] or [[]])
    assert np.array_equal(want, got)


def test_plan_builder_rows_and_padding() -> None:
    plan = PlanBuilder(16)
    plan.add([(0, 4096)], [(8192, 4096)], 100)  # padded to 112 bytes = 7 rows
    plan.add([(4096, 4096)], [(0, 4096)], 32)
    s, d, n = plan.rows()
    assert s.tolist() == [0, 256] and d.tolist() == [512, 0] and n.tolist() == [7, 2]
    assert plan.nbytes == 132 and len(plan) == 2
    joined = PlanBuilder(16)  # pieces contiguous on both sides become one range
    joined.add([(0, 4096), (4096, 4096)], [(8192, 8192)], 8192)
    assert [a.tolist() for a in joined.rows()] == [[0], [512], [512]]
    assert [a.tolist() for a in PlanBuilder(16).rows()] == [[], [], []]


def _entry_runs(draw: st.DrawFn, npages: int, base: int) -> list[tuple[int, int]]:
    """``npages`` pages from ``base`` on, cut into runs with gaps between them."""
    runs, at, left = [], base, npages
    while left:
        k = draw(st.integers(1, left))
        runs.append((at, k))
        at += k + draw(st.integers(0, 2))
        left -= k
    return runs


@st.composite
def entry_plans(draw: st.DrawFn):  # type: ignore[no-untyped-def]
    src_page, dst_page = draw(st.sampled_from([(64, 64), (64, 256), (256, 64), (128, 128)]))
    src, dst, sizes = [], [], []
    s_base = d_base = 0
    for _ in range(draw(st.integers(1, 6))):
        size = 16 * draw(st.integers(1, 80))
        sp, dp = -(-size // src_page), -(-size // dst_page)
        src.append(_entry_runs(draw, sp, s_base))
        dst.append(_entry_runs(draw, dp, d_base))
        s_base = src[-1][-1][0] + src[-1][-1][1] + draw(st.integers(0, 1))
        d_base = dst[-1][-1][0] + dst[-1][-1][1] + draw(st.integers(0, 1))
        sizes.append(size)
    return src, src_page, dst, dst_page, sizes


@settings(max_examples=300, deadline=None)
@given(entry_plans(), st.booleans())
def test_plan_entries_copies_every_entry(plan, whole) -> None:  # type: ignore[no-untyped-def]
    """The plan (fast path when every destination is one run, else the merge) moves exactly
    each entry's padded bytes, writes nowhere else, and has no overlapping destinations."""
    from embcache.service.device.copy_plan import entry_columns, plan_entries

    src, src_page, dst, dst_page, sizes = plan
    if whole:  # one destination run per entry, as the device pool deals them
        dst, at = [], 0
        for n in sizes:
            pages = -(-n // dst_page)
            dst.append([(at + 1, pages)])
            at += pages + 2
    row = 16
    cols = [entry_columns(r, src_page, n, row) for r, n in zip(src, sizes, strict=True)]
    rows = [-(-n // row) for n in sizes]
    so, do, ln = (a.tolist() for a in plan_entries(cols, dst, dst_page, row, rows))
    if whole:
        assert len(ln) == sum(len(r) for r in src)  # one piece per source run
    src_mem = np.arange(4096 * 64, dtype=np.int64)
    dst_mem = np.full(4096 * 64, -1, dtype=np.int64)
    spans = sorted((d, d + n) for d, n in zip(do, ln, strict=True))
    assert all(e0 <= s1 for (_, e0), (s1, _) in itertools.pairwise(spans))
    for s, d, n in zip(so, do, ln, strict=True):
        dst_mem[d * row : (d + n) * row] = src_mem[s * row : (s + n) * row]
    written = 0
    for s_runs, d_runs, n in zip(src, dst, sizes, strict=True):
        a = truncate_runs([(p * src_page, k * src_page) for p, k in s_runs], n)
        b = truncate_runs([(p * dst_page, k * dst_page) for p, k in d_runs], n)
        want = np.concatenate([src_mem[o : o + k] for o, k in a])
        got = np.concatenate([dst_mem[o : o + k] for o, k in b])
        assert np.array_equal(want, got)
        written += n
    assert int((dst_mem >= 0).sum()) == written == sum(ln) * row
    # the reference's pieces, once pieces contiguous on both sides are joined (the fast path
    # does not join them: it keeps one piece per source run)
    a = [r for runs, n in zip(src, sizes, strict=True)
         for r in truncate_runs([(p * src_page, k * src_page) for p, k in runs], n)]  # fmt: skip
    b = [r for runs, n in zip(dst, sizes, strict=True)
         for r in truncate_runs([(p * dst_page, k * dst_page) for p, k in runs], n)]  # fmt: skip
    ref = pair_runs(a, b, sum(sizes))
    joined: list[list[int]] = [[], [], []]
    for s, d, n in zip(so, do, ln, strict=True):
        if joined[0] and joined[0][-1] + joined[2][-1] == s and joined[1][-1] + joined[2][-1] == d:
            joined[2][-1] += n
        else:
            for col, v in zip(joined, (s, d, n), strict=True):
                col.append(v)
    assert [[x // row for x in v] for v in ref] == joined


@settings(max_examples=300, deadline=None)
@given(entry_plans())
def test_small_plans_merge_in_python_to_the_same_pieces(plan) -> None:  # type: ignore[no-untyped-def]
    """The plain-Python merge of small plans gives exactly the numpy merge's pieces."""
    from embcache.service.device import copy_plan
    from embcache.service.device.copy_plan import entry_columns, plan_entries

    src, src_page, dst, dst_page, sizes = plan
    cols = [entry_columns(r, src_page, n, 16) for r, n in zip(src, sizes, strict=True)]
    rows = [-(-n // 16) for n in sizes]
    small = plan_entries(cols, dst, dst_page, 16, rows)
    saved, copy_plan.SMALL_PLAN = copy_plan.SMALL_PLAN, -1  # force the numpy merge
    try:
        merged = plan_entries(cols, dst, dst_page, 16, rows)
    finally:
        copy_plan.SMALL_PLAN = saved
    if not all(len(r) == 1 for r in dst):  # else both took the one-run fast path
        assert [a.tolist() for a in small] == [a.tolist() for a in merged]
