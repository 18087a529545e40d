"""Engine benchmark: small-entry op rates, 4 MiB fill bandwidth, metadata bytes per entry.

Runs on the CPU (one core for the engine): `python bench/engine.py [--entries 1000000]`.
Targets: <= 20 us per get+release, >= 5 GB/s fill into shared memory,
<= 512 B of metadata per entry at 1,000,000 entries. The baseline for the fill is a plain
numpy copy of the same bytes into the same shared-memory pool, measured in the same run.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import time
import tracemalloc
import uuid
from pathlib import Path

import numpy as np

from embcache.service.config import Settings
from embcache.service.engine import CacheEngine

RESULTS = Path(__file__).resolve().parent / "results"
MiB = 1 << 20


def _engine(pool: int, page: int) -> CacheEngine:
    name = f"embcache-bench-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    s = Settings(
        host_pool_bytes=pool,
        page_bytes=page,
        shm_name=name,
        device="cpu",
        max_entry_bytes=min(pool, 256 * MiB),
        max_key_bytes=128,
    )
    return CacheEngine(s)


def _median_rate(fn, reps: int) -> float:
    """Median seconds per call over 5 batches of ``reps`` calls."""
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        fn(reps)
        samples.append((time.perf_counter() - t0) / reps)
    return statistics.median(samples)


def bench_small_ops(n: int) -> dict[str, float]:
    with _engine(256 * MiB, 4096) as e:
        payload = np.random.default_rng(0).integers(0, 256, 2048, dtype=np.uint8)  # 1024 x bf16
        keys = [f"small-{i}" for i in range(n)]
        counter = iter(range(10**9))

        def put(reps: int) -> None:
            for _ in range(reps):
                h = e.begin_put(keys[next(counter) % n], "bfloat16", (1024,))
                if not h.exists_already:
                    h.write(payload)
                h.commit()

        put_s = _median_rate(put, n // 5)
        hot = keys[:1000]
        for k in hot:
            e.begin_put(k, "bfloat16", (1024,)).abort()
        for k in hot:
            if not e.exists([k])[0]:
                with e.begin_put(k, "bfloat16", (1024,)) as h:
                    h.write(payload)
                    h.commit()

        def get_release(reps: int) -> None:
            for i in range(reps):
                [lease] = e.get([hot[i % 1000]], "bench")
                e.release((lease.lease_id,))  # type: ignore[union-attr]

        def get_batch16(reps: int) -> None:
            for i in range(reps):
                batch = hot[(i * 16) % 976 : (i * 16) % 976 + 16]
                leases = e.get(batch, "bench")
                e.release([x.lease_id for x in leases if x is not None])

        gr_s = _median_rate(get_release, 20000)
        gb_s = _median_rate(get_batch16, 2000) / 16
        ex_s = _median_rate(lambda r: [e.exists([hot[i % 1000]]) for i in range(r)], 20000)
    return {
        "put_commit_us": put_s * 1e6,
        "put_commit_ops_s": 1 / put_s,
        "get_release_us": gr_s * 1e6,
        "get_release_ops_s": 1 / gr_s,
        "get_release_batch16_us_per_key": gb_s * 1e6,
        "exists_us": ex_s * 1e6,
    }


def bench_fill(total: int = 512 * MiB, entry: int = 4 * MiB) -> dict[str, float]:
    with _engine(total, 256 * 1024) as e:
        data = np.random.default_rng(1).integers(0, 256, entry, dtype=np.uint8)
        n = total // entry
        # Baseline: numpy copies of the same bytes into the same pages, no engine at all.
        pool = e.host_pool.array

        def baseline() -> float:
            t0 = time.perf_counter()
            for i in range(n):
                pool[i * entry : (i + 1) * entry] = data
            return total / (time.perf_counter() - t0)

        def fill(chunk: int) -> float:
            e.evict_bytes(total)
            t0 = time.perf_counter()
            for i in range(n):
                h = e.begin_put(f"fill-{i}", "uint8", (entry,))
                for off in range(0, entry, chunk):
                    h.write(data[off : off + chunk])
                h.commit()
            return total / (time.perf_counter() - t0)

        base = statistics.median(baseline() for _ in range(5))
        whole = statistics.median(fill(entry) for _ in range(5))
        chunked = statistics.median(fill(MiB) for _ in range(5))
    return {
        "baseline_numpy_copy_GBps": base / 1e9,
        "fill_4MiB_one_write_GBps": whole / 1e9,
        "fill_4MiB_1MiB_chunks_GBps": chunked / 1e9,
        "fill_vs_baseline": chunked / base,
    }


def bench_metadata(n: int) -> dict[str, float]:
    # One page per entry, the smallest page, so the pool is as small as n entries allow.
    with _engine(n * 4096, 4096) as e:
        keys = [f"{i:032x}" for i in range(n)]  # 32-char keys, like a hex digest prefix
        one = np.zeros(1, dtype=np.uint8)
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        for k in keys:
            h = e.begin_put(k, "uint8", (1,))
            h.write(one)
            h.commit()
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        assert e.stats().entries_ready == n
    return {
        "entries": n,
        "metadata_bytes_per_entry": (after - before) / n,
        "note": "includes the key string (32 chars), the entry, its LRU and map slots",
    }


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).parent,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--entries", type=int, default=1_000_000)
    ap.add_argument("--small", type=int, default=20_000)
    args = ap.parse_args()
    env = {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "commit": _commit(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    print(" | ".join(f"{k} {v}" for k, v in env.items()))
    ops = bench_small_ops(args.small)
    fill = bench_fill()
    meta = bench_metadata(args.entries)
    rows = [
        (
            "put+commit, 2 KiB entry",
            f"{ops['put_commit_us']:.1f} us",
            f"{ops['put_commit_ops_s']:,.0f} ops/s",
            "",
        ),
        (
            "get+release, 1 key",
            f"{ops['get_release_us']:.1f} us",
            f"{ops['get_release_ops_s']:,.0f} ops/s",
            "<= 20 us",
        ),
        ("get+release, batch of 16", f"{ops['get_release_batch16_us_per_key']:.1f} us/key", "", ""),
        ("exists, 1 key", f"{ops['exists_us']:.1f} us", "", ""),
        (
            "baseline: numpy copy into the pool",
            f"{fill['baseline_numpy_copy_GBps']:.2f} GB/s",
            "1.00x",
            "",
        ),
        (
            "fill 4 MiB entries, one write",
            f"{fill['fill_4MiB_one_write_GBps']:.2f} GB/s",
            f"{fill['fill_4MiB_one_write_GBps'] / fill['baseline_numpy_copy_GBps']:.2f}x",
            ">= 5 GB/s",
        ),
        (
            "fill 4 MiB entries, 1 MiB chunks",
            f"{fill['fill_4MiB_1MiB_chunks_GBps']:.2f} GB/s",
            f"{fill['fill_vs_baseline']:.2f}x",
            ">= 5 GB/s",
        ),
        (
            f"metadata per entry at {meta['entries']:,} entries",
            f"{meta['metadata_bytes_per_entry']:.0f} B",
            "",
            "<= 512 B",
        ),
    ]
    w = max(len(r[0]) for r in rows)
    print(f"{'measurement':<{w}}  {'value':>16}  {'rate/ratio':>16}  target")
    for name, value, rate, target in rows:
        print(f"{name:<{w}}  {value:>16}  {rate:>16}  {target}")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "engine.json"
    out.write_text(
        json.dumps({"env": env, "small_ops": ops, "fill": fill, "metadata": meta}, indent=2) + "\n"
    )
    print(f"saved {out.relative_to(RESULTS.parent.parent)}")


if __name__ == "__main__":
    main()
