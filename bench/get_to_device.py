"""get_to_device / put_from_device on a GPU, next to the contiguous copy engine (same run).

A batch of 16 x 4 MiB entries stored in 256 KiB host pages, fragmented (every page of an
entry is its own run). Prints GB/s of cold get_to_device per backend, the resident-hit
latency, put_from_device GB/s (one call per tensor, and a batch with
put_from_device_many), and how much a concurrent 8192^3 bf16 GEMM slows down while
cold batches stream in: in a process of its own (as a decoder's) and in this one. Also what
a client's owned copy costs (the default of ``get(..., device=)``): the device-to-device
gather of 16 x 4 MiB resident entries out of the pool into new memory, next to zero-copy
views of them. JSON goes to bench/results/get_to_device.json (or --out-dir).

    python bench/get_to_device.py [--reps 20]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import environment, print_environment

from embcache.service.config import Settings
from embcache.service.device import loads as device_loads
from embcache.service.engine import CacheEngine

MiB = 1 << 20
PAGE = 256 * 1024
ENTRY = 4 * MiB
BATCH = 16


def make_engine(backend: str) -> CacheEngine:
    s = Settings(
        host_pool_bytes=1024 * MiB,
        page_bytes=PAGE,
        device_pool_bytes=512 * MiB,
        device_page_bytes=PAGE,
        shm_name=f"embcache-bench-{uuid.uuid4().hex[:8]}",
        device="cuda",
        copy_backend=backend,
        max_entry_bytes=64 * MiB,
    )
    return CacheEngine(s)


def fill_fragmented(e: CacheEngine, entry: int = ENTRY) -> list[str]:
    """Fill the pool with one-page fillers, free every other one, then put the batch."""
    n = e.host_pool.num_pages
    one = torch.zeros(PAGE, dtype=torch.uint8)
    for i in range(n):
        e.put(f"filler-{i}", one)
    e.evict([f"filler-{i}" for i in range(0, 2 * BATCH * entry // PAGE, 2)])
    keys = []
    for i in range(BATCH):
        g = torch.Generator().manual_seed(i)
        e.put(f"entry-{i}", torch.randn(entry // 2, generator=g).to(torch.bfloat16))
        keys.append(f"entry-{i}")
    info = e.entry_info(keys[0])
    assert info is not None and len(info.page_runs) == entry // PAGE, "batch is not fragmented"
    return keys


def cold_get(e: CacheEngine, keys: list[str]) -> float:
    """Seconds for one cold batch (device copies evicted first)."""
    pool = e.device_tier.pool(0)
    pool.evict_unleased()
    if pool.stream is not None:
        pool.stream.synchronize()  # not the whole device: a GEMM may be running beside us
    t0 = time.perf_counter()
    results, _ = e.device.get(keys, "bench")
    dt = time.perf_counter() - t0
    assert all(r is not None and not r.resident_hit for r in results)
    e.release(r.lease.lease_id for r in results if r is not None)
    return dt


def contiguous_baseline(reps: int) -> dict[str, float]:
    nbytes = BATCH * ENTRY
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = {}
    for name, fn in (
        ("h2d", lambda: dev.copy_(host, non_blocking=True)),
        ("d2h", lambda: host.copy_(dev, non_blocking=True)),
    ):
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        out[name] = nbytes / statistics.median(times) / 1e9
    return out


def put_from_device_rates(e: CacheEngine, reps: int) -> dict[str, dict[str, float]]:
    """GB/s of put_from_device per entry size, next to one contiguous D2H copy per call."""
    out = {}
    for size in (4 * MiB, 32 * MiB):
        count = max(2, 64 * MiB // size)
        srcs = [torch.randn(size // 2, device="cuda").to(torch.bfloat16) for _ in range(count)]
        host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        torch.cuda.synchronize()
        base, ours, base_many, many = [], [], [], []
        for rep in range(max(3, reps // 2)):
            t0 = time.perf_counter()
            for src in srcs:  # baseline: one synchronous contiguous D2H per call
                host.copy_(src.view(torch.uint8), non_blocking=True)
                torch.cuda.current_stream().synchronize()
            base.append(time.perf_counter() - t0)
            e.evict_bytes(count * size)
            t0 = time.perf_counter()
            for i, src in enumerate(srcs):
                e.device.put(f"pfd-{size}-{rep}-{i}", src)
            ours.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for src in srcs:  # baseline: the same copies queued back to back, one wait
                host.copy_(src.view(torch.uint8), non_blocking=True)
            torch.cuda.current_stream().synchronize()
            base_many.append(time.perf_counter() - t0)
            e.evict_bytes(count * size)
            t0 = time.perf_counter()
            e.device.put_many([(f"pfm-{size}-{rep}-{i}", src) for i, src in enumerate(srcs)])
            many.append(time.perf_counter() - t0)
        total = count * size
        out[f"{size // MiB}MiB"] = {
            "put_from_device_GBps": total / statistics.median(ours) / 1e9,
            "contiguous_d2h_per_call_GBps": total / statistics.median(base) / 1e9,
            "put_from_device_many_GBps": total / statistics.median(many) / 1e9,
            "contiguous_d2h_one_wait_GBps": total / statistics.median(base_many) / 1e9,
            "count": count,
        }
    return out


# The GEMM of a decoder: 20 launches timed with events on a side stream; "alone", then
# "busy S" (median over S seconds). Run in this process or in a worker process of its own.
GEMM = """
import statistics, sys, time, torch
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
side = torch.cuda.Stream()
def gemm_ms(n=20):
    with torch.cuda.stream(side):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            torch.mm(a, b)
        end.record()
    end.synchronize()
    return start.elapsed_time(end) / n
