"""CPU tests of the page-table ops: Triton kernels (interpreter) and dispatch vs references."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from embcache.kernels import (
    alloc_bind_inplace,
    alloc_bind_inplace_reference,
    bind_inplace,
    bind_inplace_reference,
    free_unbind_inplace,
    free_unbind_inplace_reference,
)

NUM_VPAGES, NUM_PAGES = 300, 200


def _tables(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Half-bound tables: a random injection of vpages into pages, tombstones elsewhere."""
    rng = np.random.default_rng(seed)
    v2p = torch.full((NUM_VPAGES,), -1, dtype=torch.int64)
    p2v = torch.full((NUM_PAGES,), -1, dtype=torch.int64)
    vp = torch.from_numpy(rng.choice(NUM_VPAGES, 100, replace=False))
    pg = torch.from_numpy(rng.choice(NUM_PAGES, 100, replace=False))
    v2p[vp], p2v[pg] = pg, vp
    return v2p, p2v


def _free_ids(table: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    free = torch.nonzero(table < 0).flatten().numpy()
    return torch.from_numpy(np.random.default_rng(seed).choice(free, n, replace=False))


@pytest.fixture(params=["kernel", "reference"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "kernel":
        request.getfixturevalue("interpret")
    else:
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    return request.param


@pytest.mark.parametrize("n", [0, 1, 37])
@pytest.mark.parametrize("first_as_tensor", [False, True])
def test_alloc_bind(mode: str, n: int, first_as_tensor: bool) -> None:
    v2p, p2v = _tables(n)
    free_pages = torch.nonzero(p2v < 0).flatten()
    first = 150 if n <= 37 and bool((p2v[150 : 150 + n] < 0).all()) else int(free_pages[0])
    vpages = _free_ids(v2p, n, 1)
    ev, ep = v2p.clone(), p2v.clone()
    alloc_bind_inplace_reference(vpages, first, ev, ep)
    arg = torch.tensor([first]) if first_as_tensor else first
    alloc_bind_inplace(vpages, arg, v2p, p2v)
    assert torch.equal(v2p, ev) and torch.equal(p2v, ep)


@pytest.mark.parametrize("n", [0, 1, 60])
def test_bind(mode: str, n: int) -> None:
    v2p, p2v = _tables(n + 10)
    vpages, pages = _free_ids(v2p, n, 2), _free_ids(p2v, n, 3)
    ev, ep = v2p.clone(), p2v.clone()
    bind_inplace_reference(vpages, pages, ev, ep)
    bind_inplace(vpages, pages, v2p, p2v)
    assert torch.equal(v2p, ev) and torch.equal(p2v, ep)


@pytest.mark.parametrize("n", [0, 1, 120])
def test_free_unbind(mode: str, n: int) -> None:
    v2p, p2v = _tables(n + 20)
    vpages = torch.from_numpy(np.random.default_rng(n).choice(NUM_VPAGES, n, replace=False))
    ev, ep = v2p.clone(), p2v.clone()
    expected = free_unbind_inplace_reference(vpages, ev, ep)
    out = torch.full((n,), -7, dtype=torch.int64)
    got = free_unbind_inplace(vpages, v2p, p2v, out=out)
    assert got is out
    assert torch.equal(got, expected) and torch.equal(v2p, ev) and torch.equal(p2v, ep)
    assert torch.equal(free_unbind_inplace(vpages, v2p, p2v), torch.full((n,), -1))


def test_round_trip_restores_tombstones(mode: str) -> None:
    v2p = torch.full((50,), -1, dtype=torch.int64)
    p2v = torch.full((40,), -1, dtype=torch.int64)
    vpages = torch.tensor([4, 9, 2, 33])
    alloc_bind_inplace(vpages, 10, v2p, p2v)
    assert v2p[vpages].tolist() == [10, 11, 12, 13]
    assert torch.equal(free_unbind_inplace(vpages, v2p, p2v), torch.arange(10, 14))
    assert bool((v2p == -1).all()) and bool((p2v == -1).all())


@pytest.mark.parametrize(
    ("call", "arg"),
    [
        (lambda v, p: alloc_bind_inplace(torch.tensor([1, 2]), 199, v, p), "first_page"),
        (lambda v, p: alloc_bind_inplace(torch.tensor([1, 2]), -1, v, p), "first_page"),
        (lambda v, p: alloc_bind_inplace(torch.tensor([1, 2]), 1.0, v, p), "first_page"),
        (lambda v, p: alloc_bind_inplace(torch.tensor([1, 2]), torch.tensor([1.0]), v, p),
         "first_page"),
        (lambda v, p: alloc_bind_inplace(torch.tensor([1, 300]), 0, v, p), "vpages"),
        (lambda v, p: alloc_bind_inplace(torch.tensor([1, 1]), 0, v, p), "vpages"),
        (lambda v, p: alloc_bind_inplace(torch.tensor([1, 2], dtype=torch.int32), 0, v, p),
         "vpages"),
        (lambda v, p: alloc_bind_inplace(torch.tensor([1]), 0, v.int(), p), "v2p"),
        (lambda v, p: alloc_bind_inplace(torch.tensor([1]), 0, v, p[::2]), "p2v"),
        (lambda v, p: bind_inplace(torch.tensor([1, 2]), torch.tensor([5]), v, p), "pages"),
        (lambda v, p: bind_inplace(torch.tensor([1]), torch.tensor([200]), v, p), "pages"),
        (lambda v, p: bind_inplace(torch.tensor([-1]), torch.tensor([2]), v, p), "vpages"),
        (lambda v, p: free_unbind_inplace(torch.tensor([[1]]), v, p), "vpages"),
        (lambda v, p: free_unbind_inplace(torch.tensor([1]), v, p,
                                          out=torch.empty(2, dtype=torch.int64)), "out"),
    ],
)  # fmt: skip
def test_validation(call, arg: str) -> None:
    v2p, p2v = _tables(0)
    before = v2p.clone(), p2v.clone()
    with pytest.raises(ValueError, match=f"^{arg}:"):
        call(v2p, p2v)
    assert torch.equal(v2p, before[0]) and torch.equal(p2v, before[1])
