"""The first same-node gets to a GPU after a client connects, while its mapping of the host
pool is being registered with CUDA, and the same gets once it is registered.

    python bench/first_get.py [--pool GiB] [--out-dir bench/results]

Starts a daemon (host pool of ``--pool`` GiB, no device pool: every get to the GPU is either
the client's own copy or the daemon's host path), puts one 4 MiB entry, then in a fresh
client process: the first ``get(device="cuda")`` after connect, every get for the first
second (served by calls until the entry's chunks are registered), the time until the whole
pool is registered and its cost per GiB, and the p50 of gets afterwards, next to one
contiguous pinned copy of 4 MiB (the floor) measured in the same process. Writes
``first_get_<gpu>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import environment, print_environment, save_json, table  # noqa: E402

CLIENT = """
import json, statistics, sys, time, torch
from embcache.clients import EmbCacheClient
from embcache.clients.device.registered import registered_pool
torch.cuda.init(); torch.empty(1, device="cuda")  # the CUDA context is not what is measured
src = torch.empty(4 << 20, dtype=torch.uint8).pin_memory()
dst = torch.empty(4 << 20, dtype=torch.uint8, device="cuda")
floor = []
for _ in range(50):
    t = time.perf_counter(); dst.copy_(src, non_blocking=True); torch.cuda.synchronize()
    floor.append(time.perf_counter() - t)
out = {"floor_us": statistics.median(floor) * 1e6}
t0 = time.perf_counter()
c = EmbCacheClient(sys.argv[1])
with c.get("e", device="cuda") as (x,):
    torch.cuda.synchronize()
out["first_get_us"] = (time.perf_counter() - t0) * 1e6
early = []
while time.perf_counter() - t0 < 1.0:
    t = time.perf_counter()
    with c.get("e", device="cuda") as (x,):
        pass
    early.append(time.perf_counter() - t)
out["first_second_gets"] = len(early)
out["first_second_p50_us"] = statistics.median(early) * 1e6
reg = registered_pool(c._tables.read_table().pool)
reg.wait_registered(600)
out["registered_after_s"] = time.perf_counter() - t0
out["registration"] = reg.stats()
late = []
for _ in range(200):
    t = time.perf_counter()
    with c.get("e", device="cuda") as (x,):
        pass
    late.append(time.perf_counter() - t)
out["registered_p50_us"] = statistics.median(late[20:]) * 1e6
c.close()
print(json.dumps(out))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pool", type=int, default=8, help="host pool size, GiB")
    ap.add_argument("--out-dir", type=Path, default=HERE / "results")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("bench/first_get.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from embcache.clients import EmbCacheClient
    from embcache.service.daemon_process import DaemonProcess

    env = environment()
    print_environment(env)
    with tempfile.TemporaryDirectory(prefix="ecfirst-") as tmp:
        sock = os.path.join(tmp, "d.sock")
        flags = ["--grpc-socket", sock, "--host-pool-bytes", f"{args.pool}GiB"]
        daemon = DaemonProcess([*flags, "--device-pool-bytes", "0"], timeout=300)
        try:
            target = f"unix:{sock}"
            with EmbCacheClient(target) as c:
                c.put("e", torch.randn(1 << 20))
            done = subprocess.run(
                [sys.executable, "-c", textwrap.dedent(CLIENT), target],
                capture_output=True, text=True, timeout=900,
            )  # fmt: skip
        finally:
            daemon.stop(timeout=60)
    if done.returncode:
        print(done.stderr[-3000:], file=sys.stderr)
        return 1
    out = json.loads(done.stdout.strip().splitlines()[-1])
    reg = out["registration"]
    per_gib = reg["register_seconds"] / max(reg["bytes_registered"] / (1 << 30), 1e-9)
    rows = [
        ["first get(device='cuda') after connect", f"{out['first_get_us']:.0f} us"],
        [f"gets in the first second ({out['first_second_gets']}), p50",
         f"{out['first_second_p50_us']:.0f} us"],
        [f"pool registered ({args.pool} GiB) after", f"{out['registered_after_s']:.2f} s"],
        ["registration cost", f"{per_gib:.3f} s/GiB"],
        ["get once registered, p50", f"{out['registered_p50_us']:.0f} us"],
        ["floor: one pinned 4 MiB copy, p50", f"{out['floor_us']:.0f} us"],
    ]  # fmt: skip
    print(table(["1 x 4 MiB to the GPU, same node", "value"], rows))
    save_json("first_get", {"env": env, **out}, args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
