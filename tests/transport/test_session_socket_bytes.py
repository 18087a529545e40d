"""get_bytes on the session socket (service/transport/session/bytes_out.py), and the session
socket on TCP for clients that reach gRPC over TCP (the Lanes RPC): bytes, ranges, misses,
bad input, auth, hostile readers, concurrency and the fallbacks, with no lease left behind."""

from __future__ import annotations

import asyncio
import socket
import struct

import pytest
import torch

from embcache.clients import AsyncEmbCacheClient, EmbCacheClient
from embcache.clients._backends.sync_session import Session
from embcache.clients._backends.sync_socket_session import SocketSession
from embcache.clients.core.targets import tcp_address
from embcache.errors import InvalidArgument, Unauthenticated
from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.service.transport.session import bytes_out

KiB, MiB = 1 << 10, 1 << 20
HEADER = struct.Struct("<I")


def tcp_target(thread) -> str:  # type: ignore[no-untyped-def]
    return f"127.0.0.1:{thread.service.ports[0]}"


def lane_port(thread) -> int:  # type: ignore[no-untyped-def]
    return int(thread.service.servicer.session_socket_tcp_port)


def test_targets_name_their_tcp_host() -> None:
    assert tcp_address("127.0.0.1:7470", 9) == ("127.0.0.1", 9)
    assert tcp_address("[::1]:7470", 9) == ("::1", 9)
    assert tcp_address("dns:///node-3:7470", 9) == ("node-3", 9)
    assert tcp_address("unix:/run/embcache.sock", 9) is None
    assert tcp_address("no-port", 9) is None


def test_a_tcp_client_gets_bytes_on_the_session_socket(server_factory) -> None:
    with server_factory(host_pool_bytes=16 * MiB) as (engine, thread):
        assert lane_port(thread) > 0
        x = torch.arange(MiB, dtype=torch.float32)  # 4 MiB
        with EmbCacheClient(tcp_target(thread), timeout=10) as client:
            client.put("k", x)
            got = client.get_bytes("k")
            assert isinstance(client._conn.session, SocketSession)  # the TCP session socket
            assert got is not None and got.dtype == "float32" and got.shape == (MiB,)
            assert torch.equal(got.tensor(), x)
            part = client.get_bytes("k", offset=12, length=40)
            assert part is not None and bytes(part.data) == x.numpy().tobytes()[12:52]
            assert client.get_bytes("k", offset=4 * MiB) is not None  # empty tail
            assert client.get_bytes("missing") is None
            for offset, length in ((5, 4 * MiB), (4 * MiB + 1, None), (0, 1 << 62)):
                with pytest.raises(InvalidArgument):
                    client.get_bytes("k", offset=offset, length=length)
            assert engine.stats().leases_active == 0  # each call's lease ended with it
        metrics = thread.service.servicer.metrics
        assert ("lane", "Session.GetBytes", "OK") in metrics.by_transport
        assert ("lane", "Session.GetBytes", "INVALID_ARGUMENT") in metrics.by_transport


def test_bytes_of_an_entry_in_several_runs(server_factory, wait_until) -> None:
    """An entry whose pages are scattered comes back whole and in order."""
    with server_factory(host_pool_bytes=1 * MiB, page_bytes=64 * KiB) as (engine, thread):
        for i in range(16):  # fill the pool, then free every other page
            engine.put(f"f{i}", torch.full((16 * KiB,), i, dtype=torch.int32))
        engine.evict([f"f{i}" for i in range(0, 16, 2)])
        x = torch.arange(5 * 16 * KiB, dtype=torch.int32)  # 5 pages in 5 runs, 320 KiB:
        engine.put("scattered", x)  # above COPY_BYTES, so sent as views of its runs
        assert len(engine.entry_info("scattered").page_runs) == 5
        assert x.numel() * 4 > bytes_out.COPY_BYTES
        with EmbCacheClient(f"unix:{thread.service.socket_path}", timeout=10) as client:
            got = client.get_bytes("scattered")
            assert isinstance(client._conn.session, SocketSession)  # the Unix session socket
            assert got is not None and torch.equal(got.tensor(), x)
            mid = client.get_bytes("scattered", offset=64 * KiB - 8, length=16)
            assert mid is not None and bytes(mid.data) == x.numpy().tobytes()[64 * KiB - 8 :][:16]
        # The daemon runs in this process: its loop ends the last reply's lease as it sends
        # the last bytes, which this thread may read first.
        assert wait_until(lambda: engine.stats().leases_active == 0)


