"""End to end: ``embcache serve`` as a subprocess, encoder and decoder worker processes.

Only 127.0.0.1 and temporary Unix sockets are bound; every process started here is
stopped by its pid.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
from google.protobuf import descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from embcache.clients import EmbCacheClient
from embcache.clients._backends.sync_socket_session import SocketSession
from embcache.errors import Unauthenticated
from embcache.service.daemon_process import DaemonProcess, stop

LEASE_TTL_S = 3.0


@dataclass
class Daemon:
    proc: subprocess.Popen[str]
    grpc_port: int
    socket: str
    shm_name: str

    @property
    def unix(self) -> str:
        return f"unix:{self.socket}"


@pytest.fixture(scope="module")
def start_daemon() -> Iterator[Callable[..., Daemon]]:
    started: list[Daemon] = []
    tmp = tempfile.TemporaryDirectory(prefix="ece-")

    def start(*extra: str) -> Daemon:
        sock = os.path.join(tmp.name, f"{len(started)}.sock")
        flags = ["--grpc-socket", sock, "--host-pool-bytes", "64MiB"]
        flags += ["--lease-ttl-s", str(LEASE_TTL_S), "--drain-grace-s", "1", *extra]
        child = DaemonProcess(flags, timeout=60)
        ready = child.ready
        daemon = Daemon(child.proc, ready["grpc_port"], ready["grpc_socket"], ready["shm_name"])
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:  # SIGTERM drains: exit 0, segment and socket removed
        assert stop(daemon.proc, timeout=20) == 0
        assert not Path("/dev/shm", daemon.shm_name).exists()
        assert not Path(daemon.socket).exists()
    tmp.cleanup()


@pytest.fixture(scope="module")
def daemon(start_daemon) -> Daemon:
    return start_daemon()


def reap(proc: subprocess.Popen[str]) -> None:
    """Kill a process started here (by its pid) if it still runs; close its pipe."""
    stop(proc, timeout=10, sig=signal.SIGKILL)


def run_worker(code: str, *args: str, timeout: float = 60) -> str:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def wait_stats(client: EmbCacheClient, pred: Callable[[dict], bool], timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = client.stats()
        if pred(stats) or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


TENSORS = """
import torch
def tensors():
    g = torch.Generator().manual_seed(7)
    return {
        f"emb-{dt}": (torch.randn(577, 1024, generator=g) * 3).to(getattr(torch, dt))
        for dt in ("bfloat16", "float16", "float32")
    }
"""

ENCODER = (
    TENSORS
    + """
import sys
from embcache.clients import EmbCacheClient
with EmbCacheClient(sys.argv[1]) as client:
    for key, t in tensors().items():
        assert client.put(key, t) is True
print("encoded")
"""
)

DECODER = (
    TENSORS
    + """
import sys
from embcache.clients import EmbCacheClient
from embcache.clients.device.shm import mapped_segment
want = tensors()
with EmbCacheClient(sys.argv[1]) as client:
    with client.get(list(want), zero_copy=True) as got:  # views of the pool
        for (key, t), g in zip(want.items(), got):
            assert g is not None and g.dtype == t.dtype and torch.equal(g, t), key
            (mapping,) = [m for m in client._state.maps._by_pool_id.values() if m]
            assert mapped_segment(g) == mapping.name, "not zero-copy"
print("decoded")
"""
)


def test_encoder_and_decoder_processes(daemon: Daemon) -> None:
    assert "encoded" in run_worker(ENCODER, f"127.0.0.1:{daemon.grpc_port}")
    assert "decoded" in run_worker(DECODER, daemon.unix)
    # The decoder mapped the segment and exited: the segment must still be there.
    assert Path("/dev/shm", daemon.shm_name).exists()
    with EmbCacheClient(daemon.unix) as client:
        with client.get("emb-float32", zero_copy=True) as (t,):
            assert t is not None and t.shape == (577, 1024)
            assert client.stats()["leases_active"] == 1
        del t  # its view is gone: the lease ends (before the next call)
        stats = client.stats()
        assert stats["leases_active"] == 0 and stats["entries_ready"] >= 3


HOLDER = """
import sys, time, torch
from embcache.clients import EmbCacheClient
client = EmbCacheClient(sys.argv[1], session_socket=sys.argv[2] != "stream")
client.put("held", torch.ones(1000))
# Views, each with a lease: a session on the lane, or a gRPC stream ("stream").
leased = client.get(["held"] * 5, zero_copy=True)
if sys.argv[2] == "anon":  # also hold leases outside any session: they end by TTL
    from embcache.proto.embcache.v1 import embcache_pb2 as pb
    client._conn.stub.Get(pb.GetRequest(keys=["held"] * 3))
