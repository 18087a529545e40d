"""Benchmark of the page-table and read-table kernels against their torch references.

Run on a GPU machine: ``python bench/page_table.py`` (prints a table, writes
``bench/results/page_table_<gpu>.json``). GPU time per call comes from CUDA-graph replays of
``--calls`` calls on disjoint ids (tables restored between replays); host time per call is the
eager launch cost.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _common import environment, print_environment, save_json, table

from embcache.kernels import (
    alloc_bind_inplace,
    bind_inplace,
    build_read_table,
    free_unbind_inplace,
)


def ref_alloc_bind(vpages, first: int, v2p, p2v) -> None:
    pages = torch.arange(first, first + vpages.numel(), device=vpages.device)
    v2p[vpages] = pages
    p2v[pages] = vpages


def ref_bind(vpages, pages, v2p, p2v) -> None:
    v2p[vpages] = pages
    p2v[pages] = vpages


def ref_free_unbind(vpages, v2p, p2v):
    """The 3-op torch version (gather + 2 index_fill_; every page bound, so no mask)."""
    pages = v2p[vpages]
    v2p.index_fill_(0, vpages, -1)
    p2v.index_fill_(0, pages, -1)
    return pages


def ref_read_table(vpage_table, rows, lengths, v2p, out, page_size: int) -> None:
    """Vectorised torch: gather every column, keep those under each length."""
    vp = vpage_table[rows]
    pages = v2p[vp.clamp(min=0)]
    n = (lengths + page_size - 1) // page_size
    cols = torch.arange(out.shape[1], device=out.device)
    torch.where(cols[None, :] < n[:, None], pages, out, out=out)


def graph_us(calls: list[Callable[[], object]], restore: Callable[[], None], reps: int) -> float:
    """GPU microseconds per call: one graph holds every call; median over replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in calls[:2]:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    restore()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    times = []
    for _ in range(reps):
        restore()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / len(calls))
    return statistics.median(times)


def host_us(fn: Callable[[], object], restore: Callable[[], None], reps: int = 50) -> float:
    times = []
    for _ in range(reps):
        restore()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def bench_tables(n: int, calls: int, reps: int) -> list[dict[str, Any]]:
    """Each op on ``calls`` disjoint sets of ``n`` ids, fused kernel vs torch reference."""
    total = n * calls
    dev = "cuda"
    perm_v = torch.randperm(total, device=dev)
    perm_p = torch.randperm(total, device=dev)
    vsets = [perm_v[i * n : (i + 1) * n] for i in range(calls)]
    psets = [perm_p[i * n : (i + 1) * n] for i in range(calls)]
    empty_v = torch.full((total,), -1, dtype=torch.int64, device=dev)
    empty_p = torch.full((total,), -1, dtype=torch.int64, device=dev)
    bound_v, bound_p = empty_v.clone(), empty_p.clone()
    bound_v[perm_v], bound_p[perm_p] = perm_p, perm_v
    v2p, p2v = empty_v.clone(), empty_p.clone()
    outs = [torch.empty(n, dtype=torch.int64, device=dev) for _ in range(calls)]

    def restore_from(a: torch.Tensor, b: torch.Tensor) -> Callable[[], None]:
        return lambda: (v2p.copy_(a), p2v.copy_(b))

    cases = {
        "alloc_bind": (
            restore_from(empty_v, empty_p),
            [lambda i=i: alloc_bind_inplace(vsets[i], i * n, v2p, p2v) for i in range(calls)],
            [lambda i=i: ref_alloc_bind(vsets[i], i * n, v2p, p2v) for i in range(calls)],
        ),
        "bind": (
            restore_from(empty_v, empty_p),
            [lambda i=i: bind_inplace(vsets[i], psets[i], v2p, p2v) for i in range(calls)],
            [lambda i=i: ref_bind(vsets[i], psets[i], v2p, p2v) for i in range(calls)],
        ),
        "free_unbind": (
            restore_from(bound_v, bound_p),
            [
                lambda i=i: free_unbind_inplace(vsets[i], v2p, p2v, out=outs[i])
                for i in range(calls)
            ],
            [lambda i=i: ref_free_unbind(vsets[i], v2p, p2v) for i in range(calls)],
        ),
    }
    results = []
    for op, (restore, fused, ref) in cases.items():
        entry = {
            "op": op,
            "n": n,
            "fused_gpu_us": graph_us(fused, restore, reps),
            "reference_gpu_us": graph_us(ref, restore, reps),
            "fused_host_us": host_us(fused[0], restore),
            "reference_host_us": host_us(ref[0], restore),
        }
        entry["speedup_gpu"] = entry["reference_gpu_us"] / entry["fused_gpu_us"]
        # the fused tables must equal the reference's
        restore()
        for fn in fused:
            fn()
        got = v2p.clone(), p2v.clone()
        restore()
        for fn in ref:
            fn()
        entry["identical_tables"] = bool(torch.equal(got[0], v2p) and torch.equal(got[1], p2v))
        results.append(entry)
    return results


