"""Shared-tier benchmark: fetch-on-miss latency and throughput per adapter next to a local hit.

``python bench/shared_tier.py [--out-dir bench/results] [--sizes 64KiB,1MiB,8MiB]``

One run starts, on 127.0.0.1, a plain Redis, a 3-master Redis Cluster and a Mooncake Store
(master + storage node), and for each adapter two engines: A writes entries through, B
misses them locally and fetches them (get = fetch + CRC check + commit + lease). The local
hit is B's second get of the same entry (lease only, the bytes are already in the pool).
Because Mooncake's transfer engine listens on every interface, the benchmark re-runs itself
inside a loopback-only network namespace (``unshare -n``) unless ``--no-netns`` is given.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests" / "tiers"))

from _common import environment, print_environment, save_json, table  # noqa: E402
from tier_helpers import new_node, payload  # noqa: E402
from tier_servers import MooncakeMaster, RedisNodes, start_storage_node, stop  # noqa: E402

from embcache.service.engine import CacheEngine  # noqa: E402
from embcache.service.shared_tier import SharedTier, SharedTierConfig  # noqa: E402
from embcache.service.sizes import parse_size  # noqa: E402

MiB = 1 << 20


def _lo_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifr = struct.pack("16sH", b"lo", 0)
        flags = struct.unpack("16sH", fcntl.ioctl(s, 0x8913, ifr)[:18])[1]
        fcntl.ioctl(s, 0x8914, struct.pack("16sH", b"lo", flags | 1))


def _interfaces() -> list[str]:
    lines = Path("/proc/net/dev").read_text().splitlines()[2:]
    return [line.split(":")[0].strip() for line in lines]


def _get_release(engine: CacheEngine, keys: list[str]) -> float:
    t0 = time.perf_counter()
    leases = engine.get(keys, "bench")
    dt = time.perf_counter() - t0
    assert all(lease is not None for lease in leases), "fetch missed"
    engine.release([lease.lease_id for lease in leases if lease is not None])
    return dt


def measure(url: str, sizes: list[int], batch: int) -> list[dict[str, Any]]:
    pool = max(256 * MiB, 2 * batch * max(sizes) + 16 * MiB)
    pool = -(-pool // MiB) * MiB
    config = SharedTierConfig.from_url(url, timeout_s=10.0, queue_size=4096)
    (a, ta), (b, tb) = new_node("bench-a", config, pool), new_node("bench-b", config, pool)
    tiers: list[SharedTier] = [ta, tb]
    rows: list[dict[str, Any]] = []
    try:
        for size in sizes:
            reps = max(5, min(40, (64 * MiB) // size))
            keys = [f"s{size}-{i}" for i in range(reps)]
            bkeys = [f"b{size}-{i}" for i in range(batch)]
            t0 = time.perf_counter()
            for i, key in enumerate(keys + bkeys):
                a.put(key, payload(size, seed=i))
            assert ta.flush(120), "write-through did not finish"
            write_s = time.perf_counter() - t0
            miss = [_get_release(b, [k]) for k in keys]  # one key per get: latency
            hit = [_get_release(b, [k]) for k in keys]  # now local
            batch_s = _get_release(b, bkeys)  # one batched fetch: throughput
            assert tb.stats()["fetch_corrupt"] == 0
            rows.append(
                {
                    "size_bytes": size,
                    "reps": reps,
                    "fetch_p50_ms": statistics.median(miss) * 1e3,
                    "fetch_p90_ms": sorted(miss)[int(0.9 * (len(miss) - 1))] * 1e3,
                    "local_hit_p50_ms": statistics.median(hit) * 1e3,
                    "fetch_gbps_single": size / statistics.median(miss) / 1e9,
                    "fetch_gbps_batch": batch * size / batch_s / 1e9,
                    "batch": batch,
                    "write_through_gbps": (reps + batch) * size / write_s / 1e9,
                }
            )
            a.evict(keys + bkeys)
            b.evict(keys + bkeys)
    finally:
        for tier in tiers:
            tier.close()
        a.close()
        b.close()
    return rows


def run(sizes: list[int], batch: int, out_dir: Path) -> None:
    env = environment()
    print_environment(env)
    results: dict[str, Any] = {"env": env, "sizes": sizes, "adapters": {}}
    with tempfile.TemporaryDirectory(prefix="embcache-bench-tier-") as tmp:
        work = Path(tmp)
        setups: list[tuple[str, Any]] = []
        if shutil.which("redis-server"):
            setups.append(("redis", lambda: RedisNodes(work / "r1", 1, cluster=False)))
            setups.append(("redis-cluster", lambda: RedisNodes(work / "r3", 3, cluster=True)))
        for name, make in setups:
            (work / ("r1" if name == "redis" else "r3")).mkdir()
            nodes = make().start()
            try:
                url = nodes.url("chunk=4MiB")
                results["adapters"][name] = measure(url, sizes, batch)
            finally:
                nodes.close()
        try:
            master = MooncakeMaster(work).start()
        except (AssertionError, RuntimeError, OSError) as exc:
            print(f"mooncake skipped: {exc}")
        else:
            storage = start_storage_node(work, master.port, 2 * 1024 * MiB)
            try:
                url = f"mooncake://127.0.0.1:{master.port}"
                results["adapters"]["mooncake"] = measure(url, sizes, batch)
            finally:
                stop(storage)
                master.close()
    headers = ["adapter", "size", "fetch p50 ms", "p90 ms", "hit p50 ms", "GB/s 1", "GB/s batch"]
    rows = [
        [
            name,
            f"{r['size_bytes'] // 1024} KiB",
            r["fetch_p50_ms"],
            r["fetch_p90_ms"],
            r["local_hit_p50_ms"],
            r["fetch_gbps_single"],
            r["fetch_gbps_batch"],
        ]
        for name, rs in results["adapters"].items()
        for r in rs
    ]
    print(table(headers, rows), flush=True)
    save_json("shared_tier", results, out_dir)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", type=Path, default=HERE / "results")
    p.add_argument("--sizes", default="64KiB,1MiB,8MiB")
    p.add_argument("--batch", type=int, default=16, help="keys per batched fetch")
    p.add_argument("--no-netns", action="store_true", help="do not re-run in a private netns")
    args = p.parse_args()
    if not args.no_netns and _interfaces() != ["lo"]:
        argv = [sys.executable, *sys.argv, "--out-dir", str(args.out_dir.resolve())]
        env = {**os.environ, "EMBCACHE_GIT_COMMIT": os.environ.get("EMBCACHE_GIT_COMMIT", "")}
        if not env["EMBCACHE_GIT_COMMIT"]:
            del env["EMBCACHE_GIT_COMMIT"]
        return subprocess.call(["unshare", "-n", *argv], env=env)
    if _interfaces() == ["lo"]:
        _lo_up()
    run([parse_size(s) for s in args.sizes.split(",")], args.batch, args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