def measure(cmd):
    if cmd[0] == "alone":
        return statistics.median(gemm_ms() for _ in range(5))
    busy, t_end = [], time.perf_counter() + float(cmd[1])
    while time.perf_counter() < t_end:
        busy.append(gemm_ms())
    return statistics.median(busy)
gemm_ms(5)
"""
WORKER = (
    GEMM
    + """
print("ready", flush=True)
for line in sys.stdin:
    print(measure(line.split()), flush=True)
"""
)


class GemmWorker:
    """The GEMM in a process of its own, as a decoder is: the loader's Python cannot delay
    its launches (in one process the two threads share the GIL)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "ready"

    def __call__(self, cmd: list[str]) -> float:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(" ".join(cmd) + "\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=30)


def gemm_slowdown(e: CacheEngine, keys: list[str], seconds: float = 3.0) -> dict[str, float]:
    """GEMM time while cold batches stream in, over GEMM time alone: the GEMM in another
    process (the target: a decoder is one) and, as before, in this process. Baselines in
    the same run, from another process: bare contiguous 64 MiB copy-engine copies, and the
    gets with their page-table updates launched after every get (``flush_every_s`` 0)."""
    scope: dict[str, object] = {}
    exec(GEMM, scope)  # the same GEMM code, in this process
    in_process = scope["measure"]
    assert callable(in_process)
    pool = e.device_tier.pool(0)
    every = pool.flush_every_s
    host = torch.empty(64 * MiB, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()

    def bare_copy() -> None:
        with torch.cuda.stream(stream):
            dev.copy_(host, non_blocking=True)
        stream.synchronize()

    def flushing_every_get() -> None:
        pool.flush_every_s = 0.0
        try:
            cold_get(e, keys)
        finally:
            pool.flush_every_s = every

    worker = GemmWorker()
    loaders = {
        "other_process_copy_engine": (bare_copy, worker),
        "other_process_tables_every_get": (flushing_every_get, worker),
        "other_process": (functools.partial(cold_get, e, keys), worker),
        "same_process": (functools.partial(cold_get, e, keys), in_process),
    }
    out = {}
    try:
        alone = {id(worker): worker(["alone"]), id(in_process): in_process(["alone"])}
        for name, (step, measure) in loaders.items():
            busy, _ = while_loading(step, lambda m=measure: m(["busy", str(seconds)]))
            out[name] = busy / alone[id(measure)]
    finally:
        worker.close()
    return out


def while_loading(step: Callable[[], object], measure: Callable[[], float]) -> tuple[float, int]:
    """``measure()`` while a thread runs ``step`` back to back; also how many steps ran."""
    stop = threading.Event()
    steps = [0]
    failed: list[BaseException] = []

    def loader() -> None:
        try:
            while not stop.is_set():
                step()
                steps[0] += 1
        except BaseException as exc:  # a loader that stopped would leave the GEMM alone
            failed.append(exc)

    th = threading.Thread(target=loader)
    th.start()
    try:
        time.sleep(0.2)
        result = measure()
    finally:
        stop.set()
        th.join()
    if failed or not steps[0]:
        raise RuntimeError(f"the loader failed: {failed}")
    return result, steps[0]


def head_and_tail_switch() -> Callable[[bool], None]:
    """Turns the head-and-tail split of a cold batch on and off."""
    split = device_loads.HEAD_BYTES

    def switch(on: bool) -> None:
        device_loads.HEAD_BYTES = split if on else 0

    return switch


def planned_copy_switch(e: CacheEngine) -> Callable[[bool], None]:
    """Turns the planned copy (transfer_planned, no checks) on, or sends a get's plans
    through transfer_ranges and its checks."""
    copier = e.device_tier.copier
    transfer = copier.transfer

    def checked(*args: Any, **kwargs: Any) -> None:
        kwargs["checked"] = True
        transfer(*args, **kwargs)

    def switch(on: bool) -> None:
        vars(copier).pop("transfer", None)
        if not on:
            copier.transfer = checked  # type: ignore[method-assign]

    return switch


def owned_copy_vs_view(e: CacheEngine, reps: int) -> dict[str, float]:
    """The client's step after a device get of 16 x 4 MiB resident entries: the owned copy
    (one gather of their pages into new memory, an event after it, waited for) against
    zero-copy views (an anchored view per entry, no GPU work), on the pool's tensor."""
    from embcache.clients.device.anchors import anchored_view
    from embcache.clients.device.gathers import plan_gather

    keys = [f"owned-{i}" for i in range(BATCH)]
    for i, key in enumerate(keys):
        e.put(key, torch.full((ENTRY,), i, dtype=torch.uint8))
    pool = e.device_tier.pool(0)
    pool.evict_unleased()  # room for each entry in one run
    placed, _ = e.device.get(keys, "owned-bench")
    flat, page = pool.tensor, pool.page_bytes
    pages = [p for d in placed if d is not None for p in d.page_ids]
    offsets = [d.offset for d in placed if d is not None and d.offset is not None]
    owned, views = [], []
    for _ in range(reps + 2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        gather = plan_gather(flat, page, pages, [ENTRY // page] * BATCH, [ENTRY] * BATCH)
        gather.run()
        ready = torch.cuda.Event()
        ready.record()
        ready.synchronize()
        owned.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        kept = [anchored_view(flat, off, ENTRY) for off in offsets]
        views.append(time.perf_counter() - t0)
        del kept
    e.release(d.lease.lease_id for d in placed if d is not None)
    return {
        "owned_copy_GBps": BATCH * ENTRY / statistics.median(owned[2:]) / 1e9,
        "owned_copy_us": statistics.median(owned[2:]) * 1e6,
        "zero_copy_views_us": statistics.median(views[2:]) * 1e6,
        "entries_in_one_run": len(offsets),
    }


def resident_hit_us(e: CacheEngine, key: str, n: int = 2000) -> dict[str, float]:
    """Latency of get_to_device + release of one resident entry, in-process."""
    [warm], _ = e.device.get([key], "warm")
    assert warm is not None
    hits = []
    for _ in range(n):
        t0 = time.perf_counter()
        [r], _ = e.device.get([key], "bench")
        assert r is not None and r.resident_hit
        e.release([r.lease.lease_id])
        hits.append(time.perf_counter() - t0)
    e.release([warm.lease.lease_id])
    hits.sort()
    return {"p50": hits[n // 2] * 1e6, "p99": hits[int(0.99 * n)] * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    args = ap.parse_args()
    env = environment()
    print_environment(env)
    base = contiguous_baseline(args.reps)
    rows: list[tuple[str, float, float]] = [
        ("contiguous copy engine H2D, 64 MiB (baseline)", base["h2d"], 1.0)
    ]
    gets: dict[str, float] = {}
    hit: dict[str, float] = {}
    owned: dict[str, float] = {}
    pfd: dict[str, dict[str, float]] = {}
    slowdown = {"other_process": float("nan"), "same_process": float("nan")}
    # "auto" runs again on a fifth engine: rates differ between engine instances (each has
    # its own newly registered host pool) by more than between auto and batch, which take
    # the same copy path for these 256 KiB runs.
    for n, backend in enumerate(("auto", "kernel", "batch", "memcpy", "auto")):
        name = backend if n < 4 else "auto_again"
        with make_engine(backend) as e:
            keys = fill_fragmented(e)
            for _ in range(3):  # warm-up: compile, first touch
                cold_get(e, keys)
            seconds = statistics.median(cold_get(e, keys) for _ in range(args.reps))
            gets[name] = BATCH * ENTRY / seconds / 1e9
            label = backend if n < 4 else "auto (a fifth engine)"
            rows.append(
                (
                    f"get_to_device 16x4 MiB fragmented, {label}",
                    gets[name],
                    gets[name] / base["h2d"],
                )
            )
            if name == "auto":
                # Two changes, each on and off alternating on this engine (engine instances
                # differ by more): the head-and-tail split of a batch (device_loads.HEAD_BYTES:
                # the head's pages reserved and its copy queued before the tail's pages are
                # picked), and the planned copy (transfer_planned) against transfer_ranges
                # with its checks.
                for switch, labels in (
                    (head_and_tail_switch(), ("head and tail", "one copy call")),
                    (planned_copy_switch(e), ("planned copy", "checked transfer_ranges")),
                ):
                    ab: dict[bool, list[float]] = {True: [], False: []}
                    for rep in range(2 * args.reps):
                        switch(rep % 2 == 0)
                        ab[rep % 2 == 0].append(cold_get(e, keys))
                    switch(True)
                    for on, label in zip((True, False), labels, strict=True):
                        rate = BATCH * ENTRY / statistics.median(ab[on]) / 1e9
                        gets[f"auto_{label.replace(' ', '_')}"] = rate
                        rows.append(
                            (
                                f"get_to_device 16x4 MiB fragmented, auto, {label} (A/B)",
                                rate,
                                rate / base["h2d"],
                            )
                        )
                # The same with 16 MiB entries: per-batch bookkeeping weighs 4x less.
                for k in keys:
                    e.evict_one(k)
                e.evict_bytes(e.host_pool.nbytes)
                big = fill_fragmented(e, 16 * MiB)
                cold_get(e, big)
                sec = statistics.median(cold_get(e, big) for _ in range(args.reps))
                gets["auto_16x16MiB"] = BATCH * 16 * MiB / sec / 1e9
                rows.append(
                    (
                        "get_to_device 16x16 MiB fragmented, auto",
                        gets["auto_16x16MiB"],
                        gets["auto_16x16MiB"] / base["h2d"],
                    )
                )
                e.evict_bytes(e.host_pool.nbytes)
                keys = fill_fragmented(e)
                hit = resident_hit_us(e, keys[0])
                owned = owned_copy_vs_view(e, args.reps)
                pfd = put_from_device_rates(e, args.reps)
                e.evict_bytes(e.host_pool.nbytes)  # the puts above evicted some of the batch
                slowdown = gemm_slowdown(e, fill_fragmented(e))
    for size, r in pfd.items():
        rows.append(
            (
                f"contiguous D2H, one {size} copy per call (baseline)",
                r["contiguous_d2h_per_call_GBps"],
                1.0,
            )
        )
        rows.append(
            (
                f"put_from_device, {size} tensors",
                r["put_from_device_GBps"],
                r["put_from_device_GBps"] / r["contiguous_d2h_per_call_GBps"],
            )
        )
        rows.append(
            (
                f"contiguous D2H, {r['count']} x {size} queued, one wait (baseline)",
                r["contiguous_d2h_one_wait_GBps"],
                1.0,
            )
        )
        rows.append(
            (
                f"put_from_device_many, {r['count']} x {size} tensors",
                r["put_from_device_many_GBps"],
                r["put_from_device_many_GBps"] / r["contiguous_d2h_one_wait_GBps"],
            )
        )
    w = max(len(r[0]) for r in rows)
    print(f"{'measurement':<{w}}  {'GB/s':>8}  {'vs baseline':>11}")
    for name, gbps, ratio in rows:
        print(f"{name:<{w}}  {gbps:8.2f}  {ratio:10.0%}")
    print(
        f"resident hit (get_to_device + release, in-process): p50 {hit['p50']:.1f} us, "
        f"p99 {hit['p99']:.1f} us"
    )
    print(
        f"client's owned copy of 16 x 4 MiB resident entries (gather + event wait): "
        f"{owned['owned_copy_us']:.0f} us = {owned['owned_copy_GBps']:.0f} GB/s; zero-copy "
        f"views of the {owned['entries_in_one_run']} in one run: "
        f"{owned['zero_copy_views_us']:.0f} us"
    )
    print(
        "concurrent 8192^3 bf16 GEMM while cold batches load (auto), over its time alone: "
        f"{slowdown['other_process']:.3f}x from another process (a decoder), "
        f"{slowdown['same_process']:.3f}x from this process (its launches share the GIL); "
        "baselines from another process: bare 64 MiB copy-engine copies "
        f"{slowdown['other_process_copy_engine']:.3f}x, the gets with their page tables "
        f"updated after every get {slowdown['other_process_tables_every_get']:.3f}x"
    )
    results = {
        "env": env,
        "baseline_GBps": base,
        "get_to_device_GBps": gets,
        "resident_hit_us": hit,
        "owned_copy_vs_view": owned,
        "put_from_device": pfd,
        "gemm_slowdown_during_cold_gets": slowdown,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / "get_to_device.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"saved {path}")


if __name__ == "__main__":
    main()
