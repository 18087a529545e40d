from __future__ import annotations

import itertools

import hypothesis.strategies as st
from hypothesis import given, settings

from embcache.service.host.allocator import PageRunAllocator


def covered(runs: list[tuple[int, int]]) -> set[int]:
    return {p for s, n in runs for p in range(s, s + n)}


def test_single_run_best_fit_and_coalesce() -> None:
    a = PageRunAllocator(100)
    r1 = a.allocate(10)
    r2 = a.allocate(20)
    r3 = a.allocate(30)
    assert (r1, r2, r3) == ([(0, 10)], [(10, 20)], [(30, 30)])
    a.free(r2)  # hole of 20 at 10; tail of 40 at 60
    assert a.allocate(15) == [(10, 15)]  # best fit: the 20-hole, not the 40-tail
    assert a.largest_free_run == 40
    a.free([(10, 15)])
    a.free(r1)
    a.free(r3)
    assert a.free_runs() == [(0, 100)] and a.num_free_pages == 100


def test_fewest_runs_when_fragmented() -> None:
    a = PageRunAllocator(40)
    blocks = [a.allocate(5) for _ in range(8)]
    for i in (0, 2, 4, 6):  # free holes of 5 pages at 0, 10, 20, 30
        a.free(blocks[i])
    assert a.allocate(6) is not None  # needs two runs
    runs = a.allocate(9)  # 14 free pages left in holes of 4, 5, 5
    assert runs is not None and len(runs) == 2
    assert sum(n for _, n in runs) == 9
    assert a.allocate(6) is None  # 5 left
    assert a.num_free_pages == 5


def test_zero_and_too_many() -> None:
    a = PageRunAllocator(8)
    assert a.allocate(0) == []
    assert a.allocate(9) is None
    assert a.num_free_pages == 8


def test_large_allocation_cost_is_per_run() -> None:
    a = PageRunAllocator(4_000_000)
    runs = a.allocate(3_000_000)
    assert runs == [(0, 3_000_000)]
    a.free(runs)
    assert a.num_free_runs == 1


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 40)), max_size=60))
def test_random_alloc_free_invariants(ops: list[tuple[bool, int]]) -> None:
    total = 128
    a = PageRunAllocator(total)
    live: list[list[tuple[int, int]]] = []
    for do_alloc, n in ops:
        if do_alloc or not live:
            fits_one = a.largest_free_run >= n
            runs = a.allocate(n)
            if runs is None:
                assert n > a.num_free_pages
                continue
            assert sum(length for _, length in runs) == n
            if fits_one:
                assert len(runs) == 1
            pages = covered(runs)
            for other in live:
                assert not pages & covered(other), "two live allocations share a page"
            live.append(runs)
        else:
            a.free(live.pop(n % len(live)))
        used = sum(length for runs in live for _, length in runs)
        assert a.num_free_pages == total - used
        free = a.free_runs()
        assert sum(n for _, n in free) == a.num_free_pages
        # free runs never touch each other (coalescing is complete)
        for (s1, n1), (s2, _) in itertools.pairwise(free):
            assert s1 + n1 < s2
    for runs in live:
        a.free(runs)
    assert a.free_runs() == [(0, total)]
