"""The Python client library against an in-process server and a real engine."""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from embcache.clients import AsyncEmbCacheClient, EmbCacheClient, RpcFailed
from embcache.clients.device.shm import PoolMaps, mapped_segment
from embcache.errors import (
    Draining,
    EntryLeased,
    MetadataConflict,
    NotFound,
    Unauthenticated,
)
from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.service.config import Settings
from embcache.service.transport.serving import serving

KiB, MiB = 1 << 10, 1 << 20


@pytest.fixture
def server(counting_server):  # type: ignore[no-untyped-def]
    return counting_server


@pytest.fixture
def client(server) -> Iterator[EmbCacheClient]:
    service = server[1].service
    with EmbCacheClient(f"unix:{service.socket_path}", timeout=10) as c:
        yield c


def in_pool(client: EmbCacheClient, t: torch.Tensor) -> bool:
    """Whether ``t`` is a view of a host pool this client mapped (its own private mapping
    of the segment's pages)."""
    names = {m.name for m in client._state.maps._by_pool_id.values() if m is not None}
    return mapped_segment(t) in names


def leases_drop_to(engine, n: int, timeout: float = 5.0) -> bool:  # type: ignore[no-untyped-def]
    """Whether the engine's leases fall to ``n`` within ``timeout`` (the client releases the
    lease of a view once its last tensor is gone, from its pump)."""
    deadline = time.monotonic() + timeout
    while engine.stats().leases_active > n and time.monotonic() < deadline:
        time.sleep(0.01)
    return engine.stats().leases_active == n


@pytest.mark.parametrize(
    "dtype",
    [torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.bool, torch.float8_e4m3fn],
)
def test_put_then_zero_copy_get(client, server, dtype) -> None:
    engine, _ = server
    src = (torch.randn(37, 129) * 10).to(dtype)  # odd sizes: 37 x 129 elements
    assert client.put("e", src) is True
    assert client.put("e", src) is False
    with client.get(["e", "missing"], zero_copy=True) as (got, miss):
        assert miss is None
        assert got.dtype == dtype and got.shape == src.shape
        assert torch.equal(got.view(torch.uint8), src.view(torch.uint8))
        assert in_pool(client, got)  # a view of the daemon's shared memory, no copy
        assert engine.stats().leases_active == 1
    assert engine.stats().leases_active == 1  # the view is alive: so is its lease
    del got, miss
    assert leases_drop_to(engine, 0)


def test_numpy_and_scalar_and_empty(client) -> None:
    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    client.put("np", arr)
    client.put("scalar", torch.tensor(3.5))
    client.put("empty", torch.zeros(0, 8, dtype=torch.float16))
    with client.get(["np", "scalar", "empty"]) as (a, s, e):
        assert torch.equal(a, torch.from_numpy(arr))
        assert s.shape == () and s.item() == 3.5
        assert e.shape == (0, 8) and e.dtype == torch.float16


