"""Device-resident hits from the read table against the call they replace, measured in one run.

    python3 bench/table_device.py [--out-dir bench/results] [--iters 500] [--ipc-mode fd]

Starts ``embcache serve`` with a device pool (a child process, on a temp Unix socket), puts
64 KiB and 4 MiB entries, makes them resident with one device get, then times per entry, in
this process (its own CUDA context, like a decoder):
- the table read (``clients/device/table_device.read_into``): locate, a device-to-device
  copy into a buffer of ours, the wait for its event, the slot's check: the bytes usable;
- the call: ``get(key, device="cuda")`` of the same resident entry, until the tensor is
  usable (the block's release not included, as bench/grpc_e2e.py does);
- the floor: one ``copy_`` of the same bytes between two tensors of ours, and its wait.
Every read is checked against the entry once, outside the timed loop. Target: the table
read of 4 MiB within 40 us (p50). Prints the environment and the table; writes
``table_device_<gpu>.json``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import environment, latencies_us, print_environment, save_json, table  # noqa: E402

from embcache.clients import EmbCacheClient  # noqa: E402
from embcache.clients.device.read_table import process_read_tables  # noqa: E402
from embcache.clients.device.table_device import read_into  # noqa: E402
from embcache.service.daemon_process import DaemonProcess  # noqa: E402

SIZES = {"64KiB": 64 << 10, "4MiB": 4 << 20}
TARGET_US = 40.0


def pct(lat: list[float]) -> tuple[float, float]:
    return lat[len(lat) // 2], lat[min(len(lat) - 1, int(len(lat) * 0.99))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", type=Path, default=None)
    ap.add_argument("--iters", type=int, default=500)
    ap.add_argument("--ipc-mode", choices=("fd", "legacy"), default="fd")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    env = environment()
    print_environment(env)
    rows, results = [], {}
    with tempfile.TemporaryDirectory(prefix="ecbench-") as tmp:
        sock = f"{tmp}/b.sock"
        flags = ["--grpc-socket", sock, "--host-pool-bytes", "256MiB"]
        flags += ["--device-pool-bytes", "256MiB", "--ipc-mode", args.ipc_mode]
        daemon = DaemonProcess(flags, timeout=180)
        try:
            with EmbCacheClient(f"unix:{sock}") as client:
                want = {n: torch.randint(0, 256, (b,), dtype=torch.uint8) for n, b in SIZES.items()}
                for name, t in want.items():
                    client.put(name, t)
                with client.get(list(want), device="cuda"):
                    pass
                tab = process_read_tables().get(client._conn.open_session().read_table)
                assert tab is not None, "the daemon offers no read table"
                give_up = time.monotonic() + 10
                while not all((f := tab.locate(n)) is not None and f.devices for n in want):
                    assert time.monotonic() < give_up, "device copies not offered"
                    time.sleep(0.05)
                for name, t in want.items():
                    nbytes = t.numel()
                    gpu = t.cuda()
                    out = torch.full((nbytes,), 0xA5, dtype=torch.uint8, device="cuda")
                    assert read_into(tab, name, out) is not None and torch.equal(out, gpu)
                    hits = client.stats()["hits"]

                    def table_read(name: str = name, out: torch.Tensor = out) -> None:
                        if read_into(tab, name, out) is None:
                            raise AssertionError("fell back")

                    t_table = latencies_us(table_read, args.iters, warmup=20)
                    assert client.stats()["hits"] == hits, "a table read made a call"

                    def call(name: str = name) -> None:
                        with client.get(name, device="cuda") as (g,):
                            assert g is not None
                            torch.cuda.current_stream().synchronize()

                    t_call = latencies_us(call, max(50, args.iters // 5), warmup=5)
                    src = gpu.clone()

                    def floor(src: torch.Tensor = src, out: torch.Tensor = out) -> None:
                        out.copy_(src)
                        torch.cuda.current_stream().synchronize()

                    t_floor = latencies_us(floor, args.iters, warmup=20)
                    p = {
                        k: pct(v)
                        for k, v in (("table", t_table), ("call", t_call), ("floor", t_floor))
                    }
                    results[name] = {k: {"p50_us": v[0], "p99_us": v[1]} for k, v in p.items()}
                    rows.append([name, *p["table"], *p["call"], *p["floor"]])
        finally:
            daemon.stop(timeout=30)
    headers = ["entry", "table p50", "table p99", "call p50", "call p99", "copy p50", "copy p99"]
    print(table(headers, rows))
    four = results["4MiB"]["table"]["p50_us"]
    print(f"target: 4 MiB table read p50 <= {TARGET_US} us: {four:.1f} us", flush=True)
    save_json(
        "table_device",
        {"environment": env, "ipc_mode": args.ipc_mode, "iters": args.iters, "results": results},
        args.out_dir,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
