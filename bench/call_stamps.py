"""Small calls stamp by stamp across both processes: an empty session call, a 64 KiB host
get as copies (served from the read table: no call), a 64 KiB put and a put_many of 16, and
on a GPU a resident 4 MiB device hit, a 4 MiB get_into and a 4 MiB put from the device.

The daemon runs with ``time.perf_counter`` stamps around the steps of a session-socket call
(the frame's arrival, the call's start, the handlers, the engine's steps, the reply's
write); the client stamps its own (the export, the send, the result's arrival, the return).
Both processes read the same monotonic clock, so the stamps line up. Prints, per stamp, the
median microseconds since the client's call began, for each path the calls took.

    python bench/call_stamps.py [--calls N] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import json
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
from _common import environment, print_environment, save_json

from embcache.clients import EmbCacheClient
from embcache.clients._backends import sync_socket_session
from embcache.clients.device import exports
from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.service.daemon_process import read_line, serve_command, stop

MiB = 1 << 20

# The daemon, its steps wrapped with stamps; SIGUSR2 writes them to argv[1] as JSON.
STAMPED = r"""
import functools, json, signal, sys, time
from embcache.service.cli.app import app
from embcache.service.engine import device_side
from embcache.service.engine.device_into import PendingInto
from embcache.service.engine.device_puts import PendingPut
from embcache.service.transport import device_get
from embcache.service.transport.handlers import device, device_puts
from embcache.service.transport.session import calls, host_puts, inline_gets
from embcache.service.transport.session_socket import connection

out, argv = sys.argv[1], sys.argv[2:]
stamps = []
def stamp(name):
    stamps.append((name, time.perf_counter()))

def around(owner, attr, before, after, is_async=False):
    real = getattr(owner, attr)
    if is_async:
        async def wrapped(*a, **k):
            if before: stamp(before)
            try:
                return await real(*a, **k)
            finally:
                if after: stamp(after)
    else:
        def wrapped(*a, **k):
            if before: stamp(before)
            try:
                return real(*a, **k)
            finally:
                if after: stamp(after)
    setattr(owner, attr, functools.wraps(real)(wrapped))

around(connection.SessionConnection, "data_received", "daemon: frame received", None)
around(connection.SessionConnection, "_write", "daemon: reply written", None)
around(calls.SessionCalls, "_run", "daemon: call starts", None, True)
around(device.DevicePlane, "get_into", "daemon: handler starts", "daemon: handler returns", True)
around(device.DevicePlane, "_into_now", "daemon: on the loop", None, True)
around(device.DevicePlane, "_into_waiting", "daemon: in a thread", None)
around(device.DevicePlane, "_pool_index", "daemon: checked", None)
around(device_side.DeviceTier, "queue_into", "daemon: leased", None)
around(device_side.DeviceSide, "start_into", "daemon: start_into begins", "daemon: copies queued")
around(device_get, "poll_until", None, "daemon: copies done", True)
around(PendingInto, "finish", None, "daemon: leases ended")
around(device.DevicePlane, "get", "daemon: device get starts", "daemon: device get returns", True)
around(inline_gets, "inline_get", "daemon: inline_get begins", "daemon: inline_get ends")
around(connection.SessionConnection, "_send_bytes", None, "daemon: reply and bytes written", True)
around(host_puts.SessionPuts, "put", "daemon: put begins", "daemon: put ends")
around(host_puts.SessionPuts, "put_batch", "daemon: put_batch begins", "daemon: put_batch ends")
around(device.DevicePlane, "put_from_device", "daemon: device put starts",
       "daemon: device put returns", True)
around(device_puts, "_checked", None, "daemon: device put checked")
around(device_puts, "poll_until", None, "daemon: client event fired", True)
around(device_side.DeviceSide, "start_put_many", "daemon: start_put_many begins",
       "daemon: put copies queued")
around(device_puts, "wait_copies", None, "daemon: put copies done", True)
around(PendingPut, "finish", None, "daemon: put committed")

def dump(*_):
    with open(out, "w") as f:
        json.dump(stamps, f)
signal.signal(signal.SIGUSR2, dump)
app(argv, standalone_mode=False)
"""


def client_stamps(log: list[tuple[str, float]]) -> Callable[[], None]:
    """Wrap the client's steps with stamps into ``log``; returns the undo."""
    undo = []

    def around(owner: Any, attr: str, before: str | None, after: str | None) -> None:
        real = getattr(owner, attr)

        def wrapped(*a: Any, **k: Any) -> Any:
            if before:
                log.append((before, time.perf_counter()))
            try:
                return real(*a, **k)
            finally:
                if after:
                    log.append((after, time.perf_counter()))

        setattr(owner, attr, wrapped)
        undo.append(lambda: setattr(owner, attr, real))

    around(exports, "export_cuda", "client: exports", "client: exported")
    around(sync_socket_session.SocketSession, "_send_frame", "client: sends", None)
    around(sync_socket_session.SocketSession, "call_with_payload", None, "client: result arrived")

    def restore() -> None:
        for u in undo:
            u()

    return restore


