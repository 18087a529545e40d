"""How much a decoder's GEMM slows down while embcache loads batches beside it, with and
without MPS.

The GEMM (8192^3 bf16, get_to_device.GEMM) runs in a worker process of its own, as a decoder
does; a loader thread in this process runs one of the modes below back to back. Each number is
the GEMM's time while loading over its time alone. The baseline is the plain copy engine:
64 MiB contiguous host -> device copies from this process. The diagnostic modes separate DMA
from kernels: without MPS the GPU time-slices between processes' contexts, and any kernel of
ours takes a slice from the GEMM. Each pass runs in a child process: one plainly, one as a
client of an MPS control daemon this script starts with private pipe and log directories
(where nvidia-cuda-mps-control exists) and quits at the end.

    python bench/colocated_gemm.py [--seconds 2] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

MiB = 1 << 20
MODES = {
    "copy_engine": "contiguous copy engine, 64 MiB H2D back to back (baseline)",
    "copy_engine_kernel": "the same, plus one 1-element kernel per copy",
    "kernel_every_3ms": "one 1-element kernel every 3 ms, no copies",
    "embcache_auto": "embcache cold get_to_device, 16 x 4 MiB fragmented (auto)",
    "embcache_kernel": "the same with the Triton copy kernel (kernel backend)",
}


def modes() -> Iterator[tuple[str, Callable[[], object]]]:
    """Per mode, one step of the loader; an engine is open only during its mode."""
    import get_to_device as g
    import torch

    host = torch.empty(64 * MiB, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    tiny = torch.zeros(1, device="cuda")
    stream = torch.cuda.Stream()

    def copy(kernel: bool) -> None:
        with torch.cuda.stream(stream):
            dev.copy_(host, non_blocking=True)
            if kernel:
                tiny.add_(1)
        stream.synchronize()

    def kernel_every_3ms() -> None:
        with torch.cuda.stream(stream):
            tiny.add_(1)
        stream.synchronize()
        time.sleep(0.003)

    yield "copy_engine", functools.partial(copy, False)
    yield "copy_engine_kernel", functools.partial(copy, True)
    yield "kernel_every_3ms", kernel_every_3ms
    for backend in ("auto", "kernel"):
        with g.make_engine(backend) as engine:
            keys = g.fill_fragmented(engine)
            for _ in range(3):  # warm-up: compile, first touch
                g.cold_get(engine, keys)
            yield f"embcache_{backend}", functools.partial(g.cold_get, engine, keys)


def one_pass(seconds: float) -> dict[str, object]:
    """All modes, the GEMM in a worker process (run in a child: CUDA starts here)."""
    import get_to_device as g

    worker = g.GemmWorker()
    out: dict[str, object] = {}
    try:
        alone = worker(["alone"])
        out["gemm_alone_ms"] = alone
        for name, step in modes():
            busy, steps = g.while_loading(step, lambda: worker(["busy", str(seconds)]))
            out[name] = {"slowdown": busy / alone, "loader_steps": steps}
    finally:
        worker.close()
    return out


def child(seconds: float, env: dict[str, str]) -> dict[str, object]:
    proc = subprocess.run(
        [sys.executable, __file__, "--child", "--seconds", str(seconds)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"pass failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def under_mps(seconds: float) -> dict[str, object] | str:
    control = shutil.which("nvidia-cuda-mps-control")
    if control is None:
        return "nvidia-cuda-mps-control not found"
    tmp = tempfile.mkdtemp(prefix="ecb-mps-")
    env = dict(
        os.environ,
        CUDA_MPS_PIPE_DIRECTORY=os.path.join(tmp, "pipe"),
        CUDA_MPS_LOG_DIRECTORY=os.path.join(tmp, "log"),
    )
    os.makedirs(env["CUDA_MPS_PIPE_DIRECTORY"])
    os.makedirs(env["CUDA_MPS_LOG_DIRECTORY"])
    subprocess.run([control, "-d"], env=env, check=True, timeout=30)
    try:
        return child(seconds, env)
    finally:
        subprocess.run([control], input="quit\n", env=env, text=True, timeout=60)
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=2.0, help="GEMM timing per mode")
    ap.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    if args.child:
        print(json.dumps(one_pass(args.seconds)))
        return
    from _common import environment, print_environment

    env = environment()
    print_environment(env)
    plain = child(args.seconds, dict(os.environ))
    mps = under_mps(args.seconds)
    print(f"8192^3 bf16 GEMM in another process: alone {plain['gemm_alone_ms']:.3f} ms")
    w = max(len(v) for v in MODES.values())
    print(f"{'while loading':<{w}}  {'no MPS':>8}  {'MPS':>8}")
    for name, label in MODES.items():
        cell = mps[name]["slowdown"] if isinstance(mps, dict) else float("nan")  # type: ignore[index]
        print(f"{label:<{w}}  {plain[name]['slowdown']:7.3f}x  {cell:7.3f}x")  # type: ignore[index]
    if isinstance(mps, str):
        print(f"MPS: {mps}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / "colocated_gemm.json"
    path.write_text(json.dumps({"env": env, "no_mps": plain, "mps": mps}, indent=2) + "\n")
    print(f"saved {path}")


if __name__ == "__main__":
    main()