def bench_read_table(bs: int, max_pages: int, reps: int) -> dict[str, Any]:
    dev = "cuda"
    page_size = 256 * 1024
    num_vpages = 1 << 20
    v2p = torch.randint(0, num_vpages, (num_vpages,), device=dev)
    vpage_table = torch.randint(0, num_vpages, (4 * bs, max_pages), device=dev)
    rows = torch.randperm(4 * bs, device=dev)[:bs]
    lengths = torch.randint(1, 8 * page_size, (bs,), device=dev)  # short entries: <= 8 pages
    out = torch.full((bs, max_pages), -1, dtype=torch.int64, device=dev)
    expected = out.clone()
    build_read_table(vpage_table, rows, lengths, v2p, out, page_size)
    ref_read_table(vpage_table, rows, lengths, v2p, expected, page_size)
    torch.cuda.synchronize()
    entry = {
        "op": "build_read_table",
        "n": f"{bs}x{max_pages}",
        "fused_gpu_us": graph_us(
            [lambda: build_read_table(vpage_table, rows, lengths, v2p, out, page_size)] * 20,
            lambda: None,
            reps,
        ),
        "reference_gpu_us": graph_us(
            [lambda: ref_read_table(vpage_table, rows, lengths, v2p, out, page_size)] * 20,
            lambda: None,
            reps,
        ),
        "fused_host_us": host_us(
            lambda: build_read_table(vpage_table, rows, lengths, v2p, out, page_size), lambda: None
        ),
        "reference_host_us": host_us(
            lambda: ref_read_table(vpage_table, rows, lengths, v2p, out, page_size), lambda: None
        ),
        "identical_tables": bool(torch.equal(out, expected)),
    }
    entry["speedup_gpu"] = entry["reference_gpu_us"] / entry["fused_gpu_us"]
    return entry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 1024, 65536])
    parser.add_argument("--calls", type=int, default=20, help="calls per graph")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out-dir", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/page_table.py needs a CUDA GPU")
    env = environment()
    print_environment(env)
    entries: list[dict[str, Any]] = []
    for n in args.sizes:
        entries += bench_tables(n, args.calls, args.reps)
    entries.append(bench_read_table(64, 512, args.reps))
    headers = ["op", "n", "fused us", "torch us", "speedup", "fused host us", "torch host us"]
    rows = [
        [e["op"], e["n"], e["fused_gpu_us"], e["reference_gpu_us"], f"{e['speedup_gpu']:.2f}x",
         e["fused_host_us"], e["reference_host_us"]]
        for e in entries
    ]  # fmt: skip
    print("\nPage-table kernels vs torch references (GPU us/call from graph replay)")
    print(table(headers, rows), flush=True)
    bad = [e["op"] for e in entries if not e["identical_tables"]]
    print("tables identical to the references" if not bad else f"MISMATCH: {bad}")
    save_json("page_table", {"env": env, "results": entries}, args.out_dir)


if __name__ == "__main__":
    main()
