"""Listener audit: what the daemon listens on (read from the system), refusal of exposed
binds without a token or TLS, and the token on every gRPC method, every REST route and the
IPC descriptors (host segment names, device pool handles)."""

from __future__ import annotations

import ipaddress
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import psutil
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from relkit import daemon as dm
from relkit import figures
from relkit import malformed_grpc as mg

from embcache.clients import EmbCacheClient
from embcache.clients._backends.sync_socket_session import SocketSession
from embcache.errors import Unauthenticated
from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.service.config import Settings
from embcache.service.device.pool import DevicePool
from embcache.service.engine import CacheEngine
from embcache.service.transport.serving import GrpcServerThread

TOKEN = "rel-" + uuid.uuid4().hex
FIG: dict[str, Any] = {}


def listeners(pid: int) -> tuple[list[tuple[str, int]], list[str]]:
    """(inet listening addresses, unix listening paths) of a process, from the kernel."""
    proc = psutil.Process(pid)
    inet = [
        (c.laddr.ip, c.laddr.port)
        for c in proc.net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    ]
    inodes = {Path(f"/proc/{pid}/fd/{fd}").readlink().name for fd in _fds(pid)}
    inodes = {i[len("socket:[") : -1] for i in inodes if i.startswith("socket:[")}
    unix = []
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        cols = line.split()
        # Num RefCount Protocol Flags Type St Inode [Path]; flags 0x10000 = listening
        if cols[6] in inodes and int(cols[3], 16) & 0x10000:
            unix.append(cols[7] if len(cols) > 7 else "<unnamed>")
    return inet, unix


def _fds(pid: int) -> list[str]:
    return [p.name for p in Path(f"/proc/{pid}/fd").iterdir()]


def loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%")[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped  # gRPC binds 127.0.0.1 as ::ffff:127.0.0.1 on a v6 socket
    return addr.is_loopback


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="eclst-") as tmp:
        yield Path(tmp)
    print("\n" + figures.table("listener audit (CI)", FIG))
    figures.save("listeners", FIG)


@pytest.fixture(scope="module")
def plain(workdir: Path) -> Iterator[dm.Daemon]:
    d = dm.start(dm.DaemonSpec(workdir / "plain"))
    try:
        yield d
    finally:
        assert dm.stop(d) == 0


@pytest.fixture(scope="module")
def guarded(workdir: Path) -> Iterator[dm.Daemon]:
    d = dm.start(dm.DaemonSpec(workdir / "token", token=TOKEN))
    try:
        yield d
    finally:
        assert dm.stop(d) == 0


@pytest.mark.parametrize("which", ["plain", "guarded"])
def test_listens_only_on_loopback_and_unix(which: str, request: pytest.FixtureRequest) -> None:
    d: dm.Daemon = request.getfixturevalue(which)
    inet, unix = listeners(d.pid)
    FIG[f"{which}_inet_listeners"] = [f"{ip}:{port}" for ip, port in inet]
    FIG[f"{which}_unix_listeners"] = unix
    ports = {d.ready["grpc_port"], d.ready["http_port"], d.ready["session_socket_tcp_port"]}
    assert {port for _, port in inet} == ports, inet  # the session socket's TCP port too
    assert all(loopback(ip) for ip, _ in inet), inet
    # The gRPC socket and its session socket, with the same permissions, and nothing else.
    lane = f"{d.socket_path}.lane"
    assert sorted(unix) == [str(d.socket_path), lane], unix
    assert d.ready["session_socket"] == d.ready["session_lane"] == lane  # and its former name
    assert d.ready["tcp_lane_port"] == d.ready["session_socket_tcp_port"]
    assert Path(lane).stat().st_mode & 0o777 == d.socket_path.stat().st_mode & 0o777 == 0o660


def test_token_enforced_on_the_session_socket(guarded: dm.Daemon) -> None:
    """The lane's hello needs the token, on its Unix socket and on TCP; without it no
    session opens."""
    lanes = {
        "session socket": f"{guarded.socket_path}.lane",
        "session socket on TCP": ("127.0.0.1", guarded.ready["session_socket_tcp_port"]),
    }
    for name, address in lanes.items():
        for token in (None, "wrong"):
            with pytest.raises(Unauthenticated):
                SocketSession(address, token, "audit", 5.0)
        session = SocketSession(address, TOKEN, "audit", 5.0)
        try:
            assert session.call(5.0, release=pb.ReleaseRequest()).release.released == 0
        finally:
            session.close()
        FIG[f"{name} without / with token"] = "UNAUTHENTICATED / opened"


EXPOSED = [("--grpc-host", "0.0.0.0"), ("--http-host", "::"), ("--grpc-host", "192.0.2.1")]


@pytest.mark.parametrize(("flag", "host"), EXPOSED)
def test_exposed_bind_without_token_refuses_to_start(workdir: Path, flag: str, host: str) -> None:
    spec = dm.DaemonSpec(workdir / "refuse", extra=(flag, host))
    spec.workdir.mkdir(exist_ok=True)
    done = subprocess.run(
        spec.args(), capture_output=True, text=True, timeout=60, env=dm.clean_env()
    )
    FIG[f"refused {flag} {host}"] = f"exit {done.returncode}"
    assert done.returncode != 0
    assert flag in done.stderr or flag[2:].replace("-", "_") in done.stderr, done.stderr
    assert not (dm.SHM_DIR / spec.shm_name).exists()  # refused before allocating anything


