"""``materialize``: a pool view for contiguous entries, else a gathered copy the caller owns."""

from __future__ import annotations

import pytest
import torch

from embcache.clients.device import materialize

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