def test_fragmented_entry_is_gathered(client, server) -> None:
    engine, _ = server
    for i in range(16):  # fill the 16 pages of the pool, one page each
        client.put(f"p{i}", torch.full((64 * KiB,), i, dtype=torch.uint8))
    client.evict([f"p{i}" for i in range(0, 16, 2)])  # free every other page
    big = torch.arange(4 * 64 * KiB // 4, dtype=torch.int32)
    client.put("big", big)
    assert client.exists(["big"]) == [True]  # its posted commit is applied
    assert len(engine.entry_info("big").page_runs) == 4
    with client.get("big") as (got,):
        assert torch.equal(got, big)
        assert not in_pool(client, got)  # gathered into fresh memory


def test_leases_end_with_the_client(server) -> None:
    engine, thread = server
    c = EmbCacheClient(f"127.0.0.1:{thread.service.ports[0]}")
    c.put("k", torch.ones(4))
    reply = c._conn.get_call(pb.GetRequest(keys=["k", "k"]))  # leases with no view to wait for
    assert len(reply.results) == 2 and engine.stats().leases_active == 2
    assert c.stats()["grpc_sessions"] == 1
    c.close()  # no release: the session's end releases them
    deadline = time.monotonic() + 5
    while engine.stats().leases_active and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.stats().leases_active == 0


def test_session_reopened_when_the_server_forgot_it(client, server) -> None:
    _, thread = server
    client.put("k", torch.ones(4))
    with client.get("k", zero_copy=True):  # views are calls: a default get reads the table
        pass
    sid = client._conn.session.session_id
    thread.service.servicer.sessions.close(sid)  # as after a daemon restart
    with client.get("k", zero_copy=True) as (t,):
        assert t is not None and client._conn.session.session_id != sid


def test_remote_clients_stream_bytes(client, server) -> None:
    engine, _ = server
    with tempfile.TemporaryDirectory() as empty:
        client._state.maps = PoolMaps(Path(empty))  # as on another machine: the segment is absent
        src = torch.randn(100, 10)
        client.put("r", src)
        with client.get(["r", "nope"]) as (got, miss):  # no table here: copies in the reply
            assert torch.equal(got, src) and miss is None
            assert engine.stats().leases_active == 0  # bytes copied: nothing to hold
        assert client._state.pool_local is None  # copies say nothing of where the pool is
        with client.get(["r", "nope"], zero_copy=True) as (got, miss):  # views it cannot map
            assert torch.equal(got, src) and miss is None
            assert engine.stats().leases_active == 0  # bytes streamed: nothing to hold
        assert client._state.pool_local is False
        with client.get("r", zero_copy=True) as (again,):  # later calls skip Get
            assert torch.equal(again, src)


def test_get_bytes_get_into_device_cpu(client) -> None:
    src = torch.randn(64, 3).to(torch.bfloat16)
    client.put("b", src)
    entry = client.get_bytes("b")
    assert entry is not None and entry.dtype == "bfloat16" and entry.shape == (64, 3)
    assert torch.equal(entry.tensor(), src)
    part = client.get_bytes("b", offset=6, length=12)
    assert bytes(part.data) == src.view(torch.uint8).numpy().tobytes()[6:18]
    assert client.get_bytes("nope") is None
    out = [torch.empty(64, 3, dtype=torch.bfloat16), torch.empty(2)]
    assert client.get_into(["b", "nope"], out) == [True, False]
    assert torch.equal(out[0], src)
    with pytest.raises(ValueError, match="out\\[0\\]"):
        client.get_into(["b"], [torch.empty(64, 3)])
    with client.get("b", device="cpu") as (t,):
        assert torch.equal(t, src)


def test_exists_evict_and_typed_errors(client) -> None:
    client.put("x", torch.zeros(2, 2))
    assert client.exists("x") is True and client.exists(["x", "y"]) == [True, False]
    with pytest.raises(MetadataConflict):
        client.put("x", torch.zeros(4))
    with client.get("x", zero_copy=True):  # a view holds a lease; a copy holds nothing
        with pytest.raises(EntryLeased) as err:
            client.evict("x")
        assert err.value.grpc_status.name == "FAILED_PRECONDITION"
        assert client.evict(["x"]) == ["leased"]
        assert client.evict(["x", "y"]) == ["leased", "not_found"]
    with pytest.raises(NotFound):
        client.evict("y")
    assert client.evict("x") == "evicted"
    stats = client.stats()
    assert stats["entries_ready"] == 0 and isinstance(stats["host"]["free_pages"], int)


def test_retries_on_unavailable_then_raises(client, server) -> None:
    engine, thread = server
    client.retries = 2
    engine.begin_drain()  # every get is refused with UNAVAILABLE
    with pytest.raises(Draining), client.get("x"):
        pass
    calls = thread.service.servicer.metrics.calls
    deadline = time.monotonic() + 5  # the record of a failed call may trail its reply
    refused = ("Session.Get", "UNAVAILABLE")  # the client's gets ride its session stream
    while calls.count(refused) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert calls.count(refused) == 3  # first try + 2 retries


def test_unreachable_daemon(shm_name: str) -> None:
    with tempfile.TemporaryDirectory() as d:
        c = EmbCacheClient(f"unix:{d}/none.sock", retries=1, timeout=2)
        with pytest.raises(RpcFailed) as err:
            c.exists("k")
        assert err.value.code == "UNAVAILABLE"
        c.close()


def test_auth_token(shm_name: str) -> None:
    settings = Settings(grpc_port=0, shm_name=shm_name, host_pool_bytes=1 * MiB, auth_token="tok")
    with serving(settings) as (_, thread):
        target = f"127.0.0.1:{thread.service.ports[0]}"
        with EmbCacheClient(target, token="tok") as good:
            good.put("k", torch.ones(2))
            with good.get("k") as (t,):
                assert t.sum().item() == 2
        with EmbCacheClient(target, token="bad") as bad, pytest.raises(Unauthenticated):
            bad.exists("k")
        with EmbCacheClient(target) as anonymous, pytest.raises(Unauthenticated):
            anonymous.put("k", torch.ones(2))


def test_async_client(server) -> None:
    engine, thread = server
    src = torch.randn(10, 10).to(torch.float16)

    async def scenario() -> None:
        async with AsyncEmbCacheClient(f"unix:{thread.service.socket_path}") as c:
            assert await c.put("a", src) is True
            async with c.get(["a", "zz"], zero_copy=True) as (got, miss):
                assert torch.equal(got, src) and miss is None
                assert engine.stats().leases_active == 1
            del got, miss  # the views are gone: the lease ends
            deadline = time.monotonic() + 5
            while engine.stats().leases_active and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert engine.stats().leases_active == 0
            leased = await c.get("a", zero_copy=True)
            assert len(leased.lease_ids) == 1
            await leased.release()
            del leased  # it holds the view: until it goes, the lease stays
            entry = await c.get_bytes("a")
            assert entry is not None and torch.equal(entry.tensor(), src)
            out = [torch.empty(10, 10, dtype=torch.float16)]
            assert await c.get_into(["a"], out) == [True] and torch.equal(out[0], src)
            assert await c.exists(["a", "b"]) == [True, False]
            assert await c.evict(["a"]) == ["evicted"]
            assert (await c.stats())["grpc_sessions"] == 1
            with pytest.raises(NotFound):
                await c.evict("a")
            await c.get("a", zero_copy=True)  # leased by the session, never released by hand

    # grpc.aio objects belong to one event loop: run the client on the server's loop.
    thread.call(scenario())
    assert engine.stats().leases_active == 0


@pytest.mark.parametrize("lane", [True, False], ids=["lane", "grpc"])
def test_a_closed_client_refuses_calls(server, lane: bool) -> None:
    """After close() a get raises instead of opening a new session the daemon would keep."""
    _, thread = server
    client = EmbCacheClient(f"unix:{thread.service.socket_path}", session_socket=lane)
    client.put("k", torch.ones(2))
    with client.get("k") as (t,):
        assert t is not None
    del t  # else the session stays until the view is gone
    client.close()
    with pytest.raises(RpcFailed) as err:
        client.get("k")
    assert err.value.code == "CANCELLED" and client._conn.session is None


@pytest.mark.parametrize("lane", [True, False], ids=["lane", "grpc"])
def test_a_closed_async_client_refuses_calls(server, lane: bool) -> None:
    """The asyncio client refuses them the same way (it used to open a new session)."""
    _, thread = server

    async def scenario() -> None:
        client = AsyncEmbCacheClient(f"unix:{thread.service.socket_path}", session_socket=lane)
        await client.put("k", torch.ones(2))
        async with client.get("k") as (t,):
            assert t is not None
        del t  # else the session stays until the view is gone
        await client.close()
        with pytest.raises(RpcFailed) as err:
            await client.get("k")
        assert err.value.code == "CANCELLED" and client._conn.session is None

    thread.call(scenario())