print("holding", flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("mode", ["session", "stream", "anon"])
def test_sigkilled_decoder_loses_its_leases(daemon: Daemon, mode: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, daemon.unix, mode], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and "holding" in proc.stdout.readline()
        with EmbCacheClient(daemon.unix) as client:
            held = 5 + (3 if mode == "anon" else 0)
            assert (
                wait_stats(client, lambda s: s["leases_active"] >= held, 5)["leases_active"] == held
            )
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            # Session leases end when the connection drops; anonymous ones by TTL.
            bound = LEASE_TTL_S + 3.0 if mode == "anon" else 5.0
            started = time.monotonic()
            stats = wait_stats(client, lambda s: s["leases_active"] == 0, bound)
            assert stats["leases_active"] == 0, stats
            if mode != "anon":
                assert time.monotonic() - started < 2.0
    finally:
        reap(proc)


STALLED_ENCODER = """
import sys, time
import grpc
from embcache.proto.embcache.v1 import embcache_pb2 as pb, services as rpc
stub = rpc.EmbeddingCacheStub(grpc.insecure_channel(sys.argv[1]))
def messages():
    yield pb.PutRequest(header=pb.PutHeader(key="stalled", dtype="uint8", shape=[32 << 20]))
    for _ in range(3):
        yield pb.PutRequest(chunk=b"\\1" * (1 << 20))
    print("streaming", flush=True)
    time.sleep(60)
stub.Put(messages())
"""


def test_killed_encoder_mid_put_leaves_nothing(daemon: Daemon) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", STALLED_ENCODER, daemon.unix], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and "streaming" in proc.stdout.readline()
        with EmbCacheClient(daemon.unix) as client:
            stats = wait_stats(client, lambda s: s["entries_filling"] == 1, 5)
            assert stats["reserved_filling_bytes"] == 32 << 20
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            stats = wait_stats(client, lambda s: s["entries_filling"] == 0, 5)
            assert stats["reserved_filling_bytes"] == 0 and stats["puts_aborted"] >= 1
            assert client.exists("stalled") is False
            assert client.get_bytes("stalled") is None
    finally:
        reap(proc)


def test_health_and_reflection(daemon: Daemon) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{daemon.grpc_port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        reply = health.Check(health_pb2.HealthCheckRequest(service="embcache.v1.EmbeddingCache"))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        db = ProtoReflectionDescriptorDatabase(channel)
        services = set(db.get_services())
        assert {"embcache.v1.EmbeddingCache", "grpc.health.v1.Health"} <= services
        pool = descriptor_pool.DescriptorPool(db)
        methods = {m.name for m in pool.FindServiceByName("embcache.v1.EmbeddingCache").methods}
        assert {"Put", "PutFromDevice", "Get", "GetInto", "GetBytes", "Session"} <= methods


def test_auth_token(start_daemon) -> None:
    secured = start_daemon("--auth-token", "e2e-secret")
    for target in (secured.unix, f"127.0.0.1:{secured.grpc_port}"):
        with EmbCacheClient(target, retries=0) as anonymous, pytest.raises(Unauthenticated):
            anonymous.stats()
        with EmbCacheClient(target, token="e2e-secret") as client:
            import torch

            client.put("k", torch.ones(3))
            with client.get("k") as (t,):
                assert t.sum().item() == 3


def test_device_rpcs_refused_cleanly_without_cuda(start_daemon) -> None:
    """A CPU-mode daemon asked for a device pool has none: the device RPCs fail with
    FAILED_PRECONDITION (DeviceUnavailable) and the daemon keeps serving."""
    import torch

    from embcache.proto.embcache.v1 import embcache_pb2 as pb
    from embcache.proto.embcache.v1 import services as pb_grpc

    if torch.cuda.is_available():
        pytest.skip("checks CPU mode; tests/gpu covers the device paths")
    d = start_daemon("--device-pool-bytes", "16MiB", "--ipc-mode", "legacy")
    tensor = pb.CudaIpcTensor(
        gpu_uuid="GPU-0", ipc_handle=b"\0" * 64, alloc_size=64, dtype="float16", shape=[2]
    )
    with grpc.insecure_channel(d.unix) as channel:
        stub = pb_grpc.EmbeddingCacheStub(channel)
        for call in (
            lambda: stub.Get(pb.GetRequest(keys=["k"], gpu_uuid="GPU-0")),
            lambda: stub.PutFromDevice(pb.PutFromDeviceRequest(key="k", tensor=tensor)),
            lambda: stub.GetInto(
                pb.GetIntoRequest(keys=["k"], destination=pb.DeviceBuffer(buffer=tensor))
            ),
        ):
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert ("embcache-error", "DeviceUnavailable") in err.value.trailing_metadata()
        assert stub.Exists(pb.ExistsRequest(keys=["k"])).exists == [False]


def test_a_client_finds_the_session_socket_again_after_a_daemon_restart(tmp_path: Path) -> None:
    """A decoder outlives a daemon restart (a rolling update): its next session is on the new
    daemon's lane again, not on gRPC for good."""
    sock = str(tmp_path / "r.sock")
    flags = ["--grpc-socket", sock, "--host-pool-bytes", "64MiB", "--drain-grace-s", "1"]
    first = DaemonProcess(flags, timeout=60)
    second = None
    try:
        with EmbCacheClient(f"unix:{sock}", timeout=10) as client:
            client.put("k", torch.ones(4))
            with client.get("k"):
                assert isinstance(client._conn.session, SocketSession)
            assert first.stop(timeout=30) == 0
            second = DaemonProcess(flags, timeout=60)
            client.put("k", torch.full((4,), 2.0))
            with client.get("k") as (t,):
                assert torch.equal(t, torch.full((4,), 2.0))
                assert isinstance(client._conn.session, SocketSession)
    finally:
        stop(first.proc, timeout=10, sig=signal.SIGKILL)
        if second is not None:
            second.stop(timeout=30)
