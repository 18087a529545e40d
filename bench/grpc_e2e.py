"""gRPC data plane benchmark: put-bytes throughput against a raw gRPC streaming baseline.

    python bench/grpc_e2e.py [--total-mib 256] [--entry-mib 4 32] [--repeats 3]

Starts ``embcache serve`` and a baseline server (a trivial client-streaming servicer that
parses and discards the same PutRequest chunks) as subprocesses, measures both from this
process over a Unix socket and TCP loopback, and reports MiB/s and the ratio to the
baseline measured in the same run. Also: zero-copy ``get`` latency (shared memory) and
``get_bytes`` throughput, and the round trip of a session call on the daemon's session socket and
on a gRPC Session stream. With CUDA, two more daemons with a 1 GiB device pool (session calls
on the lane, then on the gRPC Session stream): get-to-device
latency for 1 x 4 MiB (cold and resident hit), GB/s for 16 x 4 MiB cold with fragmented device
pages, put-from-device GB/s, next to one contiguous copy-engine transfer of the same bytes
measured in the same run. Device gets copy out of the pool into memory the caller owns (the
default); the zero_copy rows are views of the pool instead, in the same run. Prints a table
and writes bench/results/grpc_e2e.json.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import grpc
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import CpuMeter, git_commit, latencies_us

from embcache.clients import EmbCacheClient
from embcache.clients._backends.sync_session import Session
from embcache.clients._backends.sync_socket_session import SocketSession
from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.service.config import parse_cpu_list
from embcache.service.daemon_process import DaemonProcess, read_line, stop

MiB = 1 << 20
RESULTS = Path(__file__).resolve().parent / "results" / "grpc_e2e.json"

BASELINE_SERVER = """
import asyncio, sys
import grpc
from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.service.transport.grpc.server import SERVER_OPTIONS

async def put(request_iterator, context):
    n = 0
    async for msg in request_iterator:
        n += len(msg.chunk)
    return pb.PutResponse(created=True, nbytes=n)

async def ping(request, context):
    return pb.ExistsResponse(exists=[True] * len(request.keys))

async def echo(request_iterator, context):
    async for msg in request_iterator:
        yield pb.ExistsResponse(exists=[True] * len(msg.keys))

async def main():
    server = grpc.aio.server(options=SERVER_OPTIONS)
    handler = grpc.stream_unary_rpc_method_handler(
        put, request_deserializer=pb.PutRequest.FromString,
        response_serializer=pb.PutResponse.SerializeToString)
    unary = grpc.unary_unary_rpc_method_handler(
        ping, request_deserializer=pb.ExistsRequest.FromString,
        response_serializer=pb.ExistsResponse.SerializeToString)
    stream = grpc.stream_stream_rpc_method_handler(
        echo, request_deserializer=pb.ExistsRequest.FromString,
        response_serializer=pb.ExistsResponse.SerializeToString)
    methods = {"Put": handler, "Ping": unary, "Echo": stream}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Sink", methods),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.add_insecure_port("unix:" + sys.argv[1])
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()

