"""``materialize``: a pool view for contiguous entries, else a gathered copy the caller owns."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from embcache.clients.device.gathers import materialize

PAGE = 64


def pool() -> torch.Tensor:
    return torch.arange(16 * PAGE, dtype=torch.int32).to(torch.uint8)


def test_offset_gives_a_view() -> None:
    p = pool()
    t = materialize(p, page_bytes=PAGE, page_ids=[], offset=PAGE, nbytes=40,
                    dtype=torch.float16, shape=(4, 5))  # fmt: skip
    assert t.data_ptr() == p.data_ptr() + PAGE
    assert torch.equal(t.view(-1).view(torch.uint8), p[PAGE : PAGE + 40])


@pytest.mark.parametrize("page_ids", [[3], [3, 4, 5], [7, 2, 3, 11], [9, 8]])
def test_pages_are_gathered_in_order(page_ids: list[int]) -> None:
    p = pool()
    nbytes = len(page_ids) * PAGE - 6
    t = materialize(p, page_bytes=PAGE, page_ids=page_ids, offset=None, nbytes=nbytes,
                    dtype=torch.uint8, shape=(nbytes,))  # fmt: skip
    want = torch.cat([p[i * PAGE : (i + 1) * PAGE] for i in page_ids])[:nbytes]
    assert torch.equal(t, want)
    p.zero_()  # the copy is the caller's: the pool may be reused under it
    assert torch.equal(t, want)


def test_a_batch_is_gathered_in_one_buffer_with_aligned_regions() -> None:
    from embcache.clients.device.gathers import gather_pages

    p = pool()
    entries = [([7, 2, 3], 2 * PAGE + 5), ([], 0), ([9, 10], PAGE + 1), ([4], 12)]
    flats = gather_pages(p, PAGE, entries)
    for (ids, nbytes), flat in zip(entries, flats, strict=True):
        want = torch.cat([p[i * PAGE : (i + 1) * PAGE] for i in ids] or [p[:0]])[:nbytes]
        assert torch.equal(flat, want)
        assert flat.data_ptr() % 16 == flats[0].data_ptr() % 16  # 16-byte aligned regions
    base = flats[0].untyped_storage().data_ptr()
    assert all(f.untyped_storage().data_ptr() == base for f in flats)  # one allocation
    assert flats[3].view(torch.int32).numel() == 3  # any dtype can view a region
    assert gather_pages(p, PAGE, [([], 0)])[0].numel() == 0


@given(
    st.lists(
        st.tuples(st.lists(st.integers(0, 15), max_size=5, unique=True), st.integers(0, PAGE)),
        max_size=6,
    )
)
@settings(max_examples=200, deadline=None)
def test_gather_matches_a_page_by_page_copy(raw: list[tuple[list[int], int]]) -> None:
    from embcache.clients.device.gathers import gather_pages

    p = pool()
    # nbytes: anything the pages hold, down to one byte less than all but the last page
    entries = [(ids, max(0, len(ids) * PAGE - extra)) for ids, extra in raw if ids or not extra]
    entries = [(ids, n if n > (len(ids) - 1) * PAGE else len(ids) * PAGE) for ids, n in entries]
    flats = gather_pages(p, PAGE, entries)
    for (ids, nbytes), flat in zip(entries, flats, strict=True):
        want = torch.cat([p[i * PAGE : (i + 1) * PAGE] for i in ids] or [p[:0]])[:nbytes]
        assert torch.equal(flat, want)


def test_gather_refuses_pages_that_cannot_hold_the_bytes() -> None:
    from embcache.clients.device.gathers import gather_pages

    with pytest.raises(ValueError, match="pages"):
        gather_pages(pool(), PAGE, [([1], PAGE + 1)])


@pytest.mark.parametrize("ids", [[16], [-1], [3, 99]])
def test_gather_refuses_pages_outside_the_pool(ids: list[int]) -> None:
    from embcache.clients.device.gathers import gather_pages

    with pytest.raises(ValueError, match="ids must lie in"):  # checked before any launch
        gather_pages(pool(), PAGE, [(ids, PAGE)])
