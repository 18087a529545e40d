"""One client against the others, on the reply side (issue 28, items 4 and 5): a Get whose
reply exceeds the message limit, and calls pipelined on a session without reading their
results. Each test holds the load an attacker would, against a daemon with the default
bounds, and checks what the attacker got and that the others are still served."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import httpx
import pytest
import torch
from relkit import daemon as dm
from relkit import figures
from relkit.fairness import RawLane, StallProbe, lane_path

from embcache.clients import EmbCacheClient
from embcache.errors import ReplyTooLarge
from embcache.proto.constants import ERROR_TYPE_KEY
from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.proto.embcache.v1 import services as pb_grpc
from embcache.proto.framing import frame
from embcache.service.config import Settings
from embcache.service.engine import CacheEngine
from embcache.service.observability.metrics import Metrics
from embcache.service.transport.http.app import create_app

FIG: dict[str, object] = {}
WIDE = 1150  # keys of ~1000 bytes: the request fits one message, the reply does not
PIPELINED = 20_000  # calls sent without reading one result
DEFAULT_CALLS = 128  # Settings().max_session_calls
DEFAULT_LEASES = 16384  # Settings().max_leases_per_owner


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dm.Daemon]:
    with dm.running(dm.DaemonSpec(tmp_path_factory.mktemp("replies"), lease_ttl_s=600)) as d:
        with EmbCacheClient(d.unix, timeout=30) as client:
            for key in wide_keys():
                client.put(key, torch.empty(0, dtype=torch.uint8))
            client.put("keep", torch.ones(16))
        yield d


def wide_keys() -> list[str]:
    return [f"wide/{i:05d}/".ljust(1000, "x") for i in range(WIDE)]


def settle(d: dm.Daemon, leases: int = 0, timeout: float = 10.0) -> float | None:
    return dm.wait_for(lambda: d.stats()["leases_active"] <= leases, timeout)


# -- item 4: a reply over the message limit -------------------------------------------------
def test_unary_get_over_the_limit_is_refused_and_keeps_no_lease(daemon: dm.Daemon) -> None:
    with grpc.insecure_channel(daemon.unix) as channel:
        stub = pb_grpc.EmbeddingCacheStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.Get(pb.GetRequest(keys=wide_keys(), ttl_s=600), timeout=30)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert dict(err.value.trailing_metadata() or ()).get(ERROR_TYPE_KEY) == "ReplyTooLarge"
    assert "limit" in (err.value.details() or "")
    left = daemon.stats()["leases_active"]
    assert left == 0, f"{left} leases kept for a reply nobody got"
    FIG["unary Get, reply over the limit: leases kept"] = left


@pytest.mark.parametrize("over", ["lane", "grpc-stream"])
def test_a_session_survives_a_get_over_the_limit(daemon: dm.Daemon, over: str) -> None:
    target = daemon.unix if over == "lane" else daemon.tcp  # TCP: a gRPC Session stream
    with EmbCacheClient(target, timeout=30, retries=0) as client:
        held = client.get(["keep"], ttl_s=600, zero_copy=True)
        with pytest.raises(ReplyTooLarge):
            client.get(wide_keys(), ttl_s=600, zero_copy=True)
        assert daemon.stats()["leases_active"] == 1  # the session and its lease live on
        assert torch.equal(held[0], torch.ones(16))
        held.release()  # LeaseExpired here: the session had ended with its leases
        # A key the read table does not list makes this a call: the session still answers.
        assert client.exists(["keep", "absent"]) == [True, False]
        del held  # its view goes: the lease ends (a view keeps its lease while held)
    assert settle(daemon) is not None
    FIG[f"Get over the limit in a session ({over})"] = "ReplyTooLarge; session and leases kept"


def test_rest_get_cancelled_mid_way_keeps_no_lease(tmp_path: Path) -> None:
    """A REST get whose request is cancelled while its worker thread takes the leases (the
    server shutting down, an ASGI server that cancels on disconnect) gives them back."""
    s = Settings(host_pool_bytes=1 << 22, page_bytes=1 << 16, shm_name=f"rel-{tmp_path.name}")
    with CacheEngine(s) as engine:
        engine.put("k", torch.ones(64))
        app = create_app(engine, s, Metrics())
        real = app.state.renderer.get_host

        def slow_get_host(*args: object, **kw: object) -> object:
            time.sleep(0.3)  # the request is cancelled meanwhile
            return real(*args, **kw)

        app.state.renderer.get_host = slow_get_host

        async def cancelled_request() -> None:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                task = asyncio.create_task(client.post("/v1/get", json={"keys": ["k"]}))
                await asyncio.sleep(0.1)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                await asyncio.sleep(0.6)  # the worker thread is done by now

        asyncio.run(cancelled_request())
        left = engine.stats().leases_active
    assert left == 0, f"{left} leases kept by a cancelled REST get"
    FIG["REST get cancelled mid-way: leases kept"] = left


# -- item 5: calls pipelined without reading their results ---------------------------------
def _sessions(d: dm.Daemon) -> list[dict[str, object]]:
    return d.rest("/v1/sessions")["sessions"]  # type: ignore[no-any-return]


def _pipelined(n: int, sent: list[int], done: threading.Event) -> Iterator[pb.SessionRequest]:
    yield pb.SessionRequest(hello=pb.SessionHello(client_name="pipeliner"))
    for i in range(n):
        get = pb.GetRequest(keys=["keep"], ttl_s=600)
        yield pb.SessionRequest(call=pb.SessionCall(call_id=i + 1, get=get))
        sent[0] += 1
    done.wait(60)


def _steady_leases(d: dm.Daemon, timeout: float = 20.0) -> int:
    """The daemon's lease count once it stopped changing (it read all it will read)."""
    deadline, last = time.monotonic() + timeout, -1
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = d.stats()["leases_active"]
        if now == last:
            break
        last = now
    return last