asyncio.run(main())
"""


def start_baseline(sock: str, cpus: str = "") -> tuple[subprocess.Popen[str], int]:
    """The baseline server (on ``cpus``, like the daemon) and the TCP port it printed."""
    argv = [sys.executable, "-c", BASELINE_SERVER, sock]
    if cpus:
        argv = ["taskset", "-c", cpus, *argv]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        return proc, int(read_line(proc, "", 120))
    except BaseException:
        stop(proc, timeout=10, sig=signal.SIGKILL)
        raise


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
    ours, plain, base = [], [], []
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
            t0 = time.perf_counter()
            for _ in range(count):  # the same without the CRC32 (both ends skip it)
                client.put(uuid.uuid4().hex, entry, checksum=False)
            plain.append(rate(count * entry.numel(), time.perf_counter() - t0))
    return statistics.median(ours), statistics.median(plain), statistics.median(base)


def measure_floor(target: str, base_target: str, iters: int = 500) -> dict[str, float]:
    """p50 of a trivial grpc.aio unary call (the baseline server) and of embcache's Exists:
    the round trip every unary RPC pays on this machine."""
    req = pb.ExistsRequest(keys=["k"])
    out = {}
    with EmbCacheClient(target) as client, grpc.insecure_channel(base_target) as channel:
        ping = channel.unary_unary(
            "/bench.Sink/Ping",
            request_serializer=pb.ExistsRequest.SerializeToString,
            response_deserializer=pb.ExistsResponse.FromString,
        )
        echo = channel.stream_stream(
            "/bench.Sink/Echo",
            request_serializer=pb.ExistsRequest.SerializeToString,
            response_deserializer=pb.ExistsResponse.FromString,
        )
        sent: queue.SimpleQueue[pb.ExistsRequest | None] = queue.SimpleQueue()
        replies = echo(iter(sent.get, None))

        def round_trip() -> None:  # one message each way on an open stream
            sent.put(req)
            next(replies)

        lane = client._conn.open_session()  # the daemon's session socket (lane.py)
        assert isinstance(lane, SocketSession), "the daemon serves no session socket"
        stream = Session(
            client._conn.stub, client._conn.auth, "bench", 10.0
        )  # a gRPC Session stream
        empty = pb.ReleaseRequest()

        def lane_call() -> None:
            lane.call(10, release=empty)

        def stream_call() -> None:
            stream.call(10, release=empty)

        for name, fn in (("unary_floor", lambda: ping(req, timeout=10)),
                         ("stream_floor", round_trip),
                         ("exists", lambda: client.exists(["k"])),
                         ("session_lane_call", lane_call),
                         ("session_stream_call", stream_call)):  # fmt: skip
            lat = latencies_us(fn, iters, warmup=20)
            out[f"{name}_p50_us"], out[f"{name}_p99_us"] = percentiles(lat)
        sent.put(None)
        replies.cancel()
        stream.close()
    return out


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


# An encoder in a process of its own: puts 16 x 4 MiB as bytes per line read ("<round>").
ENCODER = """
import sys, torch
from embcache.clients import EmbCacheClient
with EmbCacheClient(sys.argv[1]) as c:
    print("ready", flush=True)
    for line in sys.stdin:
        for i in range(16):
            c.put(f"enc-{line.strip()}-{i}", torch.full((4 << 20,), 7, dtype=torch.uint8))
        print("done", flush=True)
