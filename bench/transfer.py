"""Benchmark of transfer_ranges: GB/s of every backend by run size, SM budgets, GEMM slowdown.

Run on a GPU machine: ``python bench/transfer.py`` (prints tables, writes
``bench/results/transfer_<gpu>.json``). 8 KiB rows (dim 4096 bf16); runs scattered at random
over a pinned host pool; the device side is contiguous. The baseline is one contiguous
copy-engine transfer of the same bytes, measured in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _common import environment, print_environment, save_json, table, time_gpu_ms

from embcache.kernels import TransferConfig, transfer_ranges
from embcache.kernels.testing import random_plan, swap_plan

KIB, MIB = 1024, 1024 * 1024
ROW_BYTES = 8 * KIB
RUN_SIZES = [8 * KIB, 32 * KIB, 128 * KIB, 512 * KIB, 2 * MIB, None]  # None: one range
BACKENDS = ["torch", "memcpy", "batch", "kernel", "auto"]


def _label(size: int | None) -> str:
    if size is None:
        return "contig"
    return f"{size // MIB} MiB" if size >= MIB else f"{size // KIB} KiB"


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rows = args.mib * MIB // ROW_BYTES
        pool_rows = args.pool_mib * MIB // ROW_BYTES
        t0 = time.perf_counter()
        self.pool = torch.empty((pool_rows, ROW_BYTES // 2), dtype=torch.bfloat16, pin_memory=True)
        flat = self.pool.view(-1).view(torch.int32)
        flat.copy_(torch.arange(flat.numel(), dtype=torch.int32))  # non-zero bytes
        print(f"pinned {args.pool_mib} MiB pool in {time.perf_counter() - t0:.2f} s", flush=True)
        self.dev = torch.randn((self.rows, ROW_BYTES // 2), device="cuda").to(torch.bfloat16)
        self.stream = torch.cuda.Stream()
        self.rng = np.random.default_rng(0)
        self.config = TransferConfig()

    def plan(self, size: int | None, direction: str):
        """Host ranges scattered at random over the pool, device ranges back to back."""
        if size is None:
            h2d = (np.array([0]), np.array([0]), np.array([self.rows]))
        else:
            run_rows = size // ROW_BYTES
            n = self.rows // run_rows
            _, host_starts, lengths = random_plan(
                self.rng, self.pool.shape[0], self.pool.shape[0], n, run_rows, fixed_len=True
            )
            h2d = (host_starts, np.arange(n) * run_rows, lengths)  # host order is random
        return h2d if direction == "h2d" else swap_plan(h2d)

    def tensors(self, direction: str) -> tuple[torch.Tensor, torch.Tensor]:
        return (self.pool, self.dev) if direction == "h2d" else (self.dev, self.pool)

    def copy_fn(self, direction: str, plan, backend: str, config: TransferConfig | None = None):
        src, dst = self.tensors(direction)
        cfg = config or self.config
        return lambda: transfer_ranges(
            src, dst, *plan, stream=self.stream, backend=backend, config=cfg
        )

    def baseline_fn(self, direction: str):
        host = self.pool[: self.rows]
        if direction == "h2d":
            return lambda: self.dev.copy_(host, non_blocking=True)
        return lambda: host.copy_(self.dev, non_blocking=True)

    def gbps(self, fn, nbytes: int | None = None) -> float:
        with torch.cuda.stream(self.stream):
            ms = time_gpu_ms(fn, self.stream, reps=self.args.reps)
        return (nbytes or self.rows * ROW_BYTES) / ms / 1e6

    # -- GEMM slowdown -----------------------------------------------------------------------
    def gemm_setup(self) -> None:
        n = 8192
        self.a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        self.b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        self.c = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
        self.gemm_stream = torch.cuda.Stream()
        self.gemm_alone_ms = statistics.median(self.gemm_ms() for _ in range(3))

    def gemm_ms(self) -> float:
        reps = self.args.gemm_reps
        with torch.cuda.stream(self.gemm_stream):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                torch.mm(self.a, self.b, out=self.c)
            end.record()
        end.synchronize()
        return start.elapsed_time(end) / reps

    def gemm_slowdown(self, fn, copy_ms: float) -> float:
        """GEMM time while ``fn`` copies run back to back on another stream, over GEMM alone
        (alone measured right before and after, to cancel clock drift)."""
        window = self.gemm_alone_ms * self.args.gemm_reps
        n_copies = math.ceil(1.5 * window / copy_ms) + 2
        ratios = []
        for _ in range(2):
            torch.cuda.synchronize()
            before = self.gemm_ms()
            with torch.cuda.stream(self.stream):
                for _ in range(n_copies):
                    fn()
            contested = self.gemm_ms()
            torch.cuda.synchronize()
            ratios.append(contested / ((before + self.gemm_ms()) / 2))
        return statistics.median(ratios)


def run(args: argparse.Namespace) -> dict[str, Any]:
    env = environment()
    print_environment(env)
    bench = Bench(args)
    nbytes = bench.rows * ROW_BYTES
    bench.gemm_setup()
    print(f"GEMM 8192^3 bf16 alone: {bench.gemm_alone_ms:.3f} ms", flush=True)
    result: dict[str, Any] = {
        "env": env,
        "bytes_per_measurement": nbytes,
        "row_bytes": ROW_BYTES,
        "pool_bytes": args.pool_mib * MIB,
        "config": dataclasses.asdict(bench.config),
        "gemm_alone_ms": bench.gemm_alone_ms,
        "directions": {},
    }
    for direction in ("h2d", "d2h"):
        base = bench.gbps(bench.baseline_fn(direction))
        base_ms = nbytes / base / 1e6
        base_slow = bench.gemm_slowdown(bench.baseline_fn(direction), base_ms)
        rows, entries = [], []
        for size in RUN_SIZES:
            plan = bench.plan(size, direction)
            entry: dict[str, Any] = {"run": _label(size), "ranges": len(plan[2])}
            for backend in BACKENDS:
                entry[backend] = bench.gbps(bench.copy_fn(direction, plan, backend))
            src, dst = bench.tensors(direction)
            entry["auto_chose"] = transfer_ranges(src, dst, *plan, stream=bench.stream)
            entry["auto_vs_baseline"] = entry["auto"] / base
            entry["auto_vs_batch"] = entry["auto"] / entry["batch"]
            auto_ms = nbytes / entry["auto"] / 1e6
            entry["auto_gemm_slowdown"] = bench.gemm_slowdown(
                bench.copy_fn(direction, plan, "auto"), auto_ms
            )
            entries.append(entry)
            rows.append(
                [entry["run"], entry["ranges"]]
                + [entry[b] for b in BACKENDS]
                + [base, f"{100 * entry['auto_vs_baseline']:.0f}%", entry["auto_chose"]]
                + [f"{entry['auto_vs_batch']:.1f}x", f"{entry['auto_gemm_slowdown']:.3f}x"]
            )
        print(f"\n{direction.upper()} GB/s ({args.mib} MiB moved, 8 KiB rows)")
        print(
            table(
                ["run", "ranges", *BACKENDS, "contig CE", "auto/CE", "auto=", "auto/batch", "GEMM"],
                rows,
            ),
            flush=True,
        )
        budgets = budget_sweep(bench, direction)
        splits = split_sweep(bench, direction)
        variants = variant_sweep(bench, direction) if args.sweep else []
        result["directions"][direction] = {
            "baseline_contiguous_copy_engine_gbps": base,
            "baseline_gemm_slowdown": base_slow,
            "runs": entries,
            "kernel_budgets": budgets,
            "split_fractions": splits,
            "variants": variants,
        }
        print(f"contiguous copy engine: {base:.1f} GB/s, GEMM slowdown {base_slow:.3f}x")
    result["launch_latency_us"] = launch_latency(bench)
    return result


def budget_sweep(bench: Bench, direction: str) -> list[dict[str, Any]]:
    """The kernel at several SM budgets, with the GEMM slowdown each causes (8 KiB runs)."""
    out, rows = [], []
    nbytes = bench.rows * ROW_BYTES
    for size in (8 * KIB, 128 * KIB):
        plan = bench.plan(size, direction)
        for budget in bench.args.budgets:
            cfg = dataclasses.replace(bench.config, sm_budget=budget)
            fn = bench.copy_fn(direction, plan, "kernel", cfg)
            gbps = bench.gbps(fn)
            slow = bench.gemm_slowdown(fn, nbytes / gbps / 1e6) if size == 8 * KIB else None
            entry = {"run": _label(size), "programs": budget, "gbps": gbps, "gemm_slowdown": slow}
            out.append(entry)
            rows.append([_label(size), budget, gbps, "" if slow is None else slow])
    print(f"\n{direction.upper()} kernel by SM budget (programs)")
    print(table(["run", "programs", "GB/s", "GEMM slowdown"], rows), flush=True)
    return out


VARIANTS = {
    "scalar": {"vector_device": False, "vector_host_loads": False, "vector_host_stores": False},
    "vec-device": {"vector_device": True, "vector_host_loads": False, "vector_host_stores": False},
    "vec-all": {"vector_device": True, "vector_host_loads": True, "vector_host_stores": True},
}


def variant_sweep(bench: Bench, direction: str) -> list[dict[str, Any]]:
    """Kernel variants (16-byte accesses per side, programs, tile, warps) and batch streams."""
    out, rows = [], []
    for size in (8 * KIB, 32 * KIB, 128 * KIB):
        plan = bench.plan(size, direction)
        for name, flags in VARIANTS.items():
            for budget, tile, warps in ((8, 32, 8), (16, 32, 8), (8, 64, 8), (8, 32, 4)):
                cfg = dataclasses.replace(
                    bench.config, sm_budget=budget, tile_bytes=tile * KIB, num_warps=warps, **flags
                )
                gbps = bench.gbps(bench.copy_fn(direction, plan, "kernel", cfg))
                out.append(
                    {
                        "run": _label(size),
                        "backend": "kernel",
                        "variant": name,
                        "programs": budget,
                        "tile_kib": tile,
                        "warps": warps,
                        "gbps": gbps,
                    }
                )
                rows.append([_label(size), f"kernel {name}", f"{budget}x{tile}K/{warps}w", gbps])
    for size in (32 * KIB, 128 * KIB, 512 * KIB):
        plan = bench.plan(size, direction)
        for streams in (1, 2, 4):
            cfg = dataclasses.replace(bench.config, copy_engine_streams=streams)
            gbps = bench.gbps(bench.copy_fn(direction, plan, "batch", cfg))
            out.append({"run": _label(size), "backend": "batch", "streams": streams, "gbps": gbps})
            rows.append([_label(size), "batch", f"{streams} streams", gbps])
    print(f"\n{direction.upper()} variants")
    print(table(["run", "backend", "setting", "GB/s"], rows), flush=True)
    return out


def split_sweep(bench: Bench, direction: str) -> list[dict[str, Any]]:
    """Kernel + copy engine at once: GB/s by the kernel's share of the bytes."""
    out, rows = [], []
    for size in (32 * KIB, 128 * KIB, 512 * KIB):
        plan = bench.plan(size, direction)
        for frac in (0.2, 0.35, 0.5, 0.65):
            cfg = dataclasses.replace(
                bench.config, kernel_below_bytes=0, copy_engine_from_bytes=1 << 40,
                split_kernel_fraction=frac,
            )  # fmt: skip
            gbps = bench.gbps(bench.copy_fn(direction, plan, "auto", cfg))
            out.append({"run": _label(size), "kernel_fraction": frac, "gbps": gbps})
            rows.append([_label(size), frac, gbps])
    print(f"\n{direction.upper()} split kernel + copy engine, by the kernel's share of bytes")
    print(table(["run", "kernel share", "GB/s"], rows), flush=True)
    return out


