"""Benchmark of a client's own GPU copies out of its read-only mapping of a host pool.

Run on a GPU machine: ``python bench/client_h2d.py`` (prints tables, writes
``bench/results/client_h2d_<gpu>.json``). A POSIX shared-memory segment stands for the
daemon's pool; it is mapped read-only as a client maps it (``shm.PoolMaps``), registered in
the background chunk by chunk (``registered.py``), and entries are copied into GPU memory with
``table_cuda.copy_runs_to_cuda``: 1 x 4 MiB and 16 scattered 4 MiB runs. The baselines,
measured in the same run: the same copies from the mapping unregistered (pageable), and one
contiguous copy from pinned ``torch`` memory of the same bytes (the floor). Also: the
registration's cost per GiB, and how long a tiny GPU op on the caller's thread took while the
background thread registered (does registering stall the caller?).
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

MIB, GIB = 1 << 20, 1 << 30


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pool-mib", type=int, default=2048, help="segment size (MiB)")
    p.add_argument("--chunk-mib", type=int, default=256, help="registration chunk (MiB)")
    p.add_argument("--run-mib", type=int, default=4, help="bytes per run (MiB)")
    p.add_argument("--runs", type=int, default=16, help="runs of the scattered entry")
    p.add_argument("--reps", type=int, default=50, help="timed copies per case")
    p.add_argument("--out-dir", type=Path, default=None, help="where the JSON goes")
    args = p.parse_args(argv)
    if args.pool_mib < args.run_mib * (args.runs + 1):
        p.error("--pool-mib: too small for the runs")
    if args.chunk_mib < 1:
        p.error("--chunk-mib: must be >= 1")
    return args


def make_segment(nbytes: int) -> tuple[str, Path]:
    """A filled segment in /dev/shm (as the daemon's pool: its pages resident)."""
    import numpy as np

    name = f"embcache-bench-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    path = Path("/dev/shm") / name
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        with mmap.mmap(fd, nbytes) as mm:
            step = 64 * MIB
            for at in range(0, nbytes, step):
                n = min(step, nbytes - at)
                mm[at : at + n] = (np.arange(n // 4, dtype=np.uint32) + at).tobytes()
    finally:
        os.close(fd)
    return name, path


def p50_us(fn: Callable[[], Any], reps: int, warmup: int = 3) -> float:
    """Median microseconds of ``fn()`` (which returns something to synchronize)."""
    for _ in range(warmup):
        fn().synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn().synchronize()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("client_h2d: needs a CUDA GPU, and this machine has none", file=sys.stderr)
        return 2
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import environment, print_environment, save_json, table

    from embcache.clients.device import registered, shm, table_cuda
    from embcache.proto.embcache.v1 import embcache_pb2 as pb
    from embcache.proto.locations import boot_id

    env = environment()
    print_environment(env)
    size, run = args.pool_mib * MIB, args.run_mib * MIB
    name, path = make_segment(size)
    try:
        st = path.stat()
        desc = pb.HostShmPool(
            segment_name=name, size=size, page_bytes=4096, boot_id=boot_id(),
            st_dev=st.st_dev, st_ino=st.st_ino,
        )  # fmt: skip
        handle = pb.PoolHandle(pool_id="b", host_shm=desc)
        pool = shm.PoolMaps(path.parent).get(handle)
        # A second mapping of the same segment, never registered: the pageable baseline.
        plain = shm.PoolMaps(path.parent).get(handle)
        assert pool is not None and plain is not None and plain is not pool
        dev = torch.device("cuda", torch.cuda.current_device())
        tiny = torch.zeros(1, device=dev)
        stream = torch.cuda.Stream(dev)

        def tiny_op_us() -> float:
            t0 = time.perf_counter()
            tiny.add_(1)
            torch.cuda.synchronize(dev)
            return (time.perf_counter() - t0) * 1e6

        idle = sorted(tiny_op_us() for _ in range(200))
        t0 = time.perf_counter()
        reg = registered.RegisteredPools(chunk_bytes=args.chunk_mib * MIB).get(pool)
        assert reg is not None
        started_us = (time.perf_counter() - t0) * 1e6
        busy: list[float] = []
        while not reg.wait_registered(0) and reg.usable and reg.stats()["chunks_failed"] == 0:
            if reg.stats()["chunks_registered"] == reg.stats()["chunks_total"]:
                break
            busy.append(tiny_op_us())
        wall = time.perf_counter() - t0
        stats = reg.stats()
        if not reg.usable or stats["chunks_registered"] != stats["chunks_total"]:
            print(f"registration failed: {reg.error} {stats}", file=sys.stderr)
            return 1
        busy.sort()
        reg_rows = [
            [
                f"{args.pool_mib} MiB in {args.chunk_mib} MiB chunks",
                f"{stats['register_seconds'] / (size / GIB):.3f}",
                f"{wall:.2f}",
                f"{started_us:.0f}",
                f"{idle[len(idle) // 2]:.0f} / {idle[-1]:.0f}",
                f"{busy[len(busy) // 2]:.0f} / {busy[-1]:.0f}" if busy else "-",
            ]
        ]
        print(
            table(
                [
                    "registration",
                    "s per GiB",
                    "wall s",
                    "first call us",
                    "tiny op us p50/max idle",
                    "while registering",
                ],
                reg_rows,
            )
        )

        gap = (size // args.runs) // run * run  # spread the runs over the pool
        one = [(size // 2 // run * run, run)]
        scattered = [((i * gap + (i % 3) * 4096) % (size - run), run) for i in range(args.runs)]
        cases: dict[str, list[tuple[int, int]]] = {
            f"1 x {args.run_mib} MiB": one,
            f"{args.runs} x {args.run_mib} MiB scattered": scattered,
        }
        rows, results = [], []
        for label, runs in cases.items():
            nbytes = sum(n for _, n in runs)
            out = torch.empty(nbytes, dtype=torch.uint8, device=dev)
            pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            host = table_cuda.copy_runs_to_host(pool, runs)
            assert host is not None
            pinned.copy_(host)

            def registered_copy(runs: list[tuple[int, int]] = runs, out: torch.Tensor = out) -> Any:
                event = table_cuda.copy_runs_to_cuda(pool, reg, runs, out, stream)
                assert event is not None
                return event

            def pageable_copy(runs: list[tuple[int, int]] = runs, out: torch.Tensor = out) -> Any:
                with torch.cuda.stream(stream):
                    pos = 0
                    for at, n in runs:
                        out[pos : pos + n].copy_(plain.tensor[at : at + n], non_blocking=True)
                        pos += n
                    event = torch.cuda.Event()
                    event.record(stream)
                return event

            def floor_copy(pinned: torch.Tensor = pinned, out: torch.Tensor = out) -> Any:
                with torch.cuda.stream(stream):
                    out.copy_(pinned, non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(stream)
                return event

            reg_us = p50_us(registered_copy, args.reps)
            ok = torch.equal(out.cpu(), pinned)
            page_us = p50_us(pageable_copy, max(5, args.reps // 5))
            floor_us = p50_us(floor_copy, args.reps)
            gbs = nbytes / reg_us / 1e3
            rows.append(
                [label, reg_us, gbs, page_us, floor_us, floor_us / reg_us, "yes" if ok else "NO"]
            )
            results.append(
                {
                    "case": label,
                    "bytes": nbytes,
                    "registered_us": reg_us,
                    "registered_gbs": gbs,
                    "pageable_us": page_us,
                    "pinned_floor_us": floor_us,
                    "bit_exact": ok,
                }
            )
        headers = ["copy", "registered us", "GB/s", "pageable us", "floor us", "floor/reg", "exact"]
        print(table(headers, rows))
        save_json(
            "client_h2d",
            {
                "env": env,
                "args": {k: str(v) for k, v in vars(args).items()},
                "registration": {
                    **stats,
                    "seconds_per_gib": stats["register_seconds"] / (size / GIB),
                    "wall_s": wall,
                    "first_call_us": started_us,
                    "tiny_op_idle_us": {"p50": idle[len(idle) // 2], "max": idle[-1]},
                    "tiny_op_while_registering_us": (
                        {"p50": busy[len(busy) // 2], "max": busy[-1], "count": len(busy)}
                        if busy
                        else None
                    ),
                },
                "copies": results,
            },
            args.out_dir,
        )
        reg.close()
        return 0 if all(r["bit_exact"] for r in results) else 1
    finally:
        path.unlink(missing_ok=True)


if __name__ == "__main__":
    sys.exit(main())