"""


def measure_gets_after_puts(target: str, rounds: int = 10) -> dict[str, float]:
    """A 16 x 4 MiB zero-copy get (lane, shared memory) of entries stored long before, and
    of entries another process has just put as bytes: the daemon's CPU has moved 64 MiB
    (gRPC receive, parse, CRC32, the copy into the pool) between the two gets' work."""
    enc = subprocess.Popen(
        [sys.executable, "-c", ENCODER, target],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert enc.stdin is not None and enc.stdout is not None
    out: dict[str, list[float]] = {"stored": [], "after_puts": []}

    def timed_get(client: EmbCacheClient, keys: list[str]) -> float:
        t0 = time.perf_counter()
        with client.get(keys) as tensors:
            assert all(t is not None for t in tensors)
        return (time.perf_counter() - t0) * 1e6

    try:
        assert enc.stdout.readline().strip() == "ready"
        with EmbCacheClient(target) as client:
            stored = [[f"st-{r}-{i}" for i in range(16)] for r in range(rounds)]
            for keys in stored:
                for key in keys:
                    client.put(key, torch.full((4 * MiB,), 3, dtype=torch.uint8))
            for r, keys in enumerate(stored):
                out["stored"].append(timed_get(client, keys))
                client.evict(keys)
                enc.stdin.write(f"{r}\n")
                enc.stdin.flush()
                assert enc.stdout.readline().strip() == "done"
                fresh = [f"enc-{r}-{i}" for i in range(16)]
                out["after_puts"].append(timed_get(client, fresh))
                client.evict(fresh)
    finally:
        enc.stdin.close()
        enc.wait(timeout=60)
    return {f"get_16x4MiB_shm_{k}_p50_us": statistics.median(v[1:]) for k, v in out.items()}


def percentiles(lat: list[float]) -> tuple[float, float]:
    lat = sorted(lat)
    return lat[len(lat) // 2], lat[min(len(lat) - 1, int(len(lat) * 0.99))]


def copy_engine_gbs(nbytes: int, reps: int = 10) -> float:
    """One contiguous pinned host -> device copy of ``nbytes`` (the copy engine), median."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(reps + 2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times[2:]) / 1e9


def in_flight(
    client: EmbCacheClient,
    entry: int,
    rounds: int,
    daemon_pid: int,
    threads: int,
    batches: int = 12,
) -> tuple[float, dict[str, float]]:
    """GB/s of cold fragmented 16 x 4 MiB gets with ``threads`` batches in flight (a decoder
    that fetches the next requests' embeddings while it uses the current ones): ``batches``
    batches through ``threads`` threads sharing the client; median over ``rounds``. Also the
    cores the client and the daemon used while the batches ran (all rounds; see CpuMeter):
    which side's Python is saturated (docs/grpc.md, "What 70% of the copy engine would take")."""
    rates = []
    cpu: dict[str, list[float]] = {}
    src = torch.empty(entry, dtype=torch.uint8, device="cuda")
    for r in range(rounds):
        keys = [[f"pipe-{threads}-{r}-{b}-{i}" for i in range(16)] for b in range(batches)]
        for b, batch in enumerate(keys):  # device puts: quick to fill, host tier only
            src.fill_(b)
            torch.cuda.current_stream().synchronize()
            client.put_many(dict.fromkeys(batch, src))

        def fetch(batch: list[str]) -> None:
            leased = client.get(batch, device="cuda")
            torch.cuda.current_stream().synchronize()
            leased.release()

        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            with CpuMeter({"client": os.getpid(), "daemon": daemon_pid}) as meter:
                t0 = time.perf_counter()
                list(pool.map(fetch, keys))
                rates.append(batches * 16 * entry / (time.perf_counter() - t0) / 1e9)
            for name, cores in meter.cores().items():
                cpu.setdefault(name, []).append(cores)
        client.evict([key for batch in keys for key in batch])
    return statistics.median(rates), {name: statistics.median(v) for name, v in cpu.items()}


def fragment_device_pool(client: EmbCacheClient) -> int:
    """Fragment the daemon's device pool: 511 fillers of 8 pages, every other one evicted,
    so each 16-page entry put next lands in two runs. Returns the largest free run."""
    fillers = [f"filler-{i}" for i in range(511)]
    for key in fillers:
        client.put(key, torch.zeros(2 * MiB, dtype=torch.uint8))
    for i in range(0, len(fillers), 64):
        client.get(fillers[i : i + 64], device="cuda").release()
    client.evict(fillers[1::2])
    return int(client.stats()["device"][0]["largest_free_run_pages"])


def device_gets(
    target: str, iters: int, rounds: int, daemon_pid: int, lane: bool
) -> dict[str, Any]:
    """get-to-device over gRPC (the client's tensors are on the GPU when timed); session
    calls over the daemon's session socket, or (``lane=False``) over the gRPC Session stream."""
    from embcache.kernels import cuda_mem

    entry = 4 * MiB
    out: dict[str, Any] = {}
    with EmbCacheClient(target, session_socket=lane) as client:
        keys = [f"cold-{i}" for i in range(3 * iters)]
        for i, key in enumerate(keys):
            client.put(key, torch.full((entry,), i % 251, dtype=torch.uint8))
        client.get(keys[:1], device="cuda").release()  # opens the pool once
        session = client._conn.open_session()
        # "rpc": the unary Get RPC that waits for the copy before replying (the path before
        # session calls and ready events), in the same run as the default path. "zc": the
        # same gets with zero_copy=True (views of the pool, no copy into owned memory).
        for name, batch, fast, zc in (
            ("cold", keys[1:iters], True, False),
            ("hit", [keys[0]] * (iters - 1), True, False),
            ("cold_zc", keys[2 * iters + 1 :], True, True),
            ("hit_zc", [keys[0]] * (iters - 1), True, True),
            ("cold_rpc", keys[iters + 1 : 2 * iters], False, False),
            ("hit_rpc", [keys[0]] * (iters - 1), False, False),
        ):
            session.serves_calls = client._state.caps.ready_events = fast
            lat = []
            for key in batch:
                t0 = time.perf_counter()
                leased = client.get([key], device="cuda", zero_copy=zc)
                torch.cuda.synchronize()
                lat.append((time.perf_counter() - t0) * 1e6)
                leased.release(now=True)  # nothing reads them after: end the leases here
            out[f"get_device_{name}_p50_us"], out[f"get_device_{name}_p99_us"] = percentiles(lat)
        session.serves_calls = client._state.caps.ready_events = True
        # 16 x 4 MiB resident entries in one run each: the owned copy (a device-to-device
        # gather) against zero-copy views, alternating, same batch.
        hot = keys[1:17]
        owned_or_view: dict[bool, list[float]] = {False: [], True: []}
        for r in range(2 * rounds + 2):
            zc = r % 2 == 1
            t0 = time.perf_counter()
            leased = client.get(hot, device="cuda", zero_copy=zc)
            torch.cuda.synchronize()
            owned_or_view[zc].append(16 * entry / (time.perf_counter() - t0) / 1e9)
            leased.release(now=True)
        out["get_device_16x4MiB_hit_owned_gbs"] = statistics.median(owned_or_view[False][1:])
        out["get_device_16x4MiB_hit_zero_copy_gbs"] = statistics.median(owned_or_view[True][1:])
        client.evict(keys)
        largest = fragment_device_pool(client)
        rates: dict[bool, list[float]] = {True: [], False: []}
        for r in range(2 * rounds):
            fast = r % 2 == 0  # alternate: default path, then the RPC path
            session.serves_calls = client._state.caps.ready_events = fast
            batch = [f"frag-{r}-{i}" for i in range(16)]
            for key in batch:
                client.put(key, torch.full((entry,), r, dtype=torch.uint8))
            t0 = time.perf_counter()
            leased = client.get(batch, device="cuda")
            torch.cuda.synchronize()
            rates[fast].append(16 * entry / (time.perf_counter() - t0) / 1e9)
            leased.release()
            client.evict(batch)  # every round meets the same holes (none is filled up)
        session.serves_calls = client._state.caps.ready_events = True
        # The same one batch at a time, with every batch stored first, as a decoder fetches
        # what encoders put earlier: above, the client has just pushed the batch's 64 MiB
        # through its own CPU, which leaves the get's Python cache-cold (docs/grpc.md).
        stored = [[f"stored-{r}-{i}" for i in range(16)] for r in range(rounds)]
        for r, batch in enumerate(stored):
            for key in batch:
                client.put(key, torch.full((entry,), r, dtype=torch.uint8))
        stored_rates = []
        for batch in stored:
            t0 = time.perf_counter()
            leased = client.get(batch, device="cuda")
            torch.cuda.synchronize()
            stored_rates.append(16 * entry / (time.perf_counter() - t0) / 1e9)
            leased.release()
            client.evict(batch)  # the same holes for the next batch
        for threads in (2, 3, 4):
            gbs, cores = in_flight(client, entry, rounds, daemon_pid, threads)
            out[f"get_device_16x4MiB_frag_{threads}inflight_gbs"] = gbs
            out[f"get_device_16x4MiB_frag_{threads}inflight_cores"] = cores
        out["get_device_16x4MiB_frag_gbs"] = statistics.median(rates[True])
        out["get_device_16x4MiB_frag_rpc_gbs"] = statistics.median(rates[False])
        out["get_device_16x4MiB_frag_stored_gbs"] = statistics.median(stored_rates)
        out["largest_free_device_run_pages"] = largest
        src = [torch.full((entry,), i, dtype=torch.uint8, device="cuda") for i in range(16)]
        client.put("pfd-warm", src[0])
        client.put_many({"pfdb-warm": src[0]})
        one, one_rpc, many = [], [], []
        for r in range(5):  # each round puts new keys, then evicts them
            for on_stream, rates_of in ((True, one), (False, one_rpc)):
                session.serves_device_puts = on_stream  # False: the PutFromDevice RPC
                keys = [f"pfd-{r}-{on_stream}-{i}" for i in range(16)]
                t0 = time.perf_counter()
                for key, t in zip(keys, src, strict=True):
                    client.put(key, t)
                rates_of.append(16 * entry / (time.perf_counter() - t0) / 1e9)
                client.evict(keys)
            session.serves_device_puts = True
            keys = [f"pfdb-{r}-{i}" for i in range(16)]
            t0 = time.perf_counter()
            created = client.put_many(dict(zip(keys, src, strict=True)))  # one call
            many.append(16 * entry / (time.perf_counter() - t0) / 1e9)
            assert created == [True] * 16 and client._state.caps.batch_puts
            client.evict(keys)
        out["put_from_device_16x4MiB_gbs"] = statistics.median(one)
        out["put_from_device_16x4MiB_rpc_gbs"] = statistics.median(one_rpc)
        out["put_from_device_batch_16x4MiB_gbs"] = statistics.median(many)
        out["put_from_device_used"] = float(client._state.caps.device_puts)
    out["copy_engine_64MiB_gbs"] = copy_engine_gbs(16 * entry)
    out["ratio_frag_to_copy_engine"] = (
        out["get_device_16x4MiB_frag_gbs"] / out["copy_engine_64MiB_gbs"]
    )
    out["ratio_frag_rpc_to_copy_engine"] = (
        out["get_device_16x4MiB_frag_rpc_gbs"] / out["copy_engine_64MiB_gbs"]
    )
    out["ratio_frag_stored_to_copy_engine"] = (
        out["get_device_16x4MiB_frag_stored_gbs"] / out["copy_engine_64MiB_gbs"]
    )
    out["gpu"] = torch.cuda.get_device_name()
    out["gpu_uuid"] = cuda_mem.gpu_uuid(0)
    return out


def gpu_section(
    tmp: str, iters: int, rounds: int, pin: list[str], lane: bool
) -> dict[str, Any] | str:
    if not torch.cuda.is_available():
        return "no CUDA here: get-to-device not measured"
    sock = os.path.join(tmp, f"gpu{int(lane)}.sock")
    flags = ["--grpc-socket", sock, "--host-pool-bytes", "4GiB", "--device-pool-bytes", "1GiB"]
    # The device pool is fragmented on purpose (device_gets); a free reserve would evict the
    # oldest fillers into one free run for the batches to land in.
    flags += ["--device-free-reserve", "0"]
    daemon = DaemonProcess([*flags, *pin])
    try:
        return device_gets(daemon.unix_target, iters, rounds, daemon.proc.pid, lane)
    finally:
        daemon.stop(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--total-mib", type=int, default=256)
    ap.add_argument("--entry-mib", type=int, nargs="+", default=[4, 32])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--pool", default="1GiB")
    ap.add_argument("--device-iters", type=int, default=101)
    ap.add_argument("--device-rounds", type=int, default=9)
    ap.add_argument("--out-dir", type=Path, default=RESULTS.parent)
    ap.add_argument("--daemon-cpus", default="", help="the daemons' --cpu-affinity, e.g. 2")
    ap.add_argument("--client-cpus", default="", help="CPUs this process runs on, e.g. 4")
    args = ap.parse_args()
    if args.client_cpus:  # before any thread starts; threads inherit it
        os.sched_setaffinity(0, parse_cpu_list(args.client_cpus))
    pin = ["--cpu-affinity", args.daemon_cpus] if args.daemon_cpus else []

    tmp = tempfile.mkdtemp(prefix="ecb-")
    sock, base_sock = os.path.join(tmp, "d.sock"), os.path.join(tmp, "b.sock")
    flags = ["--grpc-socket", sock, "--host-pool-bytes", args.pool, "--max-entry-bytes", "256MiB"]
    daemon = DaemonProcess([*flags, *pin])
    grpc_port = daemon.ready["grpc_port"]
    baseline, base_port = start_baseline(base_sock, args.daemon_cpus)
    rows = []
    try:
        for name, target, base_target in (
            ("unix", f"unix:{sock}", f"unix:{base_sock}"),
            ("tcp", f"127.0.0.1:{grpc_port}", f"127.0.0.1:{base_port}"),
        ):
            for entry_mib in args.entry_mib:
                ours, plain, base = measure_puts(
                    target, base_target, entry_mib, args.total_mib, args.repeats
                )
                rows.append(
                    {
                        "transport": name,
                        "entry_mib": entry_mib,
                        "put_mib_s": ours,
                        "put_no_crc_mib_s": plain,
                        "baseline_mib_s": base,
                        "ratio": ours / base,
                        "ratio_no_crc": plain / base,
                    }
                )
        gets = measure_gets(f"unix:{sock}", 4, 200)
        gets.update(measure_gets_after_puts(f"unix:{sock}"))
        gets.update(measure_floor(f"unix:{sock}", f"unix:{base_sock}"))
    finally:
        daemon.stop(timeout=30)
        stop(baseline, timeout=30)
    print(
        f"embcache gRPC put-bytes vs raw gRPC streaming baseline  (commit {git_commit()}, "
        f"{platform.processor() or platform.machine()}, grpc {grpc.__version__}, "
        f"torch {torch.__version__}; CPUs: daemon {args.daemon_cpus or 'any'}, "
        f"client {args.client_cpus or 'any'})"
    )
    print(
        f"{'transport':<10}{'entry':>8}{'put+CRC32 MiB/s':>17}{'put MiB/s':>11}"
        f"{'baseline MiB/s':>16}{'ratio':>7}{'ratio no CRC':>14}"
    )
    for r in rows:
        print(
            f"{r['transport']:<10}{r['entry_mib']:>6}Mi{r['put_mib_s']:>17.0f}"
            f"{r['put_no_crc_mib_s']:>11.0f}{r['baseline_mib_s']:>16.0f}{r['ratio']:>7.2f}"
            f"{r['ratio_no_crc']:>14.2f}"
        )
    print(
        f"get 1 x 4 MiB zero-copy (shared memory, unix): p50 {gets['get_shm_p50_us']:.0f} us, "
        f"p99 {gets['get_shm_p99_us']:.0f} us; get_bytes {gets['get_bytes_mib_s']:.0f} MiB/s"
    )
    print(
        "get 16 x 4 MiB zero-copy p50: stored long before "
        f"{gets['get_16x4MiB_shm_stored_p50_us']:.0f} us; right after another process put "
        f"them as bytes {gets['get_16x4MiB_shm_after_puts_p50_us']:.0f} us"
    )
    print(
        f"round trip (unix), trivial grpc.aio servicer p50: unary {gets['unary_floor_p50_us']:.0f}"
        f" us, one message each way on an open stream {gets['stream_floor_p50_us']:.0f} us "
        f"(the floors); embcache Exists (unary) p50 {gets['exists_p50_us']:.0f} us"
    )
    print(
        f"session call round trip (empty Release) p50: session socket "
        f"{gets['session_lane_call_p50_us']:.0f} us, gRPC Session stream "
        f"{gets['session_stream_call_p50_us']:.0f} us"
    )
    gpu = gpu_section(tmp, args.device_iters, args.device_rounds, pin, lane=True)
    # The same with session calls on the gRPC Session stream (no lane), in the same run.
    stream = gpu_section(tmp, args.device_iters, args.device_rounds, pin, lane=False)
    if isinstance(gpu, str) or isinstance(stream, str):
        print(f"get-to-device: {gpu}")
    else:
        print(f"get-to-device ({gpu['gpu']}); lane: Get on the session socket with a ready event")
        print("(the default); rpc: the Get RPC, reply once copied; stream: Get on the gRPC Session")
        print("stream with a ready event (no lane); all in the same run")
        head = f"{'1x4MiB cold p50/p99 us':>24}{'hit p50/p99 us':>17}{'16x4MiB frag GB/s':>19}"
        print(f"{'path':<9}{head}")
        for label, sfx, res in (
            ("lane", "", gpu),
            ("lane zc", "_zc", gpu),
            ("rpc", "_rpc", gpu),
            ("stream", "", stream),
        ):
            print(
                f"{label:<9}{res[f'get_device_cold{sfx}_p50_us']:>15.0f} /"
                f"{res[f'get_device_cold{sfx}_p99_us']:>6.0f}"
                f"{res[f'get_device_hit{sfx}_p50_us']:>10.0f} /"
                f"{res[f'get_device_hit{sfx}_p99_us']:>5.0f}"
                f"{res.get(f'get_device_16x4MiB_frag{sfx}_gbs', float('nan')):>19.1f}"
            )
        print(
            "16 x 4 MiB resident, one run each (lane): owned copy "
            f"{gpu['get_device_16x4MiB_hit_owned_gbs']:.1f} GB/s, zero_copy views "
            f"{gpu['get_device_16x4MiB_hit_zero_copy_gbs']:.1f} GB/s (stream: "
            f"{stream['get_device_16x4MiB_hit_owned_gbs']:.1f} / "
            f"{stream['get_device_16x4MiB_hit_zero_copy_gbs']:.1f})"
        )
        print(
            f"contiguous copy engine 64 MiB {gpu['copy_engine_64MiB_gbs']:.1f} GB/s: 16 x 4 MiB "
            f"ratio {gpu['ratio_frag_to_copy_engine']:.2f} (rpc "
            f"{gpu['ratio_frag_rpc_to_copy_engine']:.2f}); put-from-device 16 x 4 MiB "
            f"{gpu['put_from_device_16x4MiB_gbs']:.1f} GB/s on the lane, "
            f"{gpu['put_from_device_16x4MiB_rpc_gbs']:.1f} as RPCs "
            f"({stream['put_from_device_16x4MiB_gbs']:.1f} on the gRPC stream), in one "
            f"put_many call {gpu['put_from_device_batch_16x4MiB_gbs']:.1f} GB/s "
            f"({stream['put_from_device_batch_16x4MiB_gbs']:.1f})"
        )
        ce = gpu["copy_engine_64MiB_gbs"]
        print(
            "16 x 4 MiB frag, one batch at a time, every batch stored first (above: each put "
            f"just before its get): lane {gpu['get_device_16x4MiB_frag_stored_gbs']:.1f} GB/s, "
            f"ratio {gpu['ratio_frag_stored_to_copy_engine']:.2f}; stream "
            f"{stream['get_device_16x4MiB_frag_stored_gbs']:.1f} GB/s, ratio "
            f"{stream['ratio_frag_stored_to_copy_engine']:.2f}"
        )
        print("16 x 4 MiB frag with N batches in flight (N threads, one client); cores used")
        print("meanwhile: client (busiest thread) / daemon (busiest thread)")
        for label, res in ((", lane", gpu), (", stream", stream)):
            for n in (2, 3, 4):
                gbs = res[f"get_device_16x4MiB_frag_{n}inflight_gbs"]
                c = res[f"get_device_16x4MiB_frag_{n}inflight_cores"]
                print(
                    f"  N={n}{label}: {gbs:.1f} GB/s, ratio {gbs / ce:.2f}; cores "
                    f"{c['client']:.2f} ({c['client_busiest_thread']:.2f}) / "
                    f"{c['daemon']:.2f} ({c['daemon_busiest_thread']:.2f})"
                )
    out = args.out_dir / RESULTS.name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "commit": git_commit(),
                "python": platform.python_version(),
                "grpc": grpc.__version__,
                "torch": torch.__version__,
                "cpu": platform.processor() or platform.machine(),
                "cuda": torch.cuda.is_available(),
                "daemon_cpus": args.daemon_cpus,
                "client_cpus": args.client_cpus,
                "put": rows,
                "get": gets,
                "get_to_device": gpu,
                "get_to_device_grpc_stream": stream,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
