"""Calls carried on the Session stream (``SessionCall``), client and raw wire; the device
puts with a CUDA-capable fake are in test_grpc_device.py."""

from __future__ import annotations

import asyncio
import queue
from collections.abc import Iterator

import grpc
import pytest
import torch

from embcache.clients import AsyncEmbCacheClient, EmbCacheClient
from embcache.clients._backends.async_socket_session import AsyncSocketSession
from embcache.clients._backends.sync_socket_session import SocketSession
from embcache.errors import InvalidArgument
from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.proto.embcache.v1 import services as pb_grpc
from embcache.service.engine import CacheEngine
from embcache.service.transport.serving import GrpcServerThread

KiB, MiB = 1 << 10, 1 << 20


@pytest.fixture
def server(counting_server):  # type: ignore[no-untyped-def]
    return counting_server


@pytest.fixture(params=[True, False], ids=["lane", "grpc"])
def lane(request: pytest.FixtureRequest) -> bool:
    """Session calls over the daemon's lane (lane.py) or over the gRPC Session stream."""
    return bool(request.param)


def target(server: tuple[CacheEngine, GrpcServerThread]) -> str:
    return f"unix:{server[1].service.socket_path}"


def test_client_gets_and_releases_on_its_session(server, lane: bool, wait_until) -> None:
    engine, thread = server
    calls = thread.service.servicer.metrics.calls
    with EmbCacheClient(target(server), timeout=10, session_socket=lane) as client:
        src = torch.randn(300, 7)
        client.put("k", src)
        with client.get(["k", "nope"], zero_copy=True) as (got, miss):  # views: leased
            assert miss is None and torch.equal(got, src)
            assert client._conn.session is not None and client._conn.session.serves_calls
            assert isinstance(client._conn.session, SocketSession) == lane
            assert engine.stats().leases_active == 1
        del got, miss  # the views are gone: the lease ends (the pump releases it)
        assert wait_until(lambda: engine.stats().leases_active == 0)
        # A view never released: closing the client waits for it.
        held = client.get("k", zero_copy=True)
    assert engine.stats().leases_active == 1 and client._conn.session is not None
    del held  # the views are gone: the client releases the lease and ends the session
    assert wait_until(lambda: engine.stats().leases_active == 0 and client._conn.session is None)
    assert ("Session.Get", "OK") in calls and ("Session.Release", "OK") in calls
    assert ("Get", "OK") not in calls and ("Release", "OK") not in calls


def test_errors_come_back_typed_and_the_stream_stays_open(server, lane: bool) -> None:
    engine, _ = server
    with EmbCacheClient(target(server), timeout=10, session_socket=lane) as client:
        client.put("k", torch.ones(3))
        session = None
        for bad in (1e12, float("inf")):  # lease lifetimes the daemon refuses
            with pytest.raises(InvalidArgument) as err:
                client.get("k", ttl_s=bad)
            assert err.value.grpc_status == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
            session = session or client._conn.session
            assert client._conn.session is session and session is not None and session.alive
        with client.get("k") as (t,):
            assert torch.equal(t, torch.ones(3))
        del t
    assert engine.stats().leases_active == 0


def test_concurrent_calls_on_one_session(server, lane: bool, concurrently) -> None:
    engine, _ = server
    data = {f"k{i}": torch.full((100 + i,), float(i)) for i in range(8)}
    sessions: set[int] = set()
    with EmbCacheClient(target(server), timeout=10, session_socket=lane) as client:
        for k, t in data.items():
            client.put(k, t)

        def reader(seed: int) -> None:
            for j in range(40):
                key = f"k{(seed + j) % 8}"
                with client.get([key, "nope"]) as (got, miss):
                    assert miss is None and torch.equal(got, data[key])
                    sessions.add(id(client._conn.session))

        concurrently(reader, 4)
        assert len(sessions) == 1  # every reader's calls went over the one session
    assert engine.stats().leases_active == 0


def test_a_result_nobody_waits_for_has_its_leases_released(server, lane: bool, wait_until) -> None:
    engine, _ = server
    with EmbCacheClient(target(server), timeout=10, session_socket=lane) as client:
        client.put("k", torch.ones(8))
        reply = client._conn.get_call(pb.GetRequest(keys=["k", "k"]))
        assert engine.stats().leases_active == 2
        session = client._conn.open_session()
        # As if the caller had timed out: a result for a call id nobody waits on.
        session._deliver(pb.SessionResult(call_id=10**9, get=reply))
        assert wait_until(lambda: engine.stats().leases_active == 0)


def test_daemon_without_session_calls_gets_rpcs(server, lane: bool) -> None:
    """A daemon that does not announce ``calls`` (an older one) is asked with RPCs."""
    _, thread = server
    calls = thread.service.servicer.metrics.calls
    with EmbCacheClient(target(server), timeout=10, session_socket=lane) as client:
        client.put("k", torch.ones(2))
        client._conn.open_session().serves_calls = False
        with client.get("k", zero_copy=True) as (t,):  # a view: a call (a copy reads the table)
            assert torch.equal(t, torch.ones(2))
        del t  # its view is gone: closing the client releases its lease
    assert ("Get", "OK") in calls and ("Release", "OK") in calls