def rounds(log: list[tuple[str, float]], starts: list[float]) -> dict[str, dict[str, float]]:
    """Rounds (split by ``starts``) grouped by the steps they went through (a call may take
    one of several paths): per group, keyed by how many rounds it holds, the median
    microseconds of each stamp after its round's start; a stamp seen more than once in a
    round counts at its first."""
    groups: dict[frozenset[str], dict[str, list[float]]] = {}
    ends = [*starts[1:], float("inf")]
    j = 0
    log = sorted(log, key=lambda s: s[1])
    for t0, t1 in zip(starts, ends, strict=True):
        while j < len(log) and log[j][1] < t0:
            j += 1
        seen: dict[str, float] = {}
        while j < len(log) and log[j][1] < t1:
            name, t = log[j]
            seen.setdefault(name, (t - t0) * 1e6)
            j += 1
        group = groups.setdefault(frozenset(seen), {})
        for name, us in seen.items():
            group.setdefault(name, []).append(us)
    out = {}
    for group in sorted(groups.values(), key=lambda g: -len(next(iter(g.values()), []))):
        n = len(next(iter(group.values()), []))
        medians = {name: statistics.median(v) for name, v in group.items()}
        out[f"{n} rounds"] = dict(sorted(medians.items(), key=lambda kv: kv[1]))
    return out


def cases(client: EmbCacheClient, cuda: bool) -> dict[str, Callable[[], object]]:
    client.put("small", torch.ones(16 * 1024))  # 64 KiB
    session = client._conn.open_session()

    def empty() -> None:
        session.call(client.timeout, release=pb.ReleaseRequest())

    def get_copies() -> None:  # the client copies entries up to 256 KiB after the result
        with client.get(["small"]) as (t,):
            assert t is not None

    small = [torch.full((16 * 1024,), float(i)) for i in range(16)]  # 64 KiB each
    counter = iter(range(1 << 30))

    def put() -> None:
        client.put(f"p{next(counter)}", small[0])

    def put_many() -> None:
        n = next(counter)
        client.put_many({f"m{n}-{i}": t for i, t in enumerate(small)})

    out: dict[str, Callable[[], object]] = {
        "empty session call": empty,
        "get 64 KiB (copies)": get_copies,
        "put 64 KiB": put,
        "put_many 16 x 64 KiB": put_many,
    }
    if cuda:
        client.put("large", torch.ones(MiB))  # 4 MiB
        with client.get(["large"], device="cuda"):  # resident in the device pool from now on
            pass
        dest = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")

        def hit() -> None:
            with client.get(["large"], device="cuda") as (t,):
                assert t is not None
            torch.cuda.current_stream().synchronize()

        def get_into() -> None:
            (r,) = client.get_into(["large"], dest)
            assert r.found

        source = torch.randn(MiB, device="cuda")  # 4 MiB

        def put_from_device() -> None:
            client.put(f"d{next(counter)}", source)

        out["device hit 4 MiB (owned copy)"] = hit
        out["get_into 4 MiB"] = get_into
        out["put from device 4 MiB"] = put_from_device
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    tmp = Path(tempfile.mkdtemp(prefix="callstamps-"))
    stamps_file = tmp / "daemon.json"
    flags = serve_command("--grpc-socket", str(tmp / "d.sock"), "--host-pool-bytes", "1GiB")
    flags = [sys.executable, "-c", STAMPED, str(stamps_file), *flags[3:]]
    flags += ["--device-pool-bytes", "1GiB"] if cuda else ["--device", "cpu"]
    proc = subprocess.Popen(flags, stdout=subprocess.PIPE, text=True)
    results: dict[str, Any] = {}
    try:
        json.loads(read_line(proc, '"event": "ready"', 180))
        target = f"unix:{tmp / 'd.sock'}"
        with EmbCacheClient(target, timeout=30, copy_gets_up_to=256 << 10) as client:
            log: list[tuple[str, float]] = []
            # the puts last: the entries they add may evict the ones the gets read
            for name, fn in sorted(cases(client, cuda).items(), key=lambda c: "put" in c[0]):
                for _ in range(20):
                    fn()
                proc.send_signal(signal.SIGUSR2)  # the daemon's stamps so far: skipped
                time.sleep(0.5)
                skip = len(json.loads(stamps_file.read_text()))
                log.clear()
                undo = client_stamps(log)
                starts = []
                for _ in range(args.calls):
                    starts.append(time.perf_counter())
                    fn()
                    log.append(("client: returns", time.perf_counter()))
                undo()
                proc.send_signal(signal.SIGUSR2)
                time.sleep(0.5)
                daemon = [tuple(s) for s in json.loads(stamps_file.read_text())[skip:]]
                results[name] = rounds(log + daemon, starts)
    finally:
        stop(proc)
    env = environment()
    print("small calls stamp by stamp (us after the client's call begins, medians)")
    print_environment(env)
    for name, steps in results.items():
        for group, stamps in steps.items():
            print(f"\n== {name} ({group})")
            for step, us in stamps.items():
                print(f"  {us:8.1f}  {step}")
    save_json("call_stamps", {"bench": "call_stamps", **env, "us": results}, args.out_dir)


if __name__ == "__main__":
    main()
