"""The session socket (service/transport/session_socket/server.py,
clients/_backends/*_socket_session.py): Session calls over a plain Unix socket next to the
gRPC one. The calls themselves are tested on both transports in test_grpc_session_calls.py;
here: the raw wire, bad input, auth, the end of a session, the client's deadline and
fallback."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from embcache.clients import EmbCacheClient, RpcFailed
from embcache.clients._backends.async_socket_session import AsyncSocketSession
from embcache.clients._backends.sync_session import Session
from embcache.clients._backends.sync_socket_session import SocketSession
from embcache.clients.core.session_calls import SessionLost
from embcache.clients.core.targets import session_socket_path
from embcache.errors import Unauthenticated
from embcache.proto.constants import MAX_MESSAGE_BYTES
from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.service.engine import CacheEngine
from embcache.service.transport.serving import GrpcServerThread

KiB, MiB = 1 << 10, 1 << 20
HEADER = struct.Struct("<I")


@pytest.fixture
def server(counting_server):  # type: ignore[no-untyped-def]
    return counting_server


def lane_of(server: tuple[CacheEngine, GrpcServerThread]) -> str:
    path = session_socket_path(f"unix:{server[1].service.socket_path}")
    assert path is not None
    return path


def send(sock: socket.socket, msg: pb.SessionRequest) -> None:
    body = msg.SerializeToString()
    sock.sendall(HEADER.pack(len(body)) + body)


def recv(sock: socket.socket) -> pb.SessionResponse | None:
    """The next message, or None once the daemon closed the connection."""
    head = _exactly(sock, HEADER.size)
    if head is None:
        return None
    body = _exactly(sock, HEADER.unpack(head)[0])
    return None if body is None else pb.SessionResponse.FromString(body)


def _exactly(sock: socket.socket, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        got = sock.recv(n - len(data))
        if not got:
            return None
        data += got
    return data


def closed_by_daemon(sock: socket.socket) -> bool:
    try:
        return sock.recv(1 << 16) == b""
    except ConnectionResetError:
        return True


def connect(server: tuple[CacheEngine, GrpcServerThread], hello: bool = True) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(lane_of(server))
    if hello:
        send(sock, pb.SessionRequest(hello=pb.SessionHello(client_name="raw", pid=1)))
        opened = recv(sock)
        assert opened is not None and opened.WhichOneof("kind") == "opened"
    return sock


# -- the raw wire ----------------------------------------------------------------------------
def test_raw_calls_and_the_end_of_the_session(server, wait_until) -> None:
    engine, thread = server
    engine.put("k", torch.arange(6, dtype=torch.int32))
    with connect(server) as sock:
        send(sock, pb.SessionRequest(ping=7))
        assert recv(sock) == pb.SessionResponse(pong=7)
        get = pb.SessionCall(call_id=5, get=pb.GetRequest(keys=["k", "nope"]))
        send(sock, pb.SessionRequest(call=get))
        msg = recv(sock)
        assert msg is not None and msg.result.call_id == 5
        found, missing = msg.result.get.results
        assert found.found and not missing.found
        assert engine.stats().leases_active == 1
        assert len(thread.service.servicer.sessions) == 1
        bad = pb.SessionCall(call_id=6, get=pb.GetRequest(keys=["k"], ttl_s=1e12))
        send(sock, pb.SessionRequest(call=bad))  # typed error; the session stays open
        msg = recv(sock)
        assert msg is not None and msg.result.error.code == "INVALID_ARGUMENT"
        assert engine.stats().leases_active == 1
    # Closing the connection ends the session: its lease goes at once.
    assert wait_until(lambda: engine.stats().leases_active == 0)
    assert wait_until(lambda: len(thread.service.servicer.sessions) == 0)
    metrics = thread.service.servicer.metrics
    assert ("lane", "Session.Get", "OK") in metrics.by_transport
    assert ("lane", "Session.Get", "INVALID_ARGUMENT") in metrics.by_transport


@pytest.mark.parametrize(
    "payload",
    [
        pytest.param(lambda: HEADER.pack(MAX_MESSAGE_BYTES + 1), id="too-large"),
        pytest.param(lambda: HEADER.pack(3) + b"\xff\xff\xff", id="undecodable"),
        pytest.param(lambda: HEADER.pack(0), id="empty-message"),
    ],
)
def test_malformed_messages_close_the_connection(server, payload, wait_until) -> None:
    engine, thread = server
    engine.put("k", torch.ones(4))
    with connect(server) as sock:
        send(sock, pb.SessionRequest(call=pb.SessionCall(call_id=1, get=pb.GetRequest(keys=["k"]))))
        assert recv(sock) is not None
        assert engine.stats().leases_active == 1
        sock.sendall(payload())
        assert closed_by_daemon(sock)
    assert wait_until(lambda: engine.stats().leases_active == 0)
    assert wait_until(lambda: len(thread.service.servicer.sessions) == 0)
    with EmbCacheClient(f"unix:{thread.service.socket_path}", timeout=10) as client:
        assert client.exists(["k"]) == [True]  # the daemon is still serving


def test_a_call_before_the_hello_closes_the_connection(server) -> None:
    engine, thread = server
    engine.put("k", torch.ones(4))
    with connect(server, hello=False) as sock:
        send(sock, pb.SessionRequest(call=pb.SessionCall(call_id=1, get=pb.GetRequest(keys=["k"]))))
        assert closed_by_daemon(sock)
    assert engine.stats().leases_active == 0
    assert len(thread.service.servicer.sessions) == 0


def test_a_client_that_does_not_read_is_held_back(server, wait_until) -> None:
    """Calls sent without reading their results: the daemon stops reading the connection
    once its replies back up, so the sender blocks instead of the daemon's memory growing;
    closing the connection cleans everything up."""
    engine, thread = server
    keys = [f"missing-{i}-" + "x" * 1000 for i in range(50)]  # a ~50 KB reply per call
    call = pb.SessionRequest(call=pb.SessionCall(call_id=1, get=pb.GetRequest(keys=keys)))
    body = call.SerializeToString()
    frame = HEADER.pack(len(body)) + body
    sent = 0
    with connect(server) as sock:
        sock.settimeout(2.0)
        with pytest.raises(TimeoutError):
            for _ in range(500):  # 25 MB if nothing held the sender back
                sock.sendall(frame)
                sent += 1
    assert sent < 100, sent
    assert wait_until(lambda: len(thread.service.servicer.sessions) == 0)
    assert wait_until(lambda: thread.service.session_socket.connections == 0)
    assert engine.stats().leases_active == 0
    with EmbCacheClient(f"unix:{thread.service.socket_path}", timeout=10) as client:
        assert client.exists(["nope"]) == [False]


@hsettings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(junk=st.lists(st.binary(max_size=64), min_size=1, max_size=4))
def test_junk_after_the_hello_leaves_nothing_behind(server, junk: list[bytes], wait_until) -> None:
    """Arbitrary frames (whatever they decode to) after a valid hello: the daemon answers or
    closes the connection; afterwards no lease, session or reserved page is left."""
    engine, thread = server
    if not engine.exists(["k"])[0]:
        engine.put("k", torch.ones(4))
    with connect(server) as sock:
        for body in junk:
            try:
                sock.sendall(HEADER.pack(len(body)) + body)
            except (BrokenPipeError, ConnectionResetError):
                break
    assert wait_until(lambda: engine.stats().leases_active == 0)
    assert wait_until(lambda: len(thread.service.servicer.sessions) == 0)
    assert wait_until(lambda: thread.service.session_socket.connections == 0)
    stats = engine.stats()
    assert stats.entries_filling == 0 and stats.reserved_filling_bytes == 0
    assert stats.lease_owners == 0


# -- auth -------------------------------------------------------------------------------------
@pytest.fixture
def token_server(server_factory) -> Iterator[tuple[CacheEngine, GrpcServerThread]]:  # type: ignore[no-untyped-def]
    with server_factory(auth_token="s3cret") as pair:
        yield pair


def test_the_session_socket_checks_the_token(token_server) -> None:
    _, thread = token_server
    with connect(token_server, hello=False) as sock:
        send(sock, pb.SessionRequest(hello=pb.SessionHello(client_name="x", auth_token="wrong")))
        msg = recv(sock)
        assert msg is not None and msg.result.error.code == "UNAUTHENTICATED"
        assert closed_by_daemon(sock)
    assert len(thread.service.servicer.sessions) == 0
    target = f"unix:{thread.service.socket_path}"
    with pytest.raises(Unauthenticated):
        SocketSession(lane_of(token_server), None, "x", 5.0)
    with EmbCacheClient(target, token="s3cret", timeout=10) as client:
        client.put("k", torch.ones(3))
        with client.get("k") as (t,):
            assert torch.equal(t, torch.ones(3))
            assert isinstance(client._conn.session, SocketSession)
    with (
        EmbCacheClient(target, token="wrong", timeout=10, retries=0) as client,
        pytest.raises(Unauthenticated),
    ):
        client.get("k")


# -- the client -------------------------------------------------------------------------------
def test_a_daemon_without_a_session_socket_is_reached_over_grpc(server_factory) -> None:
    with server_factory(session_socket=False) as (_, thread):
        sock = thread.service.session_socket
        assert sock is None or sock.path is None  # TCP only
        with EmbCacheClient(f"unix:{thread.service.socket_path}", timeout=10) as client:
            client.put("k", torch.ones(2))
            with client.get("k") as (t,):
                assert torch.equal(t, torch.ones(2))
            assert isinstance(client._conn.session, Session)


def test_each_new_session_looks_for_the_session_socket_again(
    server, monkeypatch, wait_until
) -> None:
    """A lane that could not be opened (the daemon was restarting) is tried again with the
    next session, so a client does not stay on gRPC for good."""
    engine, thread = server
    engine.put("k", torch.ones(2))
    real = SocketSession.__init__
    failures = [ConnectionRefusedError("the daemon is restarting")]

    def flaky(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        if failures:
            raise failures.pop()
        real(self, *args, **kwargs)

    monkeypatch.setattr(SocketSession, "__init__", flaky)
    with EmbCacheClient(f"unix:{thread.service.socket_path}", timeout=10) as client:
        with client.get("k"):
            assert isinstance(client._conn.session, Session)
        client._conn.drop_session()  # as when the daemon restarts: the stream ends
        with client.get("k"):
            assert isinstance(client._conn.session, SocketSession)
    assert wait_until(lambda: engine.stats().leases_active == 0)


def test_the_session_socket_path_of_targets() -> None:
    assert session_socket_path("unix:/run/embcache/g.sock") == "/run/embcache/g.sock.lane"
    assert session_socket_path("unix:///run/g.sock") == "/run/g.sock.lane"
    assert session_socket_path("127.0.0.1:7470") is None
    assert session_socket_path("unix-abstract:embcache") is None


class FakeLane:
    """A lane that opens sessions and then answers only when told to."""

    def __init__(self, directory: str) -> None:
        self.path = str(Path(directory) / "fake.sock.lane")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.path)
        self.listener.listen(1)
        self.received: list[pb.SessionRequest] = []
        self.conn: socket.socket | None = None
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):  # until close()
            self._serve_one()

    def _serve_one(self) -> None:
        conn, _ = self.listener.accept()
        self.conn = conn
        while (head := _exactly(conn, HEADER.size)) is not None:
            body = _exactly(conn, HEADER.unpack(head)[0])
            if body is None:
                break
            msg = pb.SessionRequest.FromString(body)
            self.received.append(msg)
            if msg.WhichOneof("kind") == "hello":
                opened = pb.SessionOpened(session_id="session:fake", calls=True)
                body = pb.SessionResponse(opened=opened).SerializeToString()
                conn.sendall(HEADER.pack(len(body)) + body)
                self.ready.set()

    def answer(self, result: pb.SessionResult) -> None:
        assert self.conn is not None
        body = pb.SessionResponse(result=result).SerializeToString()
        self.conn.sendall(HEADER.pack(len(body)) + body)

    def close(self) -> None:
        if self.conn is not None:
            with contextlib.suppress(OSError):
                self.conn.shutdown(socket.SHUT_RDWR)
            self.conn.close()
        self.listener.close()


def test_deadline_then_a_late_result_is_released(wait_until) -> None:
    with tempfile.TemporaryDirectory(prefix="ecl-") as d:
        fake = FakeLane(d)
        try:
            session = SocketSession(fake.path, None, "t", 5.0)
            assert session.session_id == "session:fake" and session.serves_calls
            t0 = time.monotonic()
            with pytest.raises(RpcFailed) as err:
                session.call(0.2, get=pb.GetRequest(keys=["k"]))
            assert err.value.code == "DEADLINE_EXCEEDED"
            assert 0.15 < time.monotonic() - t0 < 3
            # The result arrives after its caller gave up: its lease is released. The next
            # call reads it (callers read the socket themselves) and then its own result.
            late = pb.GetResponse(results=[pb.GetResult(key="k", found=True, lease_id=42)])
            fake.answer(pb.SessionResult(call_id=1, get=late))
            fake.answer(pb.SessionResult(call_id=2, release=pb.ReleaseResponse(released=0)))
            result = session.call(5.0, release=pb.ReleaseRequest(lease_ids=[]))
            assert result.call_id == 2
            assert wait_until(
                lambda: any(
                    m.WhichOneof("kind") == "call" and list(m.call.release.lease_ids) == [42]
                    for m in fake.received
                )
            )
            # The lane closing wakes a waiting caller with SessionLost.
            threading.Timer(0.2, fake.close).start()
            with pytest.raises(RpcFailed) as lost:
                session.call(5.0, get=pb.GetRequest(keys=["k"]))
            assert lost.value.code == "UNAVAILABLE"
            assert not session.alive
            session.close()
        finally:
            fake.close()


def test_a_result_read_by_another_caller_wakes_its_own_at_once(monkeypatch) -> None:
    """Caller A reads the socket when B's result arrives: B returns at once, not when the
    next message (A's, a second later) comes in, however slowly A hands the result over."""
    real = SocketSession._dispatch

    def slow(self, msg):  # type: ignore[no-untyped-def]
        time.sleep(0.1)  # as if A's thread were descheduled here
        real(self, msg)

    monkeypatch.setattr(SocketSession, "_dispatch", slow)
    with tempfile.TemporaryDirectory(prefix="ecl-") as d:
        fake = FakeLane(d)
        try:
            session = SocketSession(fake.path, None, "t", 5.0)
            done: dict[str, float] = {}

            def call(name: str) -> None:
                session.call(5.0, release=pb.ReleaseRequest())
                done[name] = time.monotonic()

            a = threading.Thread(target=call, args=("a",))  # call id 1: it reads first
            a.start()
            time.sleep(0.2)
            b = threading.Thread(target=call, args=("b",))  # call id 2: waits for the reader
            b.start()
            time.sleep(0.2)
            sent = time.monotonic()
            fake.answer(pb.SessionResult(call_id=2, release=pb.ReleaseResponse()))
            time.sleep(1.0)
            fake.answer(pb.SessionResult(call_id=1, release=pb.ReleaseResponse()))
            a.join(10)
            b.join(10)
            assert done["b"] - sent < 0.5, done["b"] - sent
            assert done["a"] - sent >= 1.0
            session.close()
        finally:
            fake.close()


def test_concurrent_callers_share_one_session_socket(server, wait_until, concurrently) -> None:
    """Several threads with calls in flight: each gets its own result, whoever reads it."""
    engine, thread = server
    data = {f"k{i}": torch.full((64,), float(i)) for i in range(8)}
    for key, value in data.items():
        engine.put(key, value)
    session = SocketSession(lane_of(server), None, "t", 5.0)

    def caller(seed: int) -> None:
        for j in range(50):
            key = f"k{(seed + j) % 8}"
            result = session.call(10.0, get=pb.GetRequest(keys=[key]))
            (r,) = result.get.results
            assert r.key == key and r.found
            released = session.call(10.0, release=pb.ReleaseRequest(lease_ids=[r.lease_id]))
            assert released.release.released == 1

    concurrently(caller, 4)
    assert engine.stats().leases_active == 0
    session.close()
    assert wait_until(lambda: len(thread.service.servicer.sessions) == 0)


def test_stopping_the_server_ends_session_socket_sessions(server_factory) -> None:
    with server_factory() as (engine, thread):
        engine.put("k", torch.ones(4))
        client = EmbCacheClient(f"unix:{thread.service.socket_path}", timeout=5, retries=0)
        try:  # closed even when an assertion fails: else its socket outlives the test
            held = client.get("k", zero_copy=True)  # a view: leased
            assert engine.stats().leases_active == 1
            session = client._conn.session
            assert isinstance(session, SocketSession)
            path = lane_of((engine, thread))
            thread.stop()
            assert engine.stats().leases_active == 0
            assert not Path(path).exists()
            with pytest.raises(RpcFailed):
                session.call(2.0, get=pb.GetRequest(keys=["k"]))
            held.tensors.clear()
        finally:
            client.close()


def test_async_session_socket_deadline_late_result_and_close(wait_until) -> None:
    """The asyncio client's lane: a call past its deadline, its late result's lease released,
    a lane that closes failing the next call with SessionLost."""

    async def main(fake: FakeLane) -> None:
        session = await AsyncSocketSession.open(fake.path, None, "t", 5.0)
        assert session.session_id == "session:fake" and session.alive
        with pytest.raises(RpcFailed) as err:
            await session.call(0.2, get=pb.GetRequest(keys=["k"]))
        assert err.value.code == "DEADLINE_EXCEEDED"
        late = pb.GetResponse(results=[pb.GetResult(key="k", found=True, lease_id=7)])
        fake.answer(pb.SessionResult(call_id=1, get=late))
        assert await asyncio.to_thread(
            wait_until,
            lambda: any(
                m.WhichOneof("kind") == "call" and list(m.call.release.lease_ids) == [7]
                for m in fake.received
            ),
        )
        fake.close()
        with pytest.raises(SessionLost):
            await session.call(5.0, get=pb.GetRequest(keys=["k"]))
        for _ in range(500):  # the reader task sees the end of the stream
            if not session.alive:
                break
            await asyncio.sleep(0.01)
        assert not session.alive
        await session.close()

    with tempfile.TemporaryDirectory(prefix="ecl-") as d:
        fake = FakeLane(d)
        try:
            asyncio.run(main(fake))
        finally:
            fake.close()


def test_async_session_socket_checks_the_token(token_server, wait_until) -> None:
    async def main() -> None:
        with pytest.raises(Unauthenticated):
            await AsyncSocketSession.open(lane_of(token_server), "wrong", "t", 5.0)
        session = await AsyncSocketSession.open(lane_of(token_server), "s3cret", "t", 5.0)
        result = await session.call(5.0, release=pb.ReleaseRequest())
        assert result.release.released == 0
        await session.close()

    asyncio.run(main())
    assert wait_until(lambda: len(token_server[1].service.servicer.sessions) == 0)


@pytest.mark.parametrize("spin_us", [0, 300, 50_000])
def test_the_client_spins_or_sleeps_for_its_results(server, spin_us: int) -> None:
    """``spin_us``: results are polled for without sleeping first (0: poll() at once); either
    way each call gets its own result, and a daemon that closes the socket while a caller
    spins ends the session rather than hanging the caller."""
    engine, thread = server
    engine.put("k", torch.arange(5))
    target = f"unix:{thread.service.socket_path}"
    # Gets with a miss are calls (the read table cannot answer them): the caller waits for
    # each result.
    with EmbCacheClient(target, timeout=10, spin_us=spin_us) as client:
        for _ in range(20):
            with client.get(["k", "nope"]) as (t, miss):
                assert torch.equal(t, torch.arange(5)) and miss is None
        session = client._conn.session
        assert isinstance(session, SocketSession) and session._spin_s == spin_us / 1e6
        [view] = thread.service.servicer.admin.views()  # an operator drops the session:
        thread.service.servicer.admin.drop(view.session_id)  # the daemon closes its socket
        with client.get(["k", "nope"]) as (t, miss):  # a new session
            assert torch.equal(t, torch.arange(5)) and miss is None
        assert client._conn.session is not session


@pytest.mark.parametrize("spin_us", [0, 300])
def test_a_call_expected_to_take_long_spins_longer(server, monkeypatch, spin_us: int) -> None:
    """A call whose copies take long (a GetInto into a large buffer, a device put) adds their
    expected time to the spin of a session that spins; a session that does not spin (0, or
    TCP) still sleeps at once."""
    from embcache.clients.core import session_calls as sc

    engine, _ = server
    engine.put("k", torch.arange(5))
    session = SocketSession(lane_of(server), None, "spin", 10, spin_s=spin_us / 1e6)
    spins: list[float] = []
    spin_recv = session._spin_recv

    def watched(spin_s: float) -> bytes | None:
        spins.append(spin_s)
        return spin_recv(spin_s)

    monkeypatch.setattr(session, "_spin_recv", watched)

    def into(nbytes: int) -> pb.GetIntoRequest:  # a buffer the daemon cannot open: CPU mode
        buf = pb.CudaIpcTensor(gpu_uuid="GPU-x", ipc_handle=b"h" * 64, alloc_size=nbytes,
                               dtype="uint8", shape=[nbytes])  # fmt: skip
        return pb.GetIntoRequest(keys=["k"], destination=pb.DeviceBuffer(buffer=buf))

    try:
        for nbytes, expect in ((0, 0.0), (4 * MiB, 4 * MiB / 10e9), (1 << 40, 2e-3)):
            request = {"get_into": into(nbytes)}
            assert sc.expected_work_s(request) == pytest.approx(expect)
            spins.clear()
            result = session.call(10, **request)
            assert result.HasField("error")  # answered (refused: no CUDA here)
            base = spin_us / 1e6
            assert spins[:1] == ([pytest.approx(base + expect)] if base else [])
    finally:
        session.close()
    fp = pb.PutFromDeviceBatchRequest(
        items=[pb.PutFromDeviceRequest(tensor=pb.CudaIpcTensor(dtype="bfloat16", shape=[8, 4]))]
    )
    assert sc.expected_work_s({"put_from_device_batch": fp}) == pytest.approx(64 / 10e9)
    assert sc.expected_work_s({"get": pb.GetRequest(keys=["k"])}) == 0.0
