"""Where a get_into's time goes inside the daemon: the engine's ``get_into`` of one 4 MiB
entry in this process (no transport), from the device pool (resident) and from the host
pool, beside one plain 4 MiB copy of each kind (the floor) and the pieces around the
copy (a stream synchronize with nothing queued, the planning of the copy), and what a
client does before it sends a get_into (the destination's IPC export and its event).
Subtract these from a client's get_into (bench/call_profile.py) for the transport's share.

    python bench/into_parts.py [--iters N] [--profile] [--out-dir DIR]   (a CUDA machine)

``--profile`` also runs each get_into under cProfile and prints the functions that take the
most time of their own (into_parts_profile.txt in the output folder).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import environment, latencies_us, print_environment, save_json

from embcache.clients.device import exports
from embcache.clients.device.ipc_events import EVENTS
from embcache.kernels import cuda_ipc
from embcache.service.config import Settings
from embcache.service.device.copy_plan import PlanBuilder
from embcache.service.engine import CacheEngine

MiB = 1 << 20
ENTRY = 4 * MiB


def p50_us(fn: Callable[[], object], iters: int) -> float:
    return statistics.median(latencies_us(fn, iters, warmup=5))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--profile", action="store_true", help="cProfile each get_into too")
    ap.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("into_parts: needs a CUDA GPU")
    settings = Settings(
        host_pool_bytes=256 * MiB,
        page_bytes=256 * 1024,
        device_pool_bytes=256 * MiB,
        device_page_bytes=256 * 1024,
        shm_name=f"embcache-bench-{uuid.uuid4().hex[:8]}",
        device="cuda",
        max_entry_bytes=64 * MiB,
    )
    engine = CacheEngine(settings)
    for key in ("resident", "host"):
        engine.put(key, torch.full((ENTRY,), 7, dtype=torch.uint8))
    results, _ = engine.device.get(["resident"], "bench")  # a copy in the device pool
    engine.device.pool(0).stream.synchronize()
    engine.release(r.lease.lease_id for r in results if r is not None)
    dest = torch.empty(ENTRY, dtype=torch.uint8, device="cuda")
    host = torch.empty(ENTRY, dtype=torch.uint8, pin_memory=True)
    stream = torch.cuda.current_stream()

    def into(key: str) -> Callable[[], object]:
        def run() -> None:
            (lease,) = engine.device.get_into([key], "bench", dest, [0], device=0)
            assert lease is not None

        return run

    def copy(src: torch.Tensor) -> Callable[[], object]:
        def run() -> None:
            dest.copy_(src, non_blocking=True)
            stream.synchronize()

        return run

    def plan() -> None:
        b = PlanBuilder(16)
        b.add([(0, ENTRY)], [(0, ENTRY)], ENTRY)
        b.rows()

    def export() -> None:  # what the client does before each GetInto
        exported = exports.export_cuda(dest, as_bytes=True)
        assert exported is not None
        exported.returned()

    pool_src = engine.device.pool(0).tensor[:ENTRY]
    rows = {
        "get_into from the device pool (resident)": into("resident"),
        "get_into from the host pool": into("host"),
        "floor: one 4 MiB device-to-device copy + sync": copy(pool_src),
        "floor: one 4 MiB pinned host-to-device copy + sync": copy(host),
        "stream synchronize, nothing queued": stream.synchronize,
        "plan of one run (PlanBuilder)": plan,
        "client: export of the destination, with its event": export,
        "client: the export's IPC memory handle alone": lambda: cuda_ipc.export_tensor(dest),
        "client: the export's IPC event alone": lambda: EVENTS.record(dest.device).done(),
    }
    out = {name: p50_us(fn, args.iters) for name, fn in rows.items()}
    if args.profile:
        report = io.StringIO()
        for key in ("resident", "host"):
            prof = cProfile.Profile()
            run = into(key)
            prof.enable()
            for _ in range(args.iters):
                run()
            prof.disable()
            report.write(f"== get_into of {key!r}, {args.iters} calls (times are totals)\n")
            stats = pstats.Stats(prof, stream=report).sort_stats("tottime")
            stats.print_stats(30)
        print(report.getvalue())
        args.out_dir.mkdir(parents=True, exist_ok=True)
        (args.out_dir / "into_parts_profile.txt").write_text(report.getvalue())
    engine.close()
    env = environment()
    print("get_into inside the daemon (in process, no transport)")
    print_environment(env)
    for name, us in out.items():
        print(f"{name:<52} p50 {us:8.1f} us")
    save_json("into_parts", {"bench": "into_parts", **env, "p50_us": out}, args.out_dir)


if __name__ == "__main__":
    main()
