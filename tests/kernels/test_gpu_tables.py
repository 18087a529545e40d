"""GPU tests of the page-table and read-table kernels: references, graphs, empty inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from embcache.kernels import (
    alloc_bind_inplace,
    alloc_bind_inplace_reference,
    bind_inplace,
    bind_inplace_reference,
    build_read_table,
    build_read_table_reference,
    free_unbind_inplace,
    free_unbind_inplace_reference,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

NUM_VPAGES, NUM_PAGES = 5000, 4000


def _empty_tables() -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.full((NUM_VPAGES,), -1, dtype=torch.int64),
        torch.full((NUM_PAGES,), -1, dtype=torch.int64),
    )


def _free(table: torch.Tensor, n: int, rng: np.random.Generator) -> torch.Tensor:
    free = torch.nonzero(table < 0).flatten().numpy()
    return torch.from_numpy(rng.choice(free, min(n, len(free)), replace=False))


def _bound(table: torch.Tensor, n: int, rng: np.random.Generator) -> torch.Tensor:
    bound = torch.nonzero(table >= 0).flatten().numpy()
    return torch.from_numpy(rng.choice(bound, min(n, len(bound)), replace=False))


def test_random_bindings_match_reference() -> None:
    """A random sequence of allocs, binds and frees on the GPU and on CPU references."""
    rng = np.random.default_rng(0)
    ref_v2p, ref_p2v = _empty_tables()
    v2p, p2v = ref_v2p.cuda(), ref_p2v.cuda()
    for step in range(60):
        op = rng.integers(0, 3)
        n = int(rng.integers(0, 300))
        if op == 0:
            free_pages = torch.nonzero(ref_p2v < 0).flatten()
            # a consecutive free run of pages (any, via the first free page and its run)
            first = int(free_pages[0]) if len(free_pages) else 0
            run = 0
            while first + run < NUM_PAGES and ref_p2v[first + run] < 0 and run < n:
                run += 1
            vpages = _free(ref_v2p, run, rng)
            first_arg = torch.tensor([first], device="cuda") if step % 2 else first
            alloc_bind_inplace_reference(vpages, first, ref_v2p, ref_p2v)
            alloc_bind_inplace(vpages.cuda(), first_arg, v2p, p2v)
        elif op == 1:
            vpages = _free(ref_v2p, n, rng)
            pages = _free(ref_p2v, len(vpages), rng)
            vpages = vpages[: len(pages)]
            bind_inplace_reference(vpages, pages, ref_v2p, ref_p2v)
            bind_inplace(vpages.cuda(), pages.cuda(), v2p, p2v)
        else:
            vpages = torch.cat([_bound(ref_v2p, n, rng), _free(ref_v2p, 3, rng)])
            expected = free_unbind_inplace_reference(vpages, ref_v2p, ref_p2v)
            got = free_unbind_inplace(vpages.cuda(), v2p, p2v)
            assert torch.equal(got.cpu(), expected)
        assert torch.equal(v2p.cpu(), ref_v2p) and torch.equal(p2v.cpu(), ref_p2v), step


def test_empty_inputs() -> None:
    v2p, p2v = (t.cuda() for t in _empty_tables())
    none = torch.empty(0, dtype=torch.int64, device="cuda")
    alloc_bind_inplace(none, 0, v2p, p2v)
    bind_inplace(none, none, v2p, p2v)
    assert free_unbind_inplace(none, v2p, p2v).numel() == 0
    out = torch.full((0, 4), -3, dtype=torch.int64, device="cuda")
    build_read_table(torch.zeros(2, 4, dtype=torch.int64, device="cuda"), none, none, v2p, out, 4)
    torch.cuda.synchronize()
    assert bool((v2p == -1).all()) and bool((p2v == -1).all())


def _warm(fn) -> None:
    """Run once on a side stream (compiles the kernel before capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


def _capture(fn, *, warm: bool = True) -> torch.cuda.CUDAGraph:
    if warm:
        _warm(fn)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def test_page_table_ops_replay_in_a_cuda_graph() -> None:
    rng = np.random.default_rng(1)
    n = 64
    v2p, p2v = (t.cuda() for t in _empty_tables())
    vpages = torch.zeros(n, dtype=torch.int64, device="cuda")
    pages = torch.zeros(n, dtype=torch.int64, device="cuda")
    first = torch.zeros(1, dtype=torch.int64, device="cuda")
    freed = torch.zeros(n, dtype=torch.int64, device="cuda")
    # Warm-up calls write into scratch tables so the captured state starts clean.
    scratch_v, scratch_p = (t.cuda() for t in _empty_tables())
    targets = {"v": scratch_v, "p": scratch_p}

    def alloc() -> None:
        alloc_bind_inplace(vpages, first, targets["v"], targets["p"])

    def bind() -> None:
        bind_inplace(vpages, pages, targets["v"], targets["p"])

    def free() -> None:
        free_unbind_inplace(vpages, targets["v"], targets["p"], out=freed)

    graphs = {}
    for name, fn in (("alloc", alloc), ("bind", bind), ("free", free)):
        targets["v"], targets["p"] = scratch_v, scratch_p
        _warm(fn)
        targets["v"], targets["p"] = v2p, p2v
        graphs[name] = _capture(fn, warm=False)
    ref_v, ref_p = _empty_tables()
    for _ in range(5):
        vp = _free(ref_v, n, rng)
        base = int(torch.nonzero(ref_p < 0).flatten()[0])
        if base + n > NUM_PAGES or bool((ref_p[base : base + n] >= 0).any()):
            break
        vpages.copy_(vp)
        first.fill_(base)
        graphs["alloc"].replay()
        alloc_bind_inplace_reference(vp, base, ref_v, ref_p)
        vp2, pg2 = _free(ref_v, n, rng), _free(ref_p, n, rng)
        vpages.copy_(vp2)
        pages.copy_(pg2)
        graphs["bind"].replay()
        bind_inplace_reference(vp2, pg2, ref_v, ref_p)
        vpages.copy_(vp)
        graphs["free"].replay()
        expected = free_unbind_inplace_reference(vp, ref_v, ref_p)
        torch.cuda.synchronize()
        assert torch.equal(freed.cpu(), expected)
        assert torch.equal(v2p.cpu(), ref_v) and torch.equal(p2v.cpu(), ref_p)


@pytest.mark.parametrize("out_dtype", [torch.int64, torch.int32])
def test_read_table_random_and_graph_replay(out_dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(2)
    bs, max_pages, page_size = 48, 600, 256 * 1024
    v2p = torch.randint(-1, NUM_PAGES, (NUM_VPAGES,), generator=g)
    vpage_table = torch.randint(-1, NUM_VPAGES + 10, (100, max_pages), generator=g)
    rows = torch.randint(0, 100, (bs,), generator=g)
    lengths = torch.zeros(bs, dtype=torch.int64)
    out = torch.full((bs, max_pages), -7, dtype=out_dtype)
    d = {k: v.cuda() for k, v in dict(vt=vpage_table, r=rows, n=lengths, v=v2p, o=out).items()}

    def run() -> None:
        build_read_table(d["vt"], d["r"], d["n"], d["v"], d["o"], page_size, block_cols=64)

    graph = _capture(run)
    expected = out.clone()
    for trial in range(4):
        # lengths change on the device between replays: 0 pages .. more than the table holds
        new_lengths = torch.randint(0, (max_pages + 50) * page_size, (bs,), generator=g)
        new_lengths[trial] = 0
        new_rows = torch.randint(0, 100, (bs,), generator=g)
        d["n"].copy_(new_lengths)
        d["r"].copy_(new_rows)
        graph.replay()
        build_read_table_reference(vpage_table, new_rows, new_lengths, v2p, expected, page_size)
        torch.cuda.synchronize()
        assert torch.equal(d["o"].cpu(), expected), trial