def launch_latency(bench: Bench) -> list[dict[str, Any]]:
    """A small plan: 1 MiB in 4 runs of 256 KiB. Host time per call and time to completion."""
    out, rows = [], []
    for direction in ("h2d", "d2h"):
        host_starts = np.array([100, 900, 2000, 3100]) * 32
        plan = (host_starts, np.arange(4) * 32, np.full(4, 32))
        plan = plan if direction == "h2d" else swap_plan(plan)
        for backend in BACKENDS:
            fn = bench.copy_fn(direction, plan, backend)
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            host, total = [], []
            for _ in range(50):
                t0 = time.perf_counter()
                fn()
                t1 = time.perf_counter()
                bench.stream.synchronize()
                t2 = time.perf_counter()
                host.append((t1 - t0) * 1e6)
                total.append((t2 - t0) * 1e6)
            entry = {
                "direction": direction,
                "backend": backend,
                "host_us": statistics.median(host),
                "end_to_end_us": statistics.median(total),
            }
            out.append(entry)
            rows.append([direction, backend, entry["host_us"], entry["end_to_end_us"]])
    print("\nLaunch latency, 1 MiB in 4 runs (median of 50, microseconds)")
    print(table(["dir", "backend", "host us", "end-to-end us"], rows), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mib", type=int, default=64, help="MiB moved per measurement")
    parser.add_argument("--pool-mib", type=int, default=1024, help="pinned host pool size")
    parser.add_argument("--reps", type=int, default=10, help="repeats (median)")
    parser.add_argument("--gemm-reps", type=int, default=10, help="GEMMs per timing")
    parser.add_argument("--budgets", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--sweep", action="store_true", help="also time kernel/batch variants")
    parser.add_argument("--out-dir", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/transfer.py needs a CUDA GPU")
    save_json("transfer", run(args), args.out_dir)


if __name__ == "__main__":
    main()
