"""Shared benchmark helpers: environment facts, timing, tables and JSON results."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def gpu_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def driver_version() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
        return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return "unknown"


def git_commit() -> str:
    """The commit benchmarked: ``EMBCACHE_GIT_COMMIT`` (set where the tree has no .git), or git."""
    if env := os.environ.get("EMBCACHE_GIT_COMMIT"):
        return env
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
            cwd=Path(__file__).resolve().parent,
        )
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def environment() -> dict[str, Any]:
    import triton

    return {
        "gpu": gpu_name(),
        "driver": driver_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "commit": git_commit(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def print_environment(env: dict[str, Any]) -> None:
    print(" | ".join(f"{k} {v}" for k, v in env.items()), flush=True)


def time_gpu_ms(
    fn: Callable[[], object], stream: torch.cuda.Stream, *, reps: int = 10, warmup: int = 2
) -> float:
    """Milliseconds per call of ``fn`` issued ``reps`` times back to back on ``stream``, timed
    with events (host work of one call overlaps the GPU work of the previous one, as in a busy
    daemon). Slow (host-bound) calls get fewer repeats."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    if time.perf_counter() - t0 > 0.05:
        reps = min(reps, 3)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    for _ in range(reps):
        fn()
    end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) / reps


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain fixed-width table."""
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def save_json(name: str, data: dict[str, Any], out_dir: Path | None = None) -> Path:
    """Write ``<name>_<gpu>.json`` under ``out_dir`` (default ``bench/results``)."""
    out_dir = out_dir or RESULTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^a-z0-9]+", "_", gpu_name().lower()).strip("_")
    path = out_dir / f"{name}_{slug}.json"
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    print(f"saved {path}", flush=True)
    return path


def latencies_us(fn: Callable[[], object], iters: int, warmup: int = 1) -> list[float]:
    """Microseconds of ``iters`` calls of ``fn`` after ``warmup`` untimed ones, sorted."""
    for _ in range(warmup):
        fn()
    lat = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        lat.append((time.perf_counter() - t0) * 1e6)
    return sorted(lat)


def thread_cpu_ns(pid: int) -> dict[int, int]:
    """CPU time (ns) each thread of process ``pid`` has used so far (Linux schedstat)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                out[int(tid)] = int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):  # the thread ended meanwhile
            continue
    return out


class CpuMeter:
    """Cores each process used over a window: ``with CpuMeter({"daemon": pid}) as m: ...``,
    then ``m.cores()``: {name: cores, name + "_busiest_thread": cores} (1.0: one core busy
    all the time). A process whose busiest thread is near 1.0 is saturated: its Python (one
    GIL) is the limit, not the copies it waits for. Another process's threads count when
    they live at both ends of the window; this process counts whole."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self._before: dict[str, dict[int, int]] = {}
        self._after: dict[str, dict[int, int]] = {}
        self._wall = 0.0
        self._own = 0

    def __enter__(self) -> CpuMeter:
        self._before = {name: thread_cpu_ns(pid) for name, pid in self.pids.items()}
        self._own = time.process_time_ns()
        self._wall = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self._wall = time.perf_counter() - self._wall
        self._own = time.process_time_ns() - self._own
        self._after = {name: thread_cpu_ns(pid) for name, pid in self.pids.items()}

    def cores(self) -> dict[str, float]:
        out = {}
        for name, after in self._after.items():
            before = self._before[name]
            used = {tid: ns - before.get(tid, 0) for tid, ns in after.items()}
            total = self._own if self.pids[name] == os.getpid() else sum(used.values())
            out[name] = total / 1e9 / self._wall
            out[f"{name}_busiest_thread"] = max(used.values(), default=0) / 1e9 / self._wall
        return out
