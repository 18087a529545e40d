"""Warm restart benchmark: process start to the ready line, cold against warm.

For each pool size: start ``embcache serve`` on a fresh segment (cold: the pool is allocated
and faulted in), fill it to ~90% with 4 MiB entries, SIGTERM, start it again with the same
settings (warm: the segment is adopted, the index replayed), and time both ready lines; then
time the background CRC32 pass until every adopted entry is checked, and check one entry's
bytes. A second part times the replay + adoption of an index of 262,144 entries in process
(one per 256 KiB page of a 64 GiB pool: the most entries such a pool holds). The 64 GiB
figure is extrapolated from the per-GiB slope of the warm ready time over the sizes run,
plus the per-entry adoption cost times 262,144; the CRC pass does not delay the ready line
(entries are checked in the background, and before first being served).

    python bench/restart.py [--sizes-gib 1 4 8]

CPU only; never collected by pytest. Results: bench/results/restart_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import torch
from _common import git_commit

from embcache.clients import EmbCacheClient
from embcache.service.daemon_process import read_line, serve_command, stop

RESULTS = Path(__file__).resolve().parent / "results"
GiB, MiB = 1 << 30, 1 << 20
ENTRY = 4 * MiB
PAGES_64G = 64 * GiB // (256 << 10)


def _start(flags: list[str]) -> tuple[subprocess.Popen[str], dict[str, Any], float]:
    t0 = time.perf_counter()
    proc = subprocess.Popen(serve_command(*flags), stdout=subprocess.PIPE, text=True)
    ready = json.loads(read_line(proc, '"ready"', 600))
    return proc, ready, time.perf_counter() - t0


def _restart_stats(http: str) -> dict[str, int]:
    return httpx.get(http + "/v1/stats", timeout=30).json()["restart"]


def one_size(gib: int, tmp: Path) -> dict[str, Any]:
    name = f"embcache-bench-restart-{uuid.uuid4().hex[:8]}"
    sock = tmp / f"{name}.sock"
    flags = [
        "--shm-name",
        name,
        "--host-pool-bytes",
        f"{gib}GiB",
        "--grpc-socket",
        str(sock),
        "--device",
        "cpu",
        "--warm-restart",
        "on",
        "--max-entry-bytes",
        "64MiB",
    ]
    proc, ready, cold_s = _start(flags)
    n = int(gib * GiB * 0.9) // ENTRY
    try:
        with EmbCacheClient(f"unix:{sock}", timeout=60) as client:
            t0 = time.perf_counter()
            for i in range(n):
                client.put(f"e/{i}", torch.full((ENTRY // 4,), float(i), dtype=torch.float32))
            fill_s = time.perf_counter() - t0
        assert stop(proc, 120) == 0
        proc, ready, warm_s = _start(flags)
        http = f"http://127.0.0.1:{ready['http_port']}"
        t0 = time.perf_counter()
        while (r := _restart_stats(http))["unverified_entries"]:
            time.sleep(0.05)
        verify_s = time.perf_counter() - t0  # after the ready line, in the background
        with EmbCacheClient(f"unix:{sock}", timeout=60) as client:
            probe = n // 2
            with client.get([f"e/{probe}"]) as (t,):
                ok = t is not None and bool((t == float(probe)).all())
            del t
        assert r["adopted_entries"] == n and r["dropped_checksum_entries"] == 0, r
        assert ok, "an adopted entry came back with other bytes"
        assert stop(proc, 120) == 0  # the segment stays: time the engine's own warm start
        engine_s, engine_verify_s = _engine_warm(name, gib, n)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
        for suffix in ("", ".index", ".index.tmp"):
            Path("/dev/shm", name + suffix).unlink(missing_ok=True)
    return {
        "pool_gib": gib,
        "entries": n,
        "entry_mib": ENTRY // MiB,
        "cold_ready_s": cold_s,
        "warm_ready_s": warm_s,
        "engine_warm_s": engine_s,  # CacheEngine(...) alone, in process, same segment
        "engine_verify_s": engine_verify_s,  # its CRC pass alone, nothing else running
        "verify_after_ready_s": verify_s,
        "verify_gb_s": n * ENTRY / verify_s / 1e9 if verify_s else None,
        "fill_s": fill_s,
    }


def _engine_warm(name: str, gib: int, entries: int) -> tuple[float, float]:
    """Seconds for ``CacheEngine`` to adopt the segment ``name`` (no process start, no
    listeners), and for its CRC pass alone; the engine removes the segment after."""
    from embcache.service.config import Settings
    from embcache.service.engine import CacheEngine

    s = Settings(host_pool_bytes=gib * GiB, shm_name=name, device="cpu", max_entry_bytes=64 * MiB)
    t0 = time.perf_counter()
    engine = CacheEngine(s, defer_verify=True)
    warm = time.perf_counter() - t0
    try:
        assert engine.adopted.entries == entries, engine.adopted
        assert engine.verifier is not None
        t0 = time.perf_counter()
        engine.start_verifier()
        engine.verifier.thread.join()
        return warm, time.perf_counter() - t0
    finally:
        engine.close()


def adoption_per_entry(entries: int = PAGES_64G) -> dict[str, float]:
    """Replay + adopt an index of ``entries`` one-page entries, in process (no daemon)."""
    from embcache.service.config import Settings
    from embcache.service.engine import CacheEngine
    from embcache.service.host.pool_index import index_path, replay

    page = 4096
    name = f"embcache-bench-adopt-{uuid.uuid4().hex[:8]}"
    s = Settings(
        host_pool_bytes=entries * page,
        page_bytes=page,
        shm_name=name,
        device="cpu",
        max_entries=entries + 16,
        max_key_bytes=64,
    )
    try:
        with CacheEngine(s) as engine:
            one = torch.zeros(page // 4, dtype=torch.float32)
            for i in range(entries):
                engine.put(f"entry-key-{i:08d}", one)
            engine.close(keep_segment=True)
        path = index_path(Path("/dev/shm", name))
        t0 = time.perf_counter()
        replay(path)
        replay_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        engine = CacheEngine(s)
        adopt_s = time.perf_counter() - t0
        assert engine.adopted.entries == entries, engine.adopted
        engine.close()
    finally:
        for suffix in ("", ".index", ".index.tmp"):
            Path("/dev/shm", name + suffix).unlink(missing_ok=True)
    return {
        "entries": entries,
        "replay_s": replay_s,
        "engine_start_with_adopt_s": adopt_s,
        "per_entry_us": adopt_s / entries * 1e6,
    }


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares ``(base, slope)`` of ys over xs."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else 0.0
    return my - slope * mx, slope


def extrapolate(rows: list[dict[str, Any]], adopt: dict[str, float]) -> dict[str, float]:
    """64 GiB = the process floor (warm ready minus the engine's own adoption, the largest
    over the sizes run: imports, listeners; it does not grow with the pool) + the engine's
    adoption time's least-squares line over GiB at 64 (4 MiB entries), and for the worst
    case + the per-entry adoption cost times one entry per 256 KiB page. The CRC pass runs
    after the ready line: its GiB/s (alone, in process) gives its length for 64 GiB."""
    floor = max(r["warm_ready_s"] - r["engine_warm_s"] for r in rows)
    base, slope = _line([r["pool_gib"] for r in rows], [r["engine_warm_s"] for r in rows])
    at64 = floor + base + slope * 64
    worst = at64 + adopt["per_entry_us"] * PAGES_64G / 1e6
    rate = min(r["entries"] * ENTRY / r["engine_verify_s"] for r in rows) / GiB  # GiB/s
    return {
        "process_floor_s": floor,
        "engine_adopt_slope_s_per_gib": slope,
        "warm_ready_64gib_4mib_entries_s": at64,
        "warm_ready_64gib_262144_entries_s": worst,
        "crc_pass_gib_s": rate,
        "verify_64gib_after_ready_s": 64 / rate,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes-gib", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--adopt-entries", type=int, default=PAGES_64G)
    args = ap.parse_args()
    tmp = Path("/tmp") / f"embcache-bench-restart-{os.getpid()}"
    tmp.mkdir(exist_ok=True)
    rows = [one_size(g, tmp) for g in args.sizes_gib]
    adopt = adoption_per_entry(args.adopt_entries)
    ext = extrapolate(rows, adopt)
    print(
        f"commit {git_commit()} | {platform.processor() or platform.machine()} | "
        f"{os.cpu_count()} CPUs | python {sys.version.split()[0]}"
    )
    print(
        f"{'pool':>6} {'entries':>8} {'cold ready':>11} {'warm ready':>11} "
        f"{'engine warm':>12} {'CRC pass':>9} {'CRC alone':>10}"
    )
    for r in rows:
        print(
            f"{r['pool_gib']:>4}Gi {r['entries']:>8} {r['cold_ready_s']:>10.2f}s "
            f"{r['warm_ready_s']:>10.2f}s {r['engine_warm_s']:>11.3f}s "
            f"{r['verify_after_ready_s']:>8.2f}s {r['engine_verify_s']:>9.2f}s"
        )
    print(
        f"adoption of {adopt['entries']} entries in process: replay {adopt['replay_s']:.2f} s, "
        f"engine start {adopt['engine_start_with_adopt_s']:.2f} s "
        f"({adopt['per_entry_us']:.1f} us/entry)"
    )
    print(
        f"64 GiB (extrapolated): process floor {ext['process_floor_s']:.2f} s + adoption "
        f"{ext['engine_adopt_slope_s_per_gib'] * 1e3:.1f} ms/GiB: warm ready "
        f"{ext['warm_ready_64gib_4mib_entries_s']:.2f} s with 4 MiB entries, "
        f"{ext['warm_ready_64gib_262144_entries_s']:.2f} s with 262,144 entries; CRC pass "
        f"{ext['verify_64gib_after_ready_s']:.1f} s after ready (background, "
        f"{ext['crc_pass_gib_s']:.1f} GiB/s)"
    )
    RESULTS.mkdir(exist_ok=True)
    out = {
        "commit": git_commit(),
        "cpus": os.cpu_count(),
        "rows": rows,
        "adoption": adopt,
        "extrapolated_64gib": ext,
    }
    (RESULTS / "restart_cpu.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
