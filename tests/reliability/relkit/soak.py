"""The soak: N producers and N consumers against one daemon with a small host pool.

Producers put checksummed payloads (``payload.py``) of sizes drawn from ``sizes_mib``;
consumers get batches of recent keys, half as zero-copy views under leases and half as
copies, and check every byte; they sometimes hold the views' leases while the pool churns
and check again. Stats are read over REST every second. After every client has exited: no
lease, nothing filling, and after an evict-all not one page in use.
"""

from __future__ import annotations

import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import daemon as dm
from .workers import Worker, finish, spawn


@dataclass(frozen=True)
class SoakConfig:
    producers: int = 2
    consumers: int = 2
    seconds: float = 20.0
    pool: str = "64MiB"
    pool_bytes: int = 64 << 20
    sizes_mib: tuple[float, ...] = (0.5, 1, 4, 16)
    lease_ttl_s: float = 3.0
    hold_prob: float = 0.1
    keep_prob: float = 0.05  # keep a batch's views after their block (issue 28, item 2)
    seed: int = 1234
    device: str | None = None  # "cuda": producers put CUDA tensors, consumers get to the GPU
    daemon_device: str = "cpu"
    daemon_extra: tuple[str, ...] = ()


FULL = SoakConfig(producers=16, consumers=16, seconds=60.0, pool="256MiB", pool_bytes=256 << 20)
CI = SoakConfig()


class Sampler(threading.Thread):
    """Reads /v1/stats every ``period`` seconds and keeps what the figures need."""

    def __init__(self, daemon: dm.Daemon, period: float = 1.0) -> None:
        super().__init__(name="soak-sampler", daemon=True)
        self.daemon_proc = daemon
        self.period = period
        self.samples: list[dict[str, Any]] = []
        self.errors = 0
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(self.period):
            try:
                s = self.daemon_proc.stats()
            except Exception:
                self.errors += 1
                continue
            host = s["host"]
            self.samples.append(
                {
                    "t": time.monotonic(),
                    "used": host["used_bytes"],
                    "capacity": host["capacity_bytes"],
                    "pages_ok": host["used_pages"] + host["free_pages"] == host["total_pages"],
                    "leases": s["leases_active"],
                    "filling": s["entries_filling"],
                    "reserved": s["reserved_filling_bytes"],
                    "put_bytes": s["put_bytes"],
                }
            )

    def stop(self) -> None:
        self._halt.set()
        self.join(10)


Hook = Callable[[dm.Daemon], dict[str, Any]]


def run_soak(
    cfg: SoakConfig,
    workdir: Path | None = None,
    *,
    on_ready: Hook | None = None,
    on_end: Hook | None = None,
) -> dict[str, Any]:
    """Run one soak and return its figures (``violations`` lists what must be empty).

    ``on_ready(daemon)`` runs before the workers start (e.g. baselines), ``on_end(daemon)``
    after they all exited, before the daemon stops; their dicts join the figures."""
    with tempfile.TemporaryDirectory(prefix="ecsoak-", dir=workdir) as tmp:
        return _run(cfg, Path(tmp), on_ready, on_end)


def _run(cfg: SoakConfig, tmp: Path, on_ready: Hook | None, on_end: Hook | None) -> dict[str, Any]:
    spec = dm.DaemonSpec(
        tmp,
        pool=cfg.pool,
        lease_ttl_s=cfg.lease_ttl_s,
        device=cfg.daemon_device,
        extra=cfg.daemon_extra,
    )
    d = dm.start(spec)
    extra: dict[str, Any] = on_ready(d) if on_ready else {}
    published = tmp / "published.i64"
    np.memmap(published, dtype=np.int64, mode="w+", shape=(cfg.producers,))[:] = -1
    workers: list[Worker] = []
    base = {
        "prefix": "soak",
        "published": str(published),
        "n_producers": cfg.producers,
        "seconds": cfg.seconds,
        "wait_go": True,
    }
    try:
        for i in range(cfg.producers):
            target = d.unix if i % 2 else d.tcp
            w_cfg = {
                **base,
                "mode": "producer",
                "target": target,
                "device": cfg.device,
                "index": i,
                "seed": cfg.seed + i,
                "sizes_mib": list(cfg.sizes_mib),
            }
            workers.append(spawn(w_cfg, tmp, f"producer-{i}"))
        for i in range(cfg.consumers):
            target = d.unix if i % 2 == 0 else d.tcp  # zero-copy works over both
            w_cfg = {
                **base,
                "mode": "consumer",
                "target": target,
                "device": cfg.device,
                "seed": cfg.seed + 1000 + i,
                "hold_prob": cfg.hold_prob,
                "keep_prob": cfg.keep_prob,
                "keep_s": 1.5 * cfg.lease_ttl_s,  # past a TTL: only renewals keep them
                "keep_bytes": cfg.pool_bytes // 8,
            }
            workers.append(spawn(w_cfg, tmp, f"consumer-{i}"))
        for w in workers:
            w.expect("ready", 120)
        sampler = Sampler(d)
        sampler.start()
        t0 = time.monotonic()
        for w in workers:
            w.send("go")
        try:
            finish(workers, cfg.seconds + 120)
        finally:
            sampler.stop()
        wall = time.monotonic() - t0
        figures = _figures(cfg, d, workers, sampler, wall)
        if on_end is not None:
            figures.update(on_end(d))
        figures.update(extra)
    finally:
        for w in workers:
            dm.reap(w.proc)
        figures_exit = dm.stop(d)
    figures["daemon_exit_code"] = figures_exit
    figures["segment_removed"] = not d.shm_path.exists()
    dm.discard(d)  # (nothing to do after a clean stop)
    if figures_exit != 0 or not figures["segment_removed"]:
        figures["violations"].append("daemon did not stop cleanly")
    return figures


