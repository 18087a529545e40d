"""One client against the others, through the operator plane (issue 28, items 9 and 10):
REST bodies parsed on the event loop gRPC shares, and listings of many entries that held the
engine's lock for their whole scan."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import torch
from fastapi.testclient import TestClient
from relkit import daemon as dm
from relkit import figures
from relkit.fairness import StallProbe

from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.proto.embcache.v1 import services as pb_grpc
from embcache.service.config import Settings
from embcache.service.engine import CacheEngine
from embcache.service.observability.metrics import Metrics
from embcache.service.transport.http.app import create_app

FIG: dict[str, object] = {}
MiB = 1 << 20
LIMIT = 1 * MiB  # Settings().max_request_body_bytes


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dm.Daemon]:
    with dm.running(dm.DaemonSpec(tmp_path_factory.mktemp("bodies"))) as d:
        yield d


def _grpc_probe(d: dm.Daemon) -> tuple[grpc.Channel, StallProbe]:
    channel = grpc.insecure_channel(d.tcp)
    stub = pb_grpc.EmbeddingCacheStub(channel)
    return channel, StallProbe(lambda: stub.Exists(pb.ExistsRequest(keys=["k"]), timeout=30))


def _raw_post(d: dm.Daemon, path: str, head: str, body: bytes) -> bytes:
    """POST ``body`` from a thread and return the status line and headers the daemon
    answered (it may answer before reading the body, and close)."""
    with socket.create_connection(("127.0.0.1", d.ready["http_port"]), timeout=30) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{head}\r\n".encode())

        def upload() -> None:
            with contextlib.suppress(OSError):  # refused: the daemon closed its end
                sock.sendall(body)

        sender = threading.Thread(target=upload, daemon=True)
        sender.start()
        answer = b""
        while b"\r\n\r\n" not in answer:
            got = sock.recv(65536)
            if not got:
                break
            answer += got
        sender.join(30)
    return answer


# -- item 9: request bodies on the control routes -------------------------------------------
def test_a_huge_json_body_is_refused_without_stalling_grpc(daemon: dm.Daemon) -> None:
    body = json.dumps({"keys": ["k" * 1000] * (100 * MiB // 1006)}).encode()  # ~100 MiB
    channel, probe = _grpc_probe(daemon)
    with probe:
        t0 = time.monotonic()
        head = f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        answer = _raw_post(daemon, "/v1/evict", head, body)
        answered_s = time.monotonic() - t0
    channel.close()
    FIG["100 MiB JSON body to POST /v1/evict"] = (
        f"{answer[9:12].decode()} in {answered_s:.2f} s; worst gRPC call "
        f"{probe.worst_s * 1000:.0f} ms"
    )
    assert answer.startswith(b"HTTP/1.1 413"), answer[:300]
    assert probe.worst_s < 0.5, f"gRPC stalled {probe.worst_s:.2f} s"


def test_a_chunked_body_is_cut_at_the_limit(daemon: dm.Daemon) -> None:
    payload = json.dumps({"keys": ["k" * 1000] * (2 * LIMIT // 1006)}).encode()
    chunks = b"".join(
        b"%x\r\n%s\r\n" % (len(payload[i : i + 65536]), payload[i : i + 65536])
        for i in range(0, len(payload), 65536)
    )
    head = "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n"
    answer = _raw_post(daemon, "/v1/get", head, chunks + b"0\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 413"), answer[:300]
    FIG["2 MiB chunked body to POST /v1/get"] = "413 once 1 MiB had arrived"


def test_the_413_has_the_error_body(daemon: dm.Daemon) -> None:
    import httpx

    body = json.dumps({"lease_ids": [1] * (LIMIT // 2)}).encode()
    reply = httpx.post(
        daemon.http + "/v1/release",
        content=body,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert reply.status_code == 413
    err = reply.json()
    assert (err["error"], err["code"]) == ("BodyTooLarge", "RESOURCE_EXHAUSTED"), err
    assert err["details"]["limit"] == LIMIT


def test_bodies_under_the_limit_and_put_data_still_work(daemon: dm.Daemon) -> None:
    import httpx

    keys = [f"under/{i:06d}" for i in range(20_000)]  # ~300 KiB: parsed in a worker thread
    reply = httpx.post(daemon.http + "/v1/evict", json={"keys": keys[:10_000]}, timeout=30)
    assert reply.status_code == 200, reply.text
    data = bytes(4 * MiB)  # a put's data streams into pages: the JSON limit is not for it
    put = httpx.put(daemon.http + "/v1/entries/big?dtype=uint8&shape=4194304", content=data)
    assert put.status_code == 201, put.text


# -- item 10: listings that hold the engine lock ---------------------------------------------
class TimedLock:
    """The engine's lock, timing how long each hold lasts."""

    def __init__(self, lock: Any) -> None:
        self._lock = lock
        self.longest_s = 0.0
        self._since = 0.0

    def __enter__(self) -> TimedLock:
        self._lock.acquire()
        self._since = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.longest_s = max(self.longest_s, time.perf_counter() - self._since)
        self._lock.release()

    def acquire(self, *a: Any, **kw: Any) -> bool:
        got = bool(self._lock.acquire(*a, **kw))
        self._since = time.perf_counter()
        return got

    def release(self) -> None:
        self.longest_s = max(self.longest_s, time.perf_counter() - self._since)
        self._lock.release()


