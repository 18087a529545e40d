"""Host gets whose small entries come back as copies after the result, on the session socket
(service/transport/session/inline_gets.py): bytes and dtypes, the per-reply budget, the views
that stay views, remote clients, the gRPC stream that ignores the wish, hostile readers, and
no lease left behind."""

from __future__ import annotations

import socket
import struct
import time

import pytest
import torch

from embcache.clients import AsyncEmbCacheClient, EmbCacheClient
from embcache.clients._backends.sync_session import Session
from embcache.clients._backends.sync_socket_session import SocketSession
from embcache.clients.device.host_replies import decode_get
from embcache.clients.device.shm import PoolMaps, mapped_segment
from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.service.transport.session.inline_gets import INLINE_TOTAL

KiB, MiB = 1 << 10, 1 << 20
HEADER = struct.Struct("<I")


def unix_target(thread) -> str:  # type: ignore[no-untyped-def]
    return f"unix:{thread.service.socket_path}"


def in_pool(client: EmbCacheClient, t: torch.Tensor) -> bool:
    names = {m.name for m in client._state.maps._by_pool_id.values() if m is not None}
    return mapped_segment(t) in names


DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.bool, torch.uint8]


def test_small_entries_come_as_copies_and_large_ones_as_views(server_factory) -> None:
    with server_factory(host_pool_bytes=32 * MiB) as (engine, thread):
        small = {f"s{i}": (torch.randn(37, 13) * 9).to(d) for i, d in enumerate(DTYPES)}
        small["empty"] = torch.empty(0, 5, dtype=torch.float16)
        big = torch.arange(128 * KiB, dtype=torch.float32)  # 512 KiB: above the limit
        client = EmbCacheClient(unix_target(thread), timeout=10, copy_gets_up_to=256 * KiB)
        with client:
            for key, t in small.items():
                client.put(key, t)
            client.put("big", big)
            keys = [*small, "big", "missing"]
            with client.get(keys) as got:
                assert isinstance(client._conn.session, SocketSession)
                assert got[-1] is None
                for key, g in zip(small, got, strict=False):
                    t = small[key]
                    assert g is not None and g.dtype == t.dtype and g.shape == t.shape, key
                    assert torch.equal(g.view(torch.uint8), t.view(torch.uint8)), key
                    assert not in_pool(client, g), key  # a copy this process owns
                view = got[len(small)]
                assert view is not None and torch.equal(view, big)
                assert in_pool(client, view)  # above the limit: a view, as ever
                assert engine.stats().leases_active == 1  # the view's only
                copy = got[0]
                assert copy is not None
                copy.fill_(0)  # a copy's writes stay in it
            del got, view
            with client.get("s0") as (again,):
                assert torch.equal(again, small["s0"])
            del again, copy
            client.stats()  # the client's next call releases the leases of views now gone
            assert engine.stats().leases_active == 0
        metrics = thread.service.servicer.metrics
        assert ("lane", "Session.Get", "OK") in metrics.by_transport


def test_a_reply_carries_at_most_its_budget_as_copies(server_factory) -> None:
    """Entries past INLINE_TOTAL bytes of copies are leased views instead."""
    with server_factory(host_pool_bytes=32 * MiB) as (engine, thread):
        n = INLINE_TOTAL // (200 * KiB) + 1  # one more than fits
        tensors = {f"k{i}": torch.full((50 * KiB,), i, dtype=torch.float32) for i in range(n)}
        client = EmbCacheClient(unix_target(thread), timeout=10, copy_gets_up_to=256 * KiB)
        with client:
            for key, t in tensors.items():
                client.put(key, t)
            # A miss the read table cannot answer: the whole get is one call, one reply.
            with client.get([*tensors, "missing"]) as got:
                assert got[-1] is None
                for key, g in zip(tensors, got, strict=False):
                    assert g is not None and torch.equal(g, tensors[key]), key
                assert [in_pool(client, g) for g in got if g is not None].count(True) == 1
                assert engine.stats().leases_active == 1
            del got, g
            client.stats()
            assert engine.stats().leases_active == 0


def test_by_default_a_same_node_get_copies_from_the_read_table(server_factory, wait_until) -> None:
    """No call and no lease: the copy is read out of the pool, and the daemon counts the
    read from the client's posted touch."""
    with server_factory() as (engine, thread), EmbCacheClient(unix_target(thread)) as client:
        client.put("k", torch.ones(100))
        assert wait_until(lambda: engine.stats().read_table["entries"] == 1)  # commit posted
        with client.get("k") as (t,):
            assert torch.equal(t, torch.ones(100))
            assert not in_pool(client, t) and engine.stats().leases_active == 0
        assert wait_until(lambda: engine.stats().read_table["reads"] == 1)
        calls = thread.service.servicer.metrics.calls
        assert ("Session.Get", "OK") not in calls and ("Get", "OK") not in calls


def test_zero_copy_gives_a_leased_view(server_factory) -> None:
    with server_factory() as (engine, thread), EmbCacheClient(unix_target(thread)) as client:
        client.put("k", torch.ones(100))
        with client.get("k", zero_copy=True) as (t,):
            assert in_pool(client, t) and engine.stats().leases_active == 1
        assert engine.stats().read_table["reads"] == 0