def _figures(
    cfg: SoakConfig, d: dm.Daemon, workers: list[Worker], sampler: Sampler, wall: float
) -> dict[str, Any]:
    total: Counter[str] = Counter()
    for w in workers:
        total.update({k: v for k, v in w.done.items() if isinstance(v, int)})
    errors = {k.removeprefix("error:"): v for k, v in total.items() if k.startswith("error:")}
    # All clients are gone: their sessions ended, so every lease must be back now.
    settle = dm.wait_for(lambda: dm.quiescent(d.stats()), 15.0)
    end = d.stats()
    leased = d.rest("/v1/entries?state=leased&limit=1")["total"]
    d.rest("/v1/evict", method="POST", json={"bytes": cfg.pool_bytes})
    after_evict = d.stats()
    over = sum(s["used"] > s["capacity"] or not s["pages_ok"] for s in sampler.samples)
    put_bytes = end["put_bytes"]
    figures: dict[str, Any] = {
        "producers": cfg.producers,
        "consumers": cfg.consumers,
        "seconds": round(wall, 1),
        "pool_bytes": cfg.pool_bytes,
        "puts": total["puts"],
        "reputs": total["reputs"],
        "new_puts_not_created": total["puts_not_created"],
        "gets": total["gets"],
        "view_gets": total["view_gets"],
        "get_bytes_calls": total["get_bytes"],
        "hits": total["hits"],
        "misses": total["misses"],
        "views_verified": total["verified"],
        "zero_copy_views": total["zero_copy"],
        "lease_holds": total["holds"],
        "views_kept_after_block": total["kept"],
        "kept_views_verified": total["kept_verified"],
        "bytes_put": put_bytes,
        "bytes_verified": total["verified_bytes"],
        "ops_per_s": round((total["puts"] + total["gets"] + total["get_bytes"]) / wall, 1),
        "mb_moved_per_s": round((put_bytes + total["verified_bytes"]) / wall / 1e6, 1),
        "pool_turnover": round(put_bytes / cfg.pool_bytes, 1),
        "evictions": end["evictions"],
        "checksum_mismatches": total["mismatches"],
        "stats_samples": len(sampler.samples),
        "stats_sample_errors": sampler.errors,
        "samples_used_over_capacity": over,
        "max_used_fraction": round(
            max((s["used"] / s["capacity"] for s in sampler.samples), default=0.0), 3
        ),
        "client_errors": errors,
        "unexpected_errors": total["unexpected"],
        "settle_s": None if settle is None else round(settle, 2),
        "leases_left": end["leases_active"],
        "leased_entries_left": leased,
        "filling_left": end["entries_filling"],
        "reserved_bytes_left": end["reserved_filling_bytes"],
        "pages_left_after_evict_all": after_evict["host"]["used_pages"],
        "entries_left_after_evict_all": after_evict["entries_ready"],
        "workers_nonzero_exit": sum(w.proc.returncode != 0 for w in workers),
        "device_pool_opens_max": max(
            (w.done.get("device_pool_opens", 0) for w in workers), default=0
        ),
    }
    figures["violations"] = violations(figures)
    return figures


def violations(f: dict[str, Any]) -> list[str]:
    checks = {
        "checksum mismatches": f["checksum_mismatches"],
        "samples with used > capacity": f["samples_used_over_capacity"],
        "leases left": f["leases_left"] + f["leased_entries_left"],
        "entries filling left": f["filling_left"],
        "bytes reserved left": f["reserved_bytes_left"],
        "pages in use after evict-all": f["pages_left_after_evict_all"],
        "unexpected client errors": f["unexpected_errors"],
        "workers failed": f["workers_nonzero_exit"],
        "new keys that already existed": f["new_puts_not_created"],
    }
    out = [f"{name}: {value}" for name, value in checks.items() if value]
    if f["settle_s"] is None:
        out.append("leases/reservations not back within 15 s")
    if not f["stats_samples"]:
        out.append("no stats samples")
    return out