def test_concurrent_readers_each_get_their_own_bytes(server_factory, concurrently) -> None:
    """Several threads share one session socket: each payload reaches its own caller."""
    with server_factory(host_pool_bytes=16 * MiB) as (engine, thread):
        entries = {f"e{i}": torch.full((64 * KiB + i,), i, dtype=torch.int16) for i in range(8)}
        for key, t in entries.items():
            engine.put(key, t)
        with EmbCacheClient(tcp_target(thread), timeout=20) as client:

            def work(seed: int) -> None:
                for n in range(20):
                    key = f"e{(seed + n) % 8}"
                    got = client.get_bytes(key)
                    assert got is not None and torch.equal(got.tensor(), entries[key]), key

            concurrently(work, 4)
        assert engine.stats().leases_active == 0


def test_the_asyncio_client_gets_bytes_on_the_tcp_session_socket(server_factory) -> None:
    with server_factory(host_pool_bytes=8 * MiB) as (engine, thread):
        x = torch.randn(300, 700)
        engine.put("k", x)

        async def main() -> None:
            async with AsyncEmbCacheClient(tcp_target(thread), timeout=10) as client:
                got, miss = await asyncio.gather(client.get_bytes("k"), client.get_bytes("x"))
                assert got is not None and torch.equal(got.tensor(), x) and miss is None
                assert type(client._conn.session).__name__ == "AsyncSocketSession"

        asyncio.run(main())
        assert engine.stats().leases_active == 0


def test_the_tcp_session_socket_checks_the_token(server_factory) -> None:
    with server_factory(auth_token="s3cret") as (engine, thread):
        engine.put("k", torch.ones(4))
        with pytest.raises(Unauthenticated):
            SocketSession(("127.0.0.1", lane_port(thread)), "wrong", "t", 10)
        with EmbCacheClient(tcp_target(thread), token="s3cret", timeout=10) as client:
            got = client.get_bytes("k")
            assert got is not None and torch.equal(got.tensor(), torch.ones(4))
            assert isinstance(client._conn.session, SocketSession)


def test_a_reader_that_stops_reading_leaves_nothing_behind(server_factory, wait_until) -> None:
    """A raw TCP client asks for many large entries, reads none of it and goes: the daemon
    holds at most a reply's bytes meanwhile, keeps no lease, and serves others on."""
    with server_factory(host_pool_bytes=16 * MiB) as (engine, thread):
        engine.put("big", torch.zeros(2 * MiB, dtype=torch.uint8))
        sock = socket.create_connection(("127.0.0.1", lane_port(thread)), timeout=10)
        hello = pb.SessionRequest(hello=pb.SessionHello(client_name="hostile", pid=1))
        calls = [hello] + [
            pb.SessionRequest(
                call=pb.SessionCall(call_id=i, get_bytes=pb.GetBytesRequest(key="big"))
            )
            for i in range(1, 200)
        ]
        for msg in calls:
            body = msg.SerializeToString()
            sock.sendall(HEADER.pack(len(body)) + body)
        with EmbCacheClient(tcp_target(thread), timeout=10) as other:
            got = other.get_bytes("big")
            assert got is not None and len(got.data) == 2 * MiB
        sock.close()
        assert wait_until(lambda: len(thread.service.servicer.sessions) == 0)
        assert engine.stats().leases_active == 0