def test_a_remote_client_gets_small_and_large_entries_in_one_call(
    server_factory, monkeypatch
) -> None:
    """A TCP client cannot map the pool: small entries come in the get's reply, larger
    ones are fetched by get_bytes; nothing stays leased."""
    with server_factory(host_pool_bytes=32 * MiB) as (engine, thread):
        target = f"127.0.0.1:{thread.service.ports[0]}"
        data = {
            "a": torch.arange(1000, dtype=torch.int32),
            "b": torch.randn(3, 7).to(torch.bfloat16),
            "large": torch.arange(512 * KiB, dtype=torch.float32),  # 2 MiB
        }
        with EmbCacheClient(target, timeout=10) as client:
            for key, t in data.items():
                client.put(key, t)
            # As on another machine: the pool cannot be mapped. The maps are the process's,
            # shared by every client, so the patch ends with the test.
            monkeypatch.setattr(client._state.maps, "get", lambda handle: None)
            for _ in range(2):  # the first finds out the pool is not mappable here
                with client.get([*data, "missing"]) as got:
                    assert isinstance(client._conn.session, SocketSession)
                    assert got[-1] is None
                    for key, g in zip(data, got, strict=False):
                        assert g is not None and torch.equal(g, data[key]), key
                    # The stream's lease ends just after its last bytes are written: soon,
                    # not necessarily before the client has read them.
                    assert leases_end(engine)
                assert client._state.pool_local is False
        assert engine.stats().leases_active == 0


def leases_end(engine, within_s: float = 5.0) -> bool:
    """Whether the engine holds no lease within ``within_s`` seconds."""
    deadline = time.monotonic() + within_s
    while engine.stats().leases_active:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def test_the_asyncio_client_gets_copies_too(server_factory) -> None:
    import asyncio

    async def main(target: str) -> None:
        async with AsyncEmbCacheClient(target, timeout=10, copy_gets_up_to=64 * KiB) as c:
            await c.put("k", torch.arange(100, dtype=torch.int16))
            async with c.get(["k", "nope"]) as (t, miss):
                assert miss is None and torch.equal(t, torch.arange(100, dtype=torch.int16))

    with server_factory() as (engine, thread):
        asyncio.run(main(unix_target(thread)))
        assert engine.stats().leases_active == 0


def test_get_into_a_host_buffer_copies_small_entries_from_the_reply(server_factory) -> None:
    with server_factory(host_pool_bytes=32 * MiB) as (engine, thread):
        a, b = torch.arange(64, dtype=torch.float32), torch.arange(400 * KiB, dtype=torch.uint8)
        with EmbCacheClient(unix_target(thread), timeout=10) as client:
            client.put("a", a)
            client.put("b", b)
            out = torch.zeros(MiB, dtype=torch.uint8)
            ra, rb, miss = client.get_into(["a", "b", "miss"], out)
            assert not miss and torch.equal(ra.view(out), a) and torch.equal(rb.view(out), b)
            assert engine.stats().leases_active == 0


def test_a_grpc_session_stream_ignores_the_wish(server_factory) -> None:
    """No raw bytes can follow a result on the stream: the get is a plain leased one."""
    with server_factory() as (engine, thread):
        engine.put("k", torch.ones(3))
        target = f"127.0.0.1:{thread.service.ports[0]}"
        # session_lane: the former name of session_socket, still taken
        with EmbCacheClient(target, timeout=10, session_lane=False) as client:
            session = client._conn.open_session()
            assert isinstance(session, Session) and not session.serves_inline_gets
            request = pb.GetRequest(keys=["k"], inline_max_bytes=1 << 20)
            result = session.call(10, get=request)
            (r,) = result.get.results
            assert r.found and r.lease_id and r.WhichOneof("location") == "host"
            assert result.get.inline_bytes == 0
            session.call(10, release=pb.ReleaseRequest(lease_ids=[r.lease_id]))
        assert engine.stats().leases_active == 0


def test_a_reply_whose_bytes_do_not_add_up_is_refused() -> None:
    reply = pb.GetResponse(inline_bytes=8)
    meta = pb.TensorMeta(dtype="uint8", shape=[8], nbytes=8)
    reply.results.add(key="k", found=True, meta=meta, inline=pb.InlineBytes())
    with pytest.raises(ValueError, match="raw bytes"):
        decode_get(reply, PoolMaps(), payload=bytearray(4))
    reply.inline_bytes = 4
    with pytest.raises(ValueError, match="past the payload"):
        decode_get(reply, PoolMaps(), payload=bytearray(4))


def test_a_reader_that_never_reads_its_copies_holds_no_lease(server_factory, wait_until) -> None:
    """A raw client pipelines inline gets and reads nothing: the copies hold no lease, the
    daemon serves others meanwhile, and the connection's end leaves nothing."""
    with server_factory(host_pool_bytes=16 * MiB) as (engine, thread):
        for i in range(4):
            engine.put(f"k{i}", torch.zeros(256 * KiB, dtype=torch.uint8))
        port = int(thread.service.servicer.session_socket_tcp_port)
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        hello = pb.SessionRequest(hello=pb.SessionHello(client_name="hostile", pid=1))
        request = pb.GetRequest(keys=[f"k{i}" for i in range(4)], inline_max_bytes=MiB)
        calls = [hello] + [
            pb.SessionRequest(call=pb.SessionCall(call_id=i, get=request)) for i in range(1, 300)
        ]
        try:
            for msg in calls:
                body = msg.SerializeToString()
                sock.sendall(HEADER.pack(len(body)) + body)
            assert engine.stats().leases_active == 0
            other = EmbCacheClient(unix_target(thread), timeout=10, copy_gets_up_to=MiB)
            with other, other.get("k1") as (t,):
                assert t is not None and t.numel() == 256 * KiB
        finally:
            sock.close()
        assert wait_until(lambda: len(thread.service.servicer.sessions) == 0)
        assert engine.stats().leases_active == 0
