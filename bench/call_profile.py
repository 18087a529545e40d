"""Where a small call's time goes, on both ends: the daemon's event-loop thread and the client
run under cProfile while the client repeats one call; prints each side's top functions by
own time, per call, and the wall p50 without the profiler next to a bare session call (an
empty Release, the floor of a call on the session socket) from the same run.

Calls: host get 64 KiB (view + release, and as copies after the result), put 64 KiB,
get_bytes 64 KiB and 4 MiB, and on a GPU the resident device hit (owned copy and zero_copy)
and a get_into. cProfile slows Python two- to threefold, so its numbers rank the costs; the
wall p50s are measured with it off.
``python3 bench/call_profile.py --out-dir DIR``; JSON to DIR/call_profile_<device>.json.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import git_commit, gpu_name

from embcache.clients import EmbCacheClient
from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.service.daemon_process import read_line, serve_command, stop

# The daemon under cProfile: its loop thread (the main thread) is profiled from SIGUSR1 to
# SIGUSR2, which writes the profile (the handlers run on the main thread).
PROFILED = r"""
import cProfile, signal, sys
from embcache.service.cli.app import app
out, argv = sys.argv[1], sys.argv[2:]
prof = cProfile.Profile()
signal.signal(signal.SIGUSR1, lambda *_: prof.enable())
def done(*_):
    prof.disable()
    prof.dump_stats(out)
signal.signal(signal.SIGUSR2, done)
app(argv, standalone_mode=False)
"""
KiB, MiB = 1 << 10, 1 << 20
TOP = 14


def top(stats: pstats.Stats, calls: int, n: int = TOP) -> list[dict[str, Any]]:
    """The ``n`` functions with the most own time, in microseconds per call of the loop."""
    rows = []
    for (file, line, name), (_, ncalls, tottime, cumtime, _) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append(
            {
                "function": f"{Path(file).name}:{line}({name})",
                "calls_per_op": round(ncalls / calls, 2),
                "own_us_per_op": round(tottime / calls * 1e6, 2),
                "cum_us_per_op": round(cumtime / calls * 1e6, 2),
            }
        )
    rows.sort(key=lambda r: -r["own_us_per_op"])
    return rows[:n]


def timed(fn: Callable[[], object], n: int) -> float:
    """p50 of ``fn`` in microseconds, after a warm-up of a fifth."""
    for _ in range(n // 5):
        fn()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


def cases(client: EmbCacheClient, cuda: bool) -> dict[str, Callable[[], object]]:
    client.put("small", torch.ones(16 * KiB))  # 64 KiB
    client.put("large", torch.ones(MiB))  # 4 MiB
    counter = iter(range(1 << 30))

    def get_view() -> None:
        with client.get(["small"]) as (t,):
            assert t is not None
        del t

    def get_copy() -> None:  # copies after the result, no lease (copy_gets_up_to)
        with client.get(["small"]) as (t,):
            assert t is not None
        del t

    out: dict[str, Callable[[], object]] = {
        "session call (empty Release)": lambda: _empty(client),
        "get 64 KiB (view)": get_view,
        "get 64 KiB (copies)": get_copy,
        "put 64 KiB": lambda: client.put(f"p{next(counter)}", torch.ones(16 * KiB)),
        "get_bytes 64 KiB": lambda: client.get_bytes("small"),
        "get_bytes 4 MiB": lambda: client.get_bytes("large"),
    }
    if cuda:
        with client.get(["large"], device="cuda"):  # resident from now on
            pass

        def hit(zero_copy: bool) -> Callable[[], None]:
            def run() -> None:
                with client.get(["large"], device="cuda", zero_copy=zero_copy) as (t,):
                    assert t is not None
                torch.cuda.current_stream().synchronize()

            return run

        out["device hit 4 MiB (owned copy)"] = hit(False)
        out["device hit 4 MiB (zero_copy)"] = hit(True)
        dest = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")

        def get_into() -> None:  # what a vLLM worker's load does: into its own buffer
            (r,) = client.get_into(["large"], dest)
            assert r.found

        out["device get_into 4 MiB"] = get_into
    return out


def _empty(client: EmbCacheClient) -> None:
    """One session call that does nothing: an empty Release on the session."""
    session = client._conn.open_session()
    session.call(client.timeout, release=pb.ReleaseRequest())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    ap.add_argument("--calls", type=int, default=600)
    ap.add_argument("--only", default="", help="profile only calls whose name contains this")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    tmp = Path(tempfile.mkdtemp(prefix="callprof-"))
    results: dict[str, Any] = {}
    names = [n for n in _names(cuda) if args.only in n]
    for i, name in enumerate(["session call (empty Release)", *names]):
        prof_file = tmp / f"daemon{i}.prof"
        flags = serve_command("--grpc-socket", str(tmp / "d.sock"), "--host-pool-bytes", "1GiB")
        flags = [sys.executable, "-c", PROFILED, str(prof_file), *flags[3:]]
        # on a GPU, a device pool: the device calls read from it (without one they would
        # fall back to a host get and a copy)
        flags += ["--device-pool-bytes", "1GiB"] if cuda else ["--device", "cpu"]
        proc = subprocess.Popen(flags, stdout=subprocess.PIPE, text=True)
        try:
            ready = json.loads(read_line(proc, '"event": "ready"', 180))
            assert ready["session_socket"]
            copies = 256 << 10 if "copies" in name else 0  # get as copies after the result
            target = f"unix:{tmp / 'd.sock'}"
            with EmbCacheClient(target, timeout=30, copy_gets_up_to=copies) as client:
                fns = cases(client, cuda)
                wall = timed(fns[name], args.calls)
                proc.send_signal(signal.SIGUSR1)
                time.sleep(0.5)  # the daemon's loop wakes at least that often
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(args.calls):
                    fns[name]()
                prof.disable()
                proc.send_signal(signal.SIGUSR2)
                _wait_for(prof_file)
        finally:
            stop(proc)
        client_top = top(pstats.Stats(prof), args.calls)
        daemon_stats = pstats.Stats(str(prof_file))
        total = args.calls  # the daemon's profile covers the profiled calls only
        results[name] = {
            "wall_p50_us": round(wall, 1),
            "client_top": client_top,
            "daemon_top": top(daemon_stats, total),
        }
        print(f"\n== {name}: p50 {wall:.0f} us without the profiler")
        for side in ("client_top", "daemon_top"):
            print(f"  {side} (us per call under cProfile: own / cumulative)")
            for r in results[name][side][:10]:
                print(f"    {r['own_us_per_op']:8.1f} {r['cum_us_per_op']:9.1f}  {r['function']}")
    out = {
        "bench": "call_profile",
        "device": gpu_name(),
        "commit": git_commit(),
        "calls": args.calls,
        "results": results,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    suffix = "h200" if cuda else "cpu"
    (args.out_dir / f"call_profile_{suffix}.json").write_text(json.dumps(out, indent=2))


def _wait_for(path: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)  # written whole


def _names(cuda: bool) -> list[str]:
    names = ["get 64 KiB (view)", "get 64 KiB (copies)", "put 64 KiB"]
    names += ["get_bytes 64 KiB", "get_bytes 4 MiB"]
    if cuda:
        names += [
            "device hit 4 MiB (owned copy)",
            "device hit 4 MiB (zero_copy)",
            "device get_into 4 MiB",
        ]
    return names


if __name__ == "__main__":
    main()