def test_without_the_tcp_session_socket_a_tcp_client_uses_grpc(server_factory) -> None:
    with server_factory(session_socket_tcp=False) as (engine, thread):
        assert lane_port(thread) == 0
        engine.put("k", torch.arange(10))
        with EmbCacheClient(tcp_target(thread), timeout=10) as client:
            got = client.get_bytes("k")
            assert got is not None and torch.equal(got.tensor(), torch.arange(10))
            with client.get("k"):
                assert isinstance(client._conn.session, Session)  # a gRPC Session stream


def test_a_tls_client_never_uses_the_plain_tcp_session_socket() -> None:
    client = EmbCacheClient("127.0.0.1:1", tls=True, timeout=1)
    try:
        assert client._conn.opener.socket_over_tcp is False
    finally:
        client.close()


def test_get_bytes_on_a_grpc_session_stream_is_refused(server_factory) -> None:
    """The stream's frames are protobuf messages: no raw bytes can follow a result there."""
    with server_factory() as (engine, thread):
        engine.put("k", torch.ones(3))
        with EmbCacheClient(tcp_target(thread), timeout=10, session_socket=False) as client:
            session = client._conn.open_session()
            assert isinstance(session, Session) and not session.serves_bytes_out
            result = session.call(10, get_bytes=pb.GetBytesRequest(key="k"))
            assert result.error.code == "INVALID_ARGUMENT"
            got = client.get_bytes("k")  # the client streams it over gRPC instead
            assert got is not None and torch.equal(got.tensor(), torch.ones(3))
        assert engine.stats().leases_active == 0


def test_the_lease_ends_before_the_reader_has_the_bytes(server_factory) -> None:
    """A reader that evicts what it just read finds it no longer leased: the reply's lease
    ends inside the daemon's last send of its bytes, not some time after."""
    with server_factory(host_pool_bytes=64 * MiB) as (engine, thread):
        client = EmbCacheClient(tcp_target(thread), timeout=10)
        with client:
            for i in range(20):
                client.put(f"k{i}", torch.full((MiB,), i, dtype=torch.float32))  # 4 MiB
                got = client.get_bytes(f"k{i}")
                assert got is not None and len(got.data) == 4 * MiB
                # A call on the daemon's loop comes after the reply's lease ended.
                assert client.evict(f"k{i}") == "evicted"  # EntryLeased otherwise
        assert engine.stats().entries_ready == 0


def test_a_reader_that_never_reads_is_closed_before_the_lease_ends(
    server_factory, monkeypatch, wait_until
) -> None:
    """Bytes left unsent past the drain deadline: the daemon closes the connection (dropping
    the views it buffered) and ends the lease, while the reader still holds its socket."""
    monkeypatch.setattr(bytes_out, "DRAIN_S", 0.3)
    with server_factory(host_pool_bytes=64 * MiB) as (engine, thread):
        engine.put("big", torch.zeros(32 * MiB, dtype=torch.uint8))
        sock = socket.create_connection(("127.0.0.1", lane_port(thread)), timeout=10)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        try:
            hello = pb.SessionRequest(hello=pb.SessionHello(client_name="stalled", pid=1))
            call = pb.SessionCall(call_id=1, get_bytes=pb.GetBytesRequest(key="big"))
            for msg in (hello, pb.SessionRequest(call=call)):
                body = msg.SerializeToString()
                sock.sendall(HEADER.pack(len(body)) + body)
            assert wait_until(lambda: engine.stats().leases_active == 1)  # the reply's
            assert wait_until(lambda: len(thread.service.servicer.sessions) == 0, timeout=10)
            assert engine.stats().leases_active == 0
            assert client_evicts(thread, "big")
        finally:
            sock.close()


def client_evicts(thread, key: str) -> bool:  # type: ignore[no-untyped-def]
    with EmbCacheClient(tcp_target(thread), timeout=10) as client:
        return client.evict(key) == "evicted"