def test_async_client_uses_its_session(server, lane: bool) -> None:
    engine, thread = server
    calls = thread.service.servicer.metrics.calls

    async def main() -> None:
        async with AsyncEmbCacheClient(target(server), timeout=10, session_socket=lane) as client:
            src = torch.arange(50.0)
            await client.put("a", src)
            views = (client.get(["a", "nope"], zero_copy=True) for _ in range(6))
            results = await asyncio.gather(*views)
            assert isinstance(client._conn.session, AsyncSocketSession) == lane
            for leased in results:
                async with leased as (got, miss):
                    assert miss is None and torch.equal(got, src)
            with pytest.raises(InvalidArgument):
                await client.get("a", ttl_s=1e12)
            async with await client.get("a", zero_copy=True) as (again,):
                assert torch.equal(again, src)
            async with await client.get("a") as (copied,):  # read from the table: no Get
                assert torch.equal(copied, src)
            del results, leased, got, miss, again  # the views are gone before the close

    asyncio.run(main())
    assert engine.stats().leases_active == 0
    assert calls.count(("Session.Get", "OK")) == 7 and ("Session.Release", "OK") in calls


def test_raw_session_calls(server, wait_until) -> None:
    """The wire contract with generated stubs only: calls tagged by id, typed errors, a
    call without a request, and leases that end with the stream."""
    engine, _ = server
    engine.put("k", torch.ones(16))
    requests: queue.SimpleQueue[pb.SessionRequest | None] = queue.SimpleQueue()

    def stream() -> Iterator[pb.SessionRequest]:
        while (msg := requests.get()) is not None:
            yield msg

    with grpc.insecure_channel(target(server)) as channel:
        replies = pb_grpc.EmbeddingCacheStub(channel).Session(stream())
        first = next(replies)
        assert first.WhichOneof("kind") == "opened" and first.opened.calls
        requests.put(
            pb.SessionRequest(call=pb.SessionCall(call_id=7, get=pb.GetRequest(keys=["k"])))
        )
        got = next(replies).result
        assert got.call_id == 7 and got.get.results[0].found
        lease_id = got.get.results[0].lease_id
        requests.put(
            pb.SessionRequest(
                call=pb.SessionCall(call_id=8, get=pb.GetRequest(keys=["k"], ttl_s=-1))
            )
        )
        bad = next(replies).result
        assert bad.call_id == 8 and bad.error.code == "INVALID_ARGUMENT"
        assert bad.error.error_type == "InvalidArgument" and bad.error.message
        requests.put(pb.SessionRequest(call=pb.SessionCall(call_id=9)))  # no request inside
        empty = next(replies).result
        assert empty.call_id == 9 and empty.error.code == "INVALID_ARGUMENT"
        wrong_gpu = pb.GetRequest(keys=["k"], gpu_uuid="GPU-none")
        requests.put(pb.SessionRequest(call=pb.SessionCall(call_id=10, get=wrong_gpu)))
        assert next(replies).result.error.code == "FAILED_PRECONDITION"
        assert engine.stats().leases_active == 1  # only call 7's lease
        release = pb.ReleaseRequest(lease_ids=[lease_id, lease_id])
        requests.put(pb.SessionRequest(call=pb.SessionCall(call_id=11, release=release)))
        assert next(replies).result.release.released == 1
        requests.put(
            pb.SessionRequest(call=pb.SessionCall(call_id=12, get=pb.GetRequest(keys=["k"])))
        )
        assert next(replies).result.get.results[0].found
        assert first.opened.device_puts  # device puts too; a daemon without CUDA refuses them
        tensor = pb.CudaIpcTensor(gpu_uuid="GPU-x", ipc_handle=b"h" * 64, dtype="uint8", shape=[4])
        put = pb.PutFromDeviceRequest(key="d", tensor=tensor)
        batch = pb.PutFromDeviceBatchRequest(items=[put])
        for call_id, kind in (
            (13, {"put_from_device": put}),
            (14, {"put_from_device_batch": batch}),
        ):
            requests.put(pb.SessionRequest(call=pb.SessionCall(call_id=call_id, **kind)))
            refused = next(replies).result
            assert refused.call_id == call_id and refused.error.code == "FAILED_PRECONDITION"
            assert refused.error.error_type == "DeviceUnavailable"
        assert engine.exists(["d"]) == [False] and engine.stats().entries_filling == 0
        requests.put(None)  # end the stream: the session's lease ends with it
        assert wait_until(lambda: engine.stats().leases_active == 0)


def test_streams_cut_during_calls_leave_no_leases(server, wait_until) -> None:
    """Sessions that end while their calls run (cancelled at once, or half-closed) give
    back every lease those calls took, whatever the timing."""
    engine, _ = server
    engine.put("k", torch.ones(64))
    with grpc.insecure_channel(target(server)) as channel:
        stub = pb_grpc.EmbeddingCacheStub(channel)
        for i in range(20):
            get = pb.SessionRequest(call=pb.SessionCall(call_id=1, get=pb.GetRequest(keys=["k"])))
            msgs = [pb.SessionRequest(hello=pb.SessionHello(client_name="cut"))] + [get] * 3
            replies = stub.Session(iter(msgs))  # the request stream half-closes after these
            next(replies)  # opened
            if i % 2:
                replies.cancel()
            else:
                for _ in replies:  # results until the server ends the stream
                    pass
    assert wait_until(lambda: engine.stats().leases_active == 0)