METHODS = sorted(mg.METHODS)


@pytest.mark.parametrize("target", ["tcp", "unix"])
@pytest.mark.parametrize("auth", [None, "Bearer wrong", f"bearer {TOKEN}", TOKEN])
def test_token_enforced_on_every_grpc_method(
    guarded: dm.Daemon, target: str, auth: str | None
) -> None:
    md = (("authorization", auth),) if auth else ()
    address = guarded.tcp if target == "tcp" else guarded.unix
    codes = {}
    with grpc.insecure_channel(address) as channel:
        for method in METHODS:
            case = mg.Case(method, [b""], grpc.StatusCode.UNAUTHENTICATED, md)
            codes[method] = mg.call(channel, case, timeout=5)
        reflection = mg.Case(
            "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
            [b""],
            grpc.StatusCode.UNAUTHENTICATED,
            md,
        )
        codes["reflection"] = mg.call(channel, reflection, timeout=5)
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=5
        )
    assert set(codes.values()) == {grpc.StatusCode.UNAUTHENTICATED}, codes
    assert health.status == health_pb2.HealthCheckResponse.SERVING  # probes stay open
    FIG["grpc_methods_checked"] = len(codes)


def test_descriptors_only_for_authenticated_callers(guarded: dm.Daemon) -> None:
    with EmbCacheClient(guarded.unix, token=TOKEN) as client:
        client.put("secret", torch.arange(16, dtype=torch.uint8))
        assert client.stats()["leases_active"] == 0
        with grpc.insecure_channel(guarded.unix) as channel:
            raw = pb.GetRequest(keys=["secret"]).SerializeToString()
            try:
                channel.unary_unary(mg.SERVICE + "Get")(raw, timeout=5)
                leaked = "answered"
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.UNAUTHENTICATED
                leaked = err.details() or ""
            ok = channel.unary_unary(mg.SERVICE + "Get")(
                raw, timeout=5, metadata=(("authorization", f"Bearer {TOKEN}"),)
            )
        reply = pb.GetResponse.FromString(ok)
        assert reply.pools[0].host_shm.segment_name == guarded.ready["shm_name"]
        client.release([r.lease_id for r in reply.results])
    assert guarded.ready["shm_name"] not in leaked and "secret" not in leaked, leaked
    for path in ("/livez", "/readyz", "/openapi.json", "/"):  # open without a token
        body = httpx.get(guarded.http + path, timeout=10).text
        assert guarded.ready["shm_name"] not in body and str(guarded.socket_path) not in body, path


def test_token_enforced_on_every_rest_route(guarded: dm.Daemon) -> None:
    spec = httpx.get(guarded.http + "/openapi.json", timeout=10).json()
    public = {"/livez", "/readyz"}
    checked = 0
    for path, ops in spec["paths"].items():
        url = path.replace("{key}", "secret").replace("{key:path}", "secret")
        for method in ops:
            for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": TOKEN}):
                r = httpx.request(method.upper(), guarded.http + url, headers=headers, timeout=10)
                if path in public:
                    assert r.status_code == 200, (method, path)
                else:
                    assert r.status_code == 401, (method, path, headers, r.status_code)
                    assert r.json()["error"] == "Unauthenticated"
                checked += 1
    r = httpx.get(guarded.http + "/v1/stats", headers=guarded.headers(), timeout=10)
    assert r.status_code == 200
    FIG["rest_requests_checked"] = checked


def test_device_pool_handles_only_for_authenticated_callers(tmp_path: Path, shm_name: str) -> None:
    """In-process server with a CPU device pool (CI has no GPU): the pool descriptor is in
    the reply only for a caller with the token."""
    settings = Settings(
        grpc_port=0,
        grpc_socket=tmp_path / "d.sock",
        shm_name=shm_name,
        host_pool_bytes=4 << 20,
        page_bytes=64 << 10,
        device="cpu",
        auth_token=TOKEN,
    )
    pool = DevicePool(torch.device("cpu"), 16 * (64 << 10), 64 << 10)
    engine = CacheEngine(settings, device_pools=[pool])
    thread = GrpcServerThread(engine, settings)
    try:
        service = thread.start()
        engine.put("k", torch.arange(100, dtype=torch.uint8))
        raw = pb.GetRequest(keys=["k"], gpu_uuid="CPU-0").SerializeToString()
        with grpc.insecure_channel(f"unix:{service.socket_path}") as channel:
            get = channel.unary_unary(mg.SERVICE + "Get")
            with pytest.raises(grpc.RpcError) as err:
                get(raw, timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert pool.pool_id not in (err.value.details() or "")
            assert engine.stats().leases_active == 0  # refused before any lease
            reply = pb.GetResponse.FromString(
                get(raw, timeout=5, metadata=(("authorization", f"Bearer {TOKEN}"),))
            )
        assert reply.pools[0].pool_id == pool.pool_id and reply.pools[0].HasField("device")
        engine.release([r.lease_id for r in reply.results])
    finally:
        thread.stop()
        engine.close()
