"""gRPC data plane benchmark: put-bytes throughput against a raw gRPC streaming baseline.

    python bench/grpc_e2e.py [--total-mib 256] [--entry-mib 4 32] [--repeats 3]

Starts ``embcache serve`` and a baseline server (a trivial client-streaming servicer that
parses and discards the same PutRequest chunks) as subprocesses, measures both from this
process over a Unix socket and TCP loopback, and reports MiB/s and the ratio to the
baseline measured in the same run. Also: zero-copy ``get`` latency (shared memory) and
``get_bytes`` throughput. Prints a table and writes bench/results/grpc_e2e.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import grpc
import torch

from embcache.clients import EmbCacheClient
from embcache.proto.embcache.v1 import embcache_pb2 as pb

MiB = 1 << 20
RESULTS = Path(__file__).resolve().parent / "results" / "grpc_e2e.json"

BASELINE_SERVER = """
import asyncio, sys
import grpc
from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.service.transport.grpc_server import SERVER_OPTIONS

async def put(request_iterator, context):
    n = 0
    async for msg in request_iterator:
        n += len(msg.chunk)
    return pb.PutResponse(created=True, nbytes=n)

async def main():
    server = grpc.aio.server(options=SERVER_OPTIONS)
    handler = grpc.stream_unary_rpc_method_handler(
        put, request_deserializer=pb.PutRequest.FromString,
        response_serializer=pb.PutResponse.SerializeToString)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("bench.Sink", {"Put": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.add_insecure_port("unix:" + sys.argv[1])
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()

asyncio.run(main())
"""


def start(args: list[str], ready: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if select.select([proc.stdout], [], [], 0.5)[0]:
            line = proc.stdout.readline()
            if ready in line or (ready == "" and line.strip()):
                return proc, line
        if proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError(f"{args[0]} did not start")


def stop(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
    if proc.stdout is not None:
        proc.stdout.close()


def baseline_put(channel: grpc.Channel, data: memoryview, chunks: int) -> None:
    call = channel.stream_unary(
        "/bench.Sink/Put",
        request_serializer=pb.PutRequest.SerializeToString,
        response_deserializer=pb.PutResponse.FromString,
    )

    def messages():
        yield pb.PutRequest(header=pb.PutHeader(key="x", dtype="uint8", shape=[len(data)]))
        for i in range(chunks):
            yield pb.PutRequest(chunk=bytes(data[i * MiB : (i + 1) * MiB]))

    call(messages(), timeout=120)


def rate(nbytes: int, seconds: float) -> float:
    return nbytes / MiB / seconds


def measure_puts(target: str, base_target: str, entry_mib: int, total_mib: int, repeats: int):
    entry = torch.randint(0, 255, (entry_mib * MiB,), dtype=torch.uint8)
    view = memoryview(entry.numpy())
    count = max(1, total_mib // entry_mib)
    ours, base = [], []
    with EmbCacheClient(target) as client, grpc.insecure_channel(base_target) as channel:
        client.put("warm", entry[: 2 * MiB])
        baseline_put(channel, view[: 2 * MiB], 2)
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(count):
                baseline_put(channel, view, entry_mib)
            base.append(rate(count * entry.numel(), time.perf_counter() - t0))
            t0 = time.perf_counter()
            for _ in range(count):
                client.put(uuid.uuid4().hex, entry)
            ours.append(rate(count * entry.numel(), time.perf_counter() - t0))
    return statistics.median(ours), statistics.median(base)


def measure_gets(target: str, entry_mib: int, iters: int) -> dict[str, float]:
    entry = torch.randn(entry_mib * MiB // 2).to(torch.bfloat16)
    with EmbCacheClient(target) as client:
        client.put("get-bench", entry)
        with client.get("get-bench"):
            pass
        lat = []
        for _ in range(iters):
            t0 = time.perf_counter()
            with client.get("get-bench") as (t,):
                assert t is not None
            lat.append((time.perf_counter() - t0) * 1e6)
        t0 = time.perf_counter()
        n = 8
        for _ in range(n):
            client.get_bytes("get-bench")
        bytes_rate = rate(n * entry_mib * MiB, time.perf_counter() - t0)
    lat.sort()
    return {
        "get_shm_p50_us": lat[len(lat) // 2],
        "get_shm_p99_us": lat[min(len(lat) - 1, int(len(lat) * 0.99))],
        "get_bytes_mib_s": bytes_rate,
    }


def commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            timeout=10,
        )
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--total-mib", type=int, default=256)
    ap.add_argument("--entry-mib", type=int, nargs="+", default=[4, 32])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--pool", default="1GiB")
    args = ap.parse_args()

    tmp = tempfile.mkdtemp(prefix="ecb-")
    sock, base_sock = os.path.join(tmp, "d.sock"), os.path.join(tmp, "b.sock")
    embcache = Path(sys.executable).with_name("embcache")
    daemon, line = start(
        [
            str(embcache),
            "serve",
            "--grpc-port",
            "0",
            "--http-port",
            "0",
            "--grpc-socket",
            sock,
            "--shm-name",
            f"embcache-bench-{uuid.uuid4().hex[:8]}",
            "--host-pool-bytes",
            args.pool,
            "--max-entry-bytes",
            "256MiB",
            "--log-level",
            "warning",
        ],
        '"ready"',
    )
    grpc_port = json.loads(line)["grpc_port"]
    baseline, base_line = start([sys.executable, "-c", BASELINE_SERVER, base_sock], "")
    base_port = int(base_line)
    rows = []
    try:
        for name, target, base_target in (
            ("unix", f"unix:{sock}", f"unix:{base_sock}"),
            ("tcp", f"127.0.0.1:{grpc_port}", f"127.0.0.1:{base_port}"),
        ):
            for entry_mib in args.entry_mib:
                ours, base = measure_puts(
                    target, base_target, entry_mib, args.total_mib, args.repeats
                )
                rows.append(
                    {
                        "transport": name,
                        "entry_mib": entry_mib,
                        "put_mib_s": ours,
                        "baseline_mib_s": base,
                        "ratio": ours / base,
                    }
                )
        gets = measure_gets(f"unix:{sock}", 4, 200)
    finally:
        stop(daemon)
        stop(baseline)
    print(
        f"embcache gRPC put-bytes vs raw gRPC streaming baseline  (commit {commit()}, "
        f"{platform.processor() or platform.machine()}, grpc {grpc.__version__}, "
        f"torch {torch.__version__})"
    )
    print(f"{'transport':<10}{'entry':>8}{'embcache MiB/s':>16}{'baseline MiB/s':>16}{'ratio':>8}")
    for r in rows:
        print(
            f"{r['transport']:<10}{r['entry_mib']:>6}Mi{r['put_mib_s']:>16.0f}"
            f"{r['baseline_mib_s']:>16.0f}{r['ratio']:>8.2f}"
        )
    print(
        f"get 1 x 4 MiB zero-copy (shared memory, unix): p50 {gets['get_shm_p50_us']:.0f} us, "
        f"p99 {gets['get_shm_p99_us']:.0f} us; get_bytes {gets['get_bytes_mib_s']:.0f} MiB/s"
    )
    gpu = "needs the device pool (issue 4): get-to-device p50/p99 and 16 x 4 MiB GB/s not measured"
    print(f"get-to-device: {gpu}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "commit": commit(),
                "python": platform.python_version(),
                "grpc": grpc.__version__,
                "torch": torch.__version__,
                "cpu": platform.processor() or platform.machine(),
                "cuda": torch.cuda.is_available(),
                "put": rows,
                "get": gets,
                "get_to_device": gpu,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
