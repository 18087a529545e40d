"""REST data plane benchmark: put/get MiB/s of 4 MiB entries next to the gRPC path.

    python bench/rest_e2e.py [--entry-mib 4] [--total-mib 256] [--repeats 3] [--out-dir DIR]

Starts one ``embcache serve`` (gRPC on TCP loopback and a Unix socket, HTTP on loopback) and
measures, in the same run and against the same daemon: REST ``PUT /v1/entries/{key}`` (raw
body; with and without a CRC32 header), REST ``GET /v1/entries/{key}/data``, and the gRPC
client's ``put`` (CRC32-checked, its default) and ``get_bytes`` over TCP and the Unix socket.
Also the latency of one lease round trip: REST ``POST /v1/get`` + ``POST /v1/release`` next
to the gRPC client's zero-copy ``get`` + release. Ratios are to gRPC over TCP. Prints a table
and writes ``rest_e2e_<gpu>.json`` under ``--out-dir`` (default bench/results).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS_DIR, environment, latencies_us, print_environment, save_json, table

from embcache.clients import EmbCacheClient
from embcache.service.daemon_process import DaemonProcess

MiB = 1 << 20


def mib_s(nbytes: int, seconds: float) -> float:
    return nbytes / MiB / seconds


def median_rate(fn: Callable[[int], None], count: int, nbytes: int, repeats: int) -> float:
    """Median MiB/s of ``count`` calls ``fn(i)`` of ``nbytes`` each, over ``repeats`` passes."""
    rates = []
    for r in range(repeats):
        t0 = time.perf_counter()
        for i in range(count):
            fn(r * count + i)
        rates.append(mib_s(count * nbytes, time.perf_counter() - t0))
    return statistics.median(rates)


def p50_us(fn: Callable[[], None], iters: int) -> float:
    return statistics.median(latencies_us(fn, iters))


def measure(ready: dict[str, Any], entry_mib: int, count: int, repeats: int) -> dict[str, Any]:
    nbytes = entry_mib * MiB
    src = torch.randn(nbytes // 2).to(torch.bfloat16)
    data = src.view(torch.uint8).numpy().tobytes()
    crc = str(zlib.crc32(data))
    head = {"X-Embcache-Dtype": "bfloat16", "X-Embcache-Shape": str(nbytes // 2)}
    url = f"http://127.0.0.1:{ready['http_port']}"
    tcp, unix = f"127.0.0.1:{ready['grpc_port']}", f"unix:{ready['grpc_socket']}"
    run = uuid.uuid4().hex[:6]
    out: dict[str, Any] = {}
    with (
        httpx.Client(base_url=url, timeout=120) as rest,
        EmbCacheClient(tcp, timeout=120) as g_tcp,
        EmbCacheClient(unix, timeout=120) as g_unix,
    ):

        def rest_put(i: int, headers: dict[str, str], tag: str) -> None:
            r = rest.put(f"/v1/entries/{tag}-{run}-{i}", content=data, headers=headers)
            assert r.status_code == 201, r.text

        sink = bytearray(nbytes)  # gathered like get_bytes gathers its chunks

        def rest_get(i: int) -> None:
            pos, view = 0, memoryview(sink)
            with rest.stream("GET", "/v1/entries/read-src/data") as r:
                for piece in r.iter_raw(MiB):
                    view[pos : pos + len(piece)] = piece
                    pos += len(piece)
            assert pos == nbytes

        rest_put(0, head, "warm")
        g_tcp.put(f"warm-g-{run}", src)
        out["rest_put"] = median_rate(lambda i: rest_put(i, head, "rp"), count, nbytes, repeats)
        crc_head = {**head, "X-Embcache-Checksum": crc}
        out["rest_put_crc"] = median_rate(
            lambda i: rest_put(i, crc_head, "rc"), count, nbytes, repeats
        )
        out["grpc_tcp_put"] = median_rate(
            lambda i: g_tcp.put(f"gt-{run}-{i}", src), count, nbytes, repeats
        )
        out["grpc_unix_put"] = median_rate(
            lambda i: g_unix.put(f"gu-{run}-{i}", src), count, nbytes, repeats
        )
        g_tcp.put("read-src", src)
        out["rest_get"] = median_rate(rest_get, count, nbytes, repeats)
        out["grpc_tcp_get"] = median_rate(
            lambda i: g_tcp.get_bytes("read-src"), count, nbytes, repeats
        )
        out["grpc_unix_get"] = median_rate(
            lambda i: g_unix.get_bytes("read-src"), count, nbytes, repeats
        )

        def rest_lease() -> None:
            body = rest.post("/v1/get", json={"keys": ["read-src"]}).json()
            rest.post("/v1/release", json={"lease_ids": [body["results"][0]["lease_id"]]})

        def grpc_lease() -> None:
            with g_unix.get(["read-src"]) as (t,):
                assert t is not None

        out["rest_get_release_p50_us"] = p50_us(rest_lease, 200)
        out["grpc_get_release_p50_us"] = p50_us(grpc_lease, 200)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entry-mib", type=int, default=4)
    ap.add_argument("--total-mib", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--pool", default="2GiB")
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = ap.parse_args()

    env = environment()
    print_environment(env)
    count = max(1, args.total_mib // args.entry_mib)
    with tempfile.TemporaryDirectory(prefix="ecbr-") as tmp:
        flags = ["--grpc-socket", str(Path(tmp) / "g.sock"), "--host-pool-bytes", args.pool]
        daemon = DaemonProcess(flags)
        try:
            res = measure(daemon.ready, args.entry_mib, count, args.repeats)
        finally:
            daemon.stop(timeout=30)

    base_put, base_get = res["grpc_tcp_put"], res["grpc_tcp_get"]
    entry = f"{args.entry_mib} MiB"
    rows = [
        ["REST PUT", "tcp", entry, res["rest_put"], res["rest_put"] / base_put],
        ["REST PUT + CRC32", "tcp", entry, res["rest_put_crc"], res["rest_put_crc"] / base_put],
        ["gRPC put (CRC32)", "tcp", entry, base_put, 1.0],
        ["gRPC put (CRC32)", "unix", entry, res["grpc_unix_put"], res["grpc_unix_put"] / base_put],
        ["REST GET .../data", "tcp", entry, res["rest_get"], res["rest_get"] / base_get],
        ["gRPC get_bytes", "tcp", entry, base_get, 1.0],
        ["gRPC get_bytes", "unix", entry, res["grpc_unix_get"], res["grpc_unix_get"] / base_get],
    ]
    print(f"\nREST vs gRPC data plane, {count} x {entry} per pass, median of {args.repeats}")
    print(table(["operation", "transport", "entry", "MiB/s", "vs gRPC tcp"], rows))
    print(
        f"lease round trip (1 x {entry}, host location): REST POST /v1/get + /v1/release "
        f"p50 {res['rest_get_release_p50_us']:.0f} us; gRPC get + release (zero-copy, unix) "
        f"p50 {res['grpc_get_release_p50_us']:.0f} us"
    )
    data = {
        "environment": env,
        "entry_mib": args.entry_mib,
        "entries_per_pass": count,
        "repeats": args.repeats,
        "mib_s": {k: v for k, v in res.items() if not k.endswith("_us")},
        "latency_us": {k: v for k, v in res.items() if k.endswith("_us")},
        "ratios_to_grpc_tcp": {
            "rest_put": res["rest_put"] / base_put,
            "rest_put_crc": res["rest_put_crc"] / base_put,
            "rest_get": res["rest_get"] / base_get,
        },
    }
    save_json("rest_e2e", data, args.out_dir)


if __name__ == "__main__":
    main()
