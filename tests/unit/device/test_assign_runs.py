"""``assign_runs``: a batch's physical page runs dealt out to its entries."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from embcache.service.device.assign_runs import assign_runs


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(1, 6), min_size=1, max_size=8),
    st.lists(st.integers(0, 8), min_size=1, max_size=10),
)
def test_deal_runs_partitions_the_pages(hole_sizes: list[int], entry_sizes: list[int]) -> None:
    total = sum(entry_sizes)
    runs, start = [], 0
    for k in hole_sizes * (total // max(1, sum(hole_sizes)) + 1):
        runs.append((start, k))
        start += k + 1  # a used page between holes
    taken, left = [], total
    for s0, k in runs:  # the allocator's answer: runs covering exactly ``total`` pages
        if left:
            taken.append((s0, min(k, left)))
            left -= min(k, left)
    dealt = assign_runs(taken, entry_sizes)
    pages = [p for mine in dealt for s0, k in mine for p in range(s0, s0 + k)]
    assert sorted(pages) == [p for s0, k in taken for p in range(s0, s0 + k)]
    assert [sum(k for _, k in mine) for mine in dealt] == entry_sizes
    largest = max((k for _, k in taken), default=0)
    fitting = [i for i, n in enumerate(entry_sizes) if 0 < n <= largest]
    if fitting:  # the largest of them is dealt first: it gets a whole run
        first = max(fitting, key=lambda i: (entry_sizes[i], -i))
        assert len(dealt[first]) == 1


def test_deal_runs_cuts_oversized_entries_last() -> None:
    """8-page holes: the 16-page entries (cut anyway) leave whole holes to the small ones."""
    holes = [(i * 9, 8) for i in range(14)] + [(14 * 9, 6)]
    small = assign_runs(holes, [16] * 6 + [3, 3, 3, 3, 5, 5])[6:]
    assert all(len(mine) == 1 for mine in small), small