def _exists_probe(d: dm.Daemon) -> tuple[grpc.Channel, StallProbe]:
    channel = grpc.insecure_channel(d.tcp)
    stub = pb_grpc.EmbeddingCacheStub(channel)
    return channel, StallProbe(lambda: stub.Exists(pb.ExistsRequest(keys=["keep"]), timeout=30))


def test_grpc_session_pipelining_is_bounded_and_ends_in_linear_time(daemon: dm.Daemon) -> None:
    sent, done = [0], threading.Event()
    with grpc.insecure_channel(daemon.tcp) as channel:
        stub = pb_grpc.EmbeddingCacheStub(channel)
        calls = stub.Session(_pipelined(PIPELINED, sent, done))
        leases = _steady_leases(daemon)  # the client's buffers take results as they come
        assert leases <= DEFAULT_LEASES, (leases, sent[0])  # past the cap: refused calls
        [session] = [s for s in _sessions(daemon) if s["client_name"] == "pipeliner"]
        _tear_down(daemon, calls.cancel, "gRPC session")  # the stream ends: all of it goes
        done.set()
    FIG["gRPC session, 20k calls unread: calls in flight / leases held"] = (
        f"{session['calls_in_flight']} / {leases} (sent {sent[0]})"
    )
    assert session["calls_in_flight"] <= DEFAULT_CALLS


def _tear_down(d: dm.Daemon, end: Callable[[], object], what: str) -> None:
    """``end()`` a pipelining session: every lease must come back, and the others' calls
    meanwhile must not stall."""
    probe_channel, probe = _exists_probe(d)
    with probe:
        t0 = time.monotonic()
        end()
        freed_s = settle(d, timeout=30)
        teardown_s = time.monotonic() - t0
    probe_channel.close()
    FIG[f"{what} teardown: seconds / worst stall of others"] = (
        f"{teardown_s:.2f} / {probe.worst_s:.3f}"
    )
    assert freed_s is not None and probe.worst_s < 1.0, (freed_s, probe.worst_s)


def test_session_socket_pipelining_is_bounded(daemon: dm.Daemon) -> None:
    lane = RawLane(lane_path(daemon.ready), name="pipeliner-lane")
    lane.sock.setblocking(False)  # the client only writes; what the kernel takes is sent
    frames = bytearray()
    for i in range(PIPELINED):
        get = pb.GetRequest(keys=["keep"], ttl_s=600)
        frames += frame(pb.SessionRequest(call=pb.SessionCall(call_id=i + 1, get=get)))
    written, deadline = 0, time.monotonic() + 3.0
    while written < len(frames) and time.monotonic() < deadline:
        try:
            written += lane.sock.send(frames[written : written + 65536])
        except BlockingIOError:
            time.sleep(0.01)  # the daemon stopped reading
    time.sleep(0.5)
    leases = daemon.stats()["leases_active"]
    assert leases <= DEFAULT_LEASES
    [session] = [s for s in _sessions(daemon) if s["client_name"] == "pipeliner-lane"]
    _tear_down(daemon, lane.close, "session socket")
    FIG["session socket, 20k calls unread: calls in flight / leases held"] = (
        f"{session['calls_in_flight']} / {leases}"
    )
    assert session["calls_in_flight"] <= DEFAULT_CALLS


def _cancel_waiters(n: int, make_lock: object) -> float:
    """CPU seconds to cancel ``n`` tasks queued on one held lock (as a session's calls queue
    on its writer), measured on a loop of its own: CPU time, so that other processes on the
    machine do not count."""

    async def run() -> float:
        lock = make_lock()  # type: ignore[operator]
        await lock.acquire()
        tasks = [asyncio.ensure_future(lock.acquire()) for _ in range(n)]
        await asyncio.sleep(0)  # every task waits now
        order = list(tasks)
        random.Random(1).shuffle(order)  # as a set of tasks is iterated: in no queue order
        t0 = time.process_time()  # CPU time: other processes on the machine do not count
        for task in order:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return time.process_time() - t0

    return asyncio.run(run())


def test_cancelling_the_calls_of_a_session_is_linear() -> None:
    """Teardown cancels every queued call; each leaves its queue in O(1) now (asyncio.Lock
    took O(n) each: 22 s for 60,000)."""
    from embcache.service.transport.session.waiters import FifoLock

    small, large = _cancel_waiters(10_000, FifoLock), _cancel_waiters(60_000, FifoLock)
    before = [_cancel_waiters(n, asyncio.Lock) for n in (10_000, 20_000)]
    FIG["cancel 10k / 60k queued calls (FifoLock)"] = f"{small:.2f} / {large:.2f} s"
    FIG["cancel 10k / 20k queued calls (asyncio.Lock, before)"] = (
        f"{before[0]:.2f} / {before[1]:.2f} s"
    )
    assert large < 3.0, (small, large)  # quadratic: 36x the 10k time (asyncio.Lock: ~10 s)


def test_the_pipeliners_neighbours_were_served(daemon: dm.Daemon) -> None:
    with (
        EmbCacheClient(daemon.unix, timeout=10) as client,
        client.get(["keep"], zero_copy=True) as got,  # a view: a call the daemon answers
    ):
        assert torch.equal(got[0], torch.ones(16))
    del got  # its view goes: the lease ends
    assert settle(daemon) is not None


def test_zz_figures() -> None:
    print("\n" + figures.table("replies and pipelined sessions (issue 28, items 4-5)", FIG))
    figures.save("fair_replies", FIG)
