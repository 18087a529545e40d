"""The pinned page-id ring a client's gather reads directly (``clients/device/uva_ids.py``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu


def test_ring_gathers_what_an_uploaded_index_gathers() -> None:
    from embcache.clients.device import uva_ids

    ring = uva_ids.ring_for(torch.device("cuda", 0))
    assert ring is not None, "the ring failed its self-check on this GPU"
    rows = torch.randint(0, 1 << 40, (4096, 32), dtype=torch.int64, device="cuda")
    gen = np.random.default_rng(0)
    for _ in range(3 * uva_ids.SLOTS):  # every slot is reused twice
        ids = gen.permutation(4096)[: gen.integers(1, 512)].astype(np.int64)
        got = ring.put(ids)
        assert got is not None
        index, slot = got
        out = rows.index_select(0, index)
        ring.launched(slot, torch.cuda.current_stream())
        assert torch.equal(out, rows[torch.from_numpy(ids).cuda()])
    assert ring.put(np.zeros(uva_ids.CAPACITY + 1, dtype=np.int64)) is None  # too many: upload


def test_busy_slots_are_not_handed_out_twice() -> None:
    from embcache.clients.device import uva_ids

    ring = uva_ids.ring_for(torch.device("cuda", 0))
    assert ring is not None
    taken = [ring.put(np.arange(4, dtype=np.int64)) for _ in range(uva_ids.SLOTS)]
    assert all(t is not None for t in taken)
    assert len({t[1] for t in taken if t is not None}) == uva_ids.SLOTS
    assert ring.put(np.arange(4, dtype=np.int64)) is None  # all busy: the caller uploads
    for t in taken:
        assert t is not None
        ring.abandon(t[1])
    assert ring.put(np.arange(4, dtype=np.int64)) is not None


def test_fragmented_gather_through_the_ring_matches_the_pages() -> None:
    from embcache.clients.device.gathers import gather_pages

    page = 4096
    pool = torch.randint(0, 256, (256 * page,), dtype=torch.uint8, device="cuda")
    entries = [([7, 8, 9, 40, 41], 4 * page + 100), ([200], 12), ([3, 1], 2 * page)]
    for (ids, nbytes), flat in zip(entries, gather_pages(pool, page, entries), strict=True):
        want = torch.cat([pool[i * page : (i + 1) * page] for i in ids])[:nbytes]
        assert torch.equal(flat, want)
