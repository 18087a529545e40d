"""Several GPUs on one node: host -> GPU bandwidth to one GPU and to all at once, GPU -> GPU
bandwidth next to the rates the engine calibrated, get_to_device latency of an entry resident
on the other GPU against a host copy and a resident hit, and the NUMA layout.

    python bench/multi_gpu.py [--reps 10] [--iters 200] [--ipc-mode fd|legacy] [--out-dir DIR]

One in-process engine serves every visible GPU (``gpus=all``). Baselines are measured in the
same run: torch ``copy_`` from pinned memory (one GPU, then every GPU at once, each on its own
stream) and torch peer ``copy_`` of 64 MiB. Engine batches are 16 x 4 MiB entries in one-page
(256 KiB) host runs. With fewer than two GPUs it says so, writes a JSON saying why and exits 0.
JSON goes to bench/results/multi_gpu.json (or --out-dir).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import environment, git_commit, print_environment, table

from embcache.service.config import Settings
from embcache.service.device.routing import HOST, PeerRates
from embcache.service.engine import CacheEngine

MiB = 1 << 20
PAGE = 256 * 1024
ENTRY = 4 * MiB
BATCH = 16
RAW_BYTES = 256 * MiB  # per GPU, host -> GPU baseline
PEER_BYTES = 64 * MiB
WARMUP = 5


# ---------------------------------------------------------------------------- NUMA


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def _command(argv: list[str]) -> str | None:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout


def _sysfs_pci(bus_id: str) -> str:
    """``00000000:18:00.0`` (nvidia-smi) -> ``0000:18:00.0`` (sysfs: 4-digit domain)."""
    domain, _, rest = bus_id.strip().lower().partition(":")
    return f"{domain[-4:]}:{rest}"


def numa_layout(count: int) -> dict[str, Any]:
    """NUMA nodes, each GPU's PCI address and node (matched to torch's index by uuid), and
    ``nvidia-smi topo -m``. Anything that cannot be read is None."""
    smi = _command(
        ["nvidia-smi", "--query-gpu=index,uuid,pci.bus_id,name", "--format=csv,noheader"]
    )
    rows: dict[str, list[str]] = {}
    for line in (smi or "").splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 3:
            rows[parts[1]] = parts
    gpus = []
    for i in range(count):
        gpu_uuid = "GPU-" + str(torch.cuda.get_device_properties(i).uuid)
        row = rows.get(gpu_uuid)
        sysfs = _sysfs_pci(row[2]) if row else None
        node = _read(f"/sys/bus/pci/devices/{sysfs}/numa_node") if sysfs else None
        gpus.append(
            {
                "cuda_index": i,
                "uuid": gpu_uuid,
                "nvidia_smi_index": row[0] if row else None,
                "pci_bus_id": row[2] if row else None,
                "sysfs_pci": sysfs,
                "numa_node": int(node) if node and node.lstrip("-").isdigit() else node,
                "local_cpulist": _read(f"/sys/bus/pci/devices/{sysfs}/local_cpulist")
                if sysfs
                else None,
            }
        )
    return {
        "nodes_online": _read("/sys/devices/system/node/online"),
        "cpus_allowed": len(os.sched_getaffinity(0)),
        "mems_allowed": next(
            (
                line.split(":", 1)[1].strip()
                for line in (_read("/proc/self/status") or "").splitlines()
                if line.startswith("Mems_allowed_list")
            ),
            None,
        ),
        "gpus": gpus,
        "nvidia_smi_topo": _command(["nvidia-smi", "topo", "-m"]),
    }


# ---------------------------------------------------------------------------- raw copies


def _median_s(fn: Callable[[], float], reps: int) -> float:
    fn()  # warm-up
    return statistics.median(fn() for _ in range(reps))


def raw_host_to_gpus(count: int, reps: int) -> dict[str, Any]:
    """GB/s of one contiguous pinned -> GPU copy per GPU: each GPU alone, then all at once
    (every GPU's copy queued on its own stream, then all waited for)."""
    hosts = [torch.empty(RAW_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(count)]
    devs = [torch.empty(RAW_BYTES, dtype=torch.uint8, device=f"cuda:{i}") for i in range(count)]
    streams = [torch.cuda.Stream(device=i) for i in range(count)]

    def copy(gpus: Sequence[int]) -> float:
        t0 = time.perf_counter()
        for i in gpus:
            with torch.cuda.stream(streams[i]):
                devs[i].copy_(hosts[i], non_blocking=True)
        for i in gpus:
            streams[i].synchronize()
        return time.perf_counter() - t0

    alone = {i: RAW_BYTES / _median_s(partial(copy, [i]), reps) / 1e9 for i in range(count)}
    together = count * RAW_BYTES / _median_s(partial(copy, range(count)), reps) / 1e9
    return {"bytes_per_gpu": RAW_BYTES, "alone_GBps": alone, "all_at_once_GBps": together}


def raw_peer(count: int, reps: int) -> dict[str, Any]:
    """GB/s of a 64 MiB torch ``copy_`` from each GPU to each other GPU."""
    bufs = [torch.empty(PEER_BYTES, dtype=torch.uint8, device=f"cuda:{i}") for i in range(count)]

    def copy(src: int, dst: int) -> float:
        t0 = time.perf_counter()
        bufs[dst].copy_(bufs[src], non_blocking=True)
        torch.cuda.synchronize(src)
        torch.cuda.synchronize(dst)
        return time.perf_counter() - t0

    out: dict[str, Any] = {}
    for src in range(count):
        for dst in range(count):
            if src != dst:
                seconds = _median_s(partial(copy, src, dst), reps)
                out[f"{src}->{dst}"] = {
                    "GBps": PEER_BYTES / seconds / 1e9,
                    "peer_access": bool(torch.cuda.can_device_access_peer(src, dst)),
                }
    return out


# ---------------------------------------------------------------------------- engine


def make_engine(count: int, ipc_mode: str) -> CacheEngine:
    host = max(1024 * MiB, count * 2 * BATCH * ENTRY + 256 * MiB)
    s = Settings(
        host_pool_bytes=host,
        page_bytes=PAGE,
        device_pool_bytes=512 * MiB,
        device_page_bytes=PAGE,
        shm_name=f"embcache-bench-{uuid.uuid4().hex[:8]}",
        device="cuda",
        gpus="all",
        ipc_mode=ipc_mode,
        max_entry_bytes=64 * MiB,
    )
    return CacheEngine(s)


def fill_fragmented(e: CacheEngine, count: int) -> list[list[str]]:
    """Fill the host pool with one-page fillers, free every other one of the first pages,
    then put one batch per GPU: every entry lands in one-page runs."""
    one = torch.zeros(PAGE, dtype=torch.uint8)
    for i in range(e.host_pool.num_pages):
        e.put(f"filler-{i}", one)
    e.evict([f"filler-{i}" for i in range(0, 2 * count * BATCH * ENTRY // PAGE, 2)])
    sets = []
    for g in range(count):
        keys = []
        for j in range(BATCH):
            gen = torch.Generator().manual_seed(1000 * g + j)
            e.put(f"entry-{g}-{j}", torch.randn(ENTRY // 2, generator=gen).to(torch.bfloat16))
            keys.append(f"entry-{g}-{j}")
        sets.append(keys)
    info = e.entry_info(sets[-1][-1])
    assert info is not None and len(info.page_runs) == ENTRY // PAGE, "batch is not fragmented"
    return sets


def _evict_pool(e: CacheEngine, device: int) -> None:
    pool = e.device_tier.pools[device]
    with e._gate:
        pool.evict_unleased()
    assert pool.stream is not None
    pool.stream.synchronize()


def cold_get(e: CacheEngine, keys: list[str], device: int) -> float:
    """Seconds of one get_to_device of ``keys`` on ``device`` with nothing resident there."""
    _evict_pool(e, device)
    t0 = time.perf_counter()
    results, _ = e.device.get(keys, f"bench{device}", device=device)
    seconds = time.perf_counter() - t0
    assert all(r is not None and not r.resident_hit for r in results)
    e.release(r.lease.lease_id for r in results if r is not None)
    return seconds


def cold_get_all(e: CacheEngine, sets: list[list[str]]) -> tuple[float, list[float]]:
    """One cold batch per GPU, from one thread per GPU started together: (aggregate GB/s
    from the first start to the last end, each GPU's GB/s)."""
    count = len(sets)
    barrier = threading.Barrier(count, timeout=60)
    starts, ends = [0.0] * count, [0.0] * count
    errors: list[BaseException] = []

    def work(g: int) -> None:
        try:
            _evict_pool(e, g)
            barrier.wait()
            starts[g] = time.perf_counter()
            results, _ = e.device.get(sets[g], f"bench{g}", device=g)
            ends[g] = time.perf_counter()
            e.release(r.lease.lease_id for r in results if r is not None)
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=work, args=(g,)) for g in range(count)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise RuntimeError(f"a loader thread failed: {errors[0]!r}") from errors[0]
    nbytes = BATCH * ENTRY
    per_gpu = [nbytes / (ends[g] - starts[g]) / 1e9 for g in range(count)]
    return count * nbytes / (max(ends) - min(starts)) / 1e9, per_gpu


def engine_host_to_gpus(e: CacheEngine, sets: list[list[str]], reps: int) -> dict[str, Any]:
    count = len(sets)
    nbytes = BATCH * ENTRY
    for g in range(count):  # warm-up: kernels compile and load on every GPU
        for _ in range(3):
            cold_get(e, sets[g], g)
    alone = {
        g: nbytes / statistics.median(cold_get(e, sets[g], g) for _ in range(reps)) / 1e9
        for g in range(count)
    }
    cold_get_all(e, sets)
    runs = [cold_get_all(e, sets) for _ in range(reps)]
    return {
        "batch": f"{BATCH} x {ENTRY // MiB} MiB, one-page host runs",
        "alone_GBps": alone,
        "all_at_once_GBps": statistics.median(r[0] for r in runs),
        "all_at_once_per_gpu_GBps": [
            statistics.median(r[1][g] for r in runs) for g in range(count)
        ],
    }


def engine_peer_batch(
    e: CacheEngine, keys: list[str], src: int, dst: int, reps: int
) -> dict[str, float]:
    """GB/s of a cold get_to_device on ``dst`` of a batch resident on ``src``: copied
    GPU-to-GPU (rates forced), and from the host (rates that never pick a peer)."""
    tier = e.device_tier
    calibrated = tier.rates
    results, _ = e.device.get(keys, "src", device=src)  # resident on src (a hit if it was)
    e.release(r.lease.lease_id for r in results if r is not None)
    nbytes = sum(r.lease.nbytes for r in results if r is not None)
    out: dict[str, float] = {"peer_forced_GBps": float("nan")}
    cases = [("host", PeerRates({}))]
    if (src, dst) in calibrated.rates:  # a pair calibration could not copy has no peer path
        cases.insert(0, ("peer_forced", PeerRates({(HOST, dst): 1.0, (src, dst): 100.0})))
    try:
        for name, rates in cases:
            tier.rates = rates
            before = e.stats().bytes_copied["d2d"]
            cold_get(e, keys, dst)
            out[f"{name}_GBps"] = (
                nbytes / statistics.median(cold_get(e, keys, dst) for _ in range(reps)) / 1e9
            )
            moved = e.stats().bytes_copied["d2d"] - before
            assert (moved > 0) == (name == "peer_forced"), (name, moved)
    finally:
        tier.rates = calibrated
    return out


def get_latency(e: CacheEngine, key: str, device: int, iters: int, *, cold: bool) -> dict[str, Any]:
    """p50/p99 microseconds of get_to_device([key]) (the release is not timed); ``cold``:
    ``device``'s pool is emptied (that pool only) before each call."""
    lat = []
    before = e.stats().bytes_copied
    for i in range(iters + WARMUP):
        if cold:
            _evict_pool(e, device)
        t0 = time.perf_counter()
        [r], _ = e.device.get([key], "lat", device=device)
        seconds = time.perf_counter() - t0
        assert r is not None and r.resident_hit == (not cold)
        e.release([r.lease.lease_id])
        if i >= WARMUP:
            lat.append(seconds * 1e6)
    after = e.stats().bytes_copied
    lat.sort()
    moved = {d: after[d] - before[d] for d in ("h2d", "d2d")}
    path = "resident" if not cold else ("d2d" if moved["d2d"] else "h2d")
    return {
        "p50_us": lat[len(lat) // 2],
        "p99_us": lat[min(len(lat) - 1, int(0.99 * len(lat)))],
        "path": path,
        "iters": iters,
    }


def latencies(e: CacheEngine, iters: int) -> dict[str, Any]:
    """1 x 4 MiB into GPU 0: resident on GPU 1 (peer forced; the calibrated choice), resident
    nowhere (host copy), resident on GPU 0 (hit)."""
    tier = e.device_tier
    calibrated = tier.rates
    gen = torch.Generator().manual_seed(7)
    for key in ("lat-peer", "lat-host"):
        e.put(key, torch.randn(ENTRY // 2, generator=gen).to(torch.bfloat16))
    [r], _ = e.device.get(["lat-peer"], "src", device=1)
    assert r is not None
    e.release([r.lease.lease_id])
    out: dict[str, Any] = {"dst_gpu": 0, "src_gpu": 1, "entry_bytes": ENTRY}
    try:
        if (1, 0) in calibrated.rates:  # else calibration found no peer path 1 -> 0
            tier.rates = PeerRates({(HOST, 0): 1.0, (1, 0): 100.0})
            out["on_gpu1_peer_forced"] = get_latency(e, "lat-peer", 0, iters, cold=True)
        tier.rates = calibrated
        out["on_gpu1_calibrated_choice"] = get_latency(e, "lat-peer", 0, iters, cold=True)
        out["host_hit"] = get_latency(e, "lat-host", 0, iters, cold=True)
        out["resident_hit"] = get_latency(e, "lat-host", 0, iters, cold=False)
    finally:
        tier.rates = calibrated
    return out


# ---------------------------------------------------------------------------- main


def summary_rows(
    count: int,
    raw_h2d: dict[str, Any],
    peer: dict[str, Any],
    rates: dict[str, float],
    eng: dict[str, Any],
    eng_peer: dict[str, float],
) -> list[tuple[str, float, str]]:
    """(measurement, GB/s, how it compares with its baseline from this run)."""
    rows: list[tuple[str, float, str]] = []
    alone = raw_h2d["alone_GBps"]
    for g in range(count):
        rows.append((f"H2D copy_ 256 MiB pinned, GPU {g} alone (baseline)", alone[g], "100%"))
        cal = rates.get(f"host->{g}", float("nan"))
        rows.append((f"  engine calibration, host -> GPU {g}", cal, f"{cal / alone[g]:.0%}"))
    together = raw_h2d["all_at_once_GBps"]
    rows.append(
        (
            f"H2D copy_ 256 MiB pinned, all {count} GPUs at once (aggregate)",
            together,
            f"{together / sum(alone.values()):.0%} of the sum alone",
        )
    )
    for g in range(count):
        got = eng["alone_GBps"][g]
        rows.append(
            (f"get_to_device 16x4 MiB fragmented, GPU {g} alone", got, f"{got / alone[g]:.0%}")
        )
    got = eng["all_at_once_GBps"]
    rows.append(
        (
            f"get_to_device 16x4 MiB fragmented, all {count} GPUs at once (aggregate)",
            got,
            f"{got / together:.0%} of H2D all at once",
        )
    )
    for pair, p in peer.items():
        s, d = pair.split("->")
        rows.append((f"peer copy_ 64 MiB GPU {s} -> GPU {d} (baseline)", p["GBps"], "100%"))
        measured = rates.get(pair)
        rows.append(
            (
                f"  engine calibration, GPU {s} -> GPU {d}",
                float("nan") if measured is None else measured,
                "no peer path" if measured is None else f"{measured / p['GBps']:.0%}",
            )
        )
    got = eng_peer["peer_forced_GBps"]
    rows.append(
        (
            "get_to_device 16x4 MiB into GPU 0, resident on GPU 1 (peer, forced)",
            got,
            f"{got / peer['1->0']['GBps']:.0%} of peer copy_ 1 -> 0",
        )
    )  # nan when calibration found no peer path 1 -> 0
    got = eng_peer["host_GBps"]
    rows.append(
        (
            "get_to_device 16x4 MiB into GPU 0 from the host (same batch)",
            got,
            f"{got / alone[0]:.0%}",
        )
    )
    return rows


def save(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"saved {path}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--iters", type=int, default=200, help="latency samples per case")
    ap.add_argument("--ipc-mode", choices=("fd", "legacy"), default="fd")
    ap.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    args = ap.parse_args()
    path = args.out_dir / "multi_gpu.json"
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < 2:
        reason = f"needs at least 2 visible CUDA GPUs, found {count}"
        print(f"multi_gpu: {reason}; nothing measured", flush=True)
        save(
            path,
            {
                "skipped": True,
                "reason": reason,
                "device_count": count,
                "commit": git_commit(),
                "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            },
        )
        return
    t_start = time.perf_counter()
    env = environment()
    env["gpus"] = [torch.cuda.get_device_name(i) for i in range(count)]
    print_environment(env)
    numa = numa_layout(count)
    print(f"NUMA nodes online: {numa['nodes_online']}; CPUs allowed: {numa['cpus_allowed']}")
    for g in numa["gpus"]:
        print(f"  cuda:{g['cuda_index']}  {g['pci_bus_id']}  NUMA node {g['numa_node']}")
    if numa["nvidia_smi_topo"]:
        print(numa["nvidia_smi_topo"].rstrip())

    raw_h2d = raw_host_to_gpus(count, args.reps)
    peer = raw_peer(count, args.reps)
    torch.cuda.empty_cache()
    with make_engine(count, args.ipc_mode) as e:
        rates = {
            f"{'host' if s == HOST else s}->{d}": r
            for (s, d), r in e.device_tier.rates.rates.items()
        }
        sets = fill_fragmented(e, count)
        eng = engine_host_to_gpus(e, sets, args.reps)
        eng_peer = engine_peer_batch(e, sets[1], 1, 0, args.reps)
        e.evict_bytes(e.host_pool.nbytes)  # everything out: the latency entries are one run
        lat = latencies(e, args.iters)

    rows = summary_rows(count, raw_h2d, peer, rates, eng, eng_peer)
    print(table(["measurement", "GB/s", "vs baseline"], rows))
    lat_rows = [
        (name, v["p50_us"], v["p99_us"], v["path"])
        for name, v in lat.items()
        if isinstance(v, dict)
    ]
    print(f"get_to_device 1 x 4 MiB into GPU 0, {args.iters} calls each (us):")
    print(table(["case", "p50", "p99", "copied by"], lat_rows))
    results = {
        "env": env,
        "ipc_mode": args.ipc_mode,
        "numa": numa,
        "raw_h2d": raw_h2d,
        "raw_peer": peer,
        "calibrated_rates_GBps": rates,
        "get_to_device_h2d": eng,
        "get_to_device_peer_batch": eng_peer,
        "latency": lat,
        "seconds": time.perf_counter() - t_start,
    }
    print(f"total {results['seconds']:.0f} s")
    save(path, results)


if __name__ == "__main__":
    main()