N_ENTRIES = 20_000


@pytest.fixture(scope="module")
def listing(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[CacheEngine, TestClient]]:
    name = f"rel-list-{tmp_path_factory.mktemp('list').name}"
    room = {"max_entries": N_ENTRIES + 100} if "max_entries" in Settings.model_fields else {}
    s = Settings(host_pool_bytes=16 * MiB, page_bytes=64 * 1024, shm_name=name, **room)
    with CacheEngine(s) as engine:
        for i in range(N_ENTRIES):
            engine.put(f"e/{i:06d}", torch.empty(0))
        for i in range(20):
            engine.put(f"s/{i:02d}", torch.ones(i * 1024 + 1))  # sizes to sort by
        engine.get([f"e/{i:06d}" for i in range(0, N_ENTRIES, 1000)], "reader")  # 20 leased
        engine.get([f"s/{i:02d}" for i in range(5)], "reader")
        with TestClient(create_app(engine, s, Metrics())) as client:
            yield engine, client


def test_listing_many_entries_never_holds_the_lock_long(
    listing: tuple[CacheEngine, TestClient],
) -> None:
    engine, client = listing
    gate = engine._gate  # the engine's one lock is its gate's
    timed = TimedLock(gate._lock)
    gate._lock = timed  # type: ignore[assignment]
    try:
        with StallProbe(lambda: engine.exists(["e/000001"]), period_s=0.001) as probe:
            for query in ("sort=size", "sort=idle", "state=leased", "tier=host&sort=recent"):
                reply = client.get(f"/v1/entries?{query}&limit=50")
                assert reply.status_code == 200, reply.text
    finally:
        gate._lock = timed._lock
    FIG[f"sorted listings of {N_ENTRIES} entries: longest lock hold / worst get"] = (
        f"{timed.longest_s * 1000:.1f} ms / {probe.worst_s * 1000:.1f} ms"
    )
    assert timed.longest_s < 0.05, f"the engine lock was held {timed.longest_s:.3f} s"


def test_listings_stay_correct(listing: tuple[CacheEngine, TestClient]) -> None:
    engine, client = listing

    def page(query: str) -> dict[str, Any]:
        reply = client.get(f"/v1/entries?{query}")
        assert reply.status_code == 200, reply.text
        return reply.json()  # type: ignore[no-any-return]

    total = N_ENTRIES + 20
    by_size = page("sort=size&limit=5")
    assert by_size["total"] == total
    assert [e["key"] for e in by_size["items"]] == [f"s/{i:02d}" for i in (19, 18, 17, 16, 15)]
    leased = page("state=leased&limit=1000")
    assert leased["total"] == 25 and all(e["leases"] == 1 for e in leased["items"])
    assert page("tier=device")["total"] == 0 and page("tier=host&limit=1")["total"] == total
    assert page("state=filling")["total"] == 0
    plain = page("offset=20000&limit=30")
    assert [e["key"] for e in plain["items"]] == [f"s/{i:02d}" for i in range(20)]
    engine.get(["e/000007"], "reader")  # now the most recently used
    assert page("sort=recent&limit=1")["items"][0]["key"] == "e/000007"
    idle = page("sort=idle&limit=3")["items"]
    assert idle[0]["idle_s"] >= idle[-1]["idle_s"]
    assert client.get("/v1/entries?state=bogus").json()["error"] == "ValidationError"


def test_zz_figures() -> None:
    print("\n" + figures.table("request bodies and listings (issue 28, items 9-10)", FIG))
    figures.save("fair_operator_plane", FIG)
