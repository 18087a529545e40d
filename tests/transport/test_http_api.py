"""REST API against a real engine, served by uvicorn on 127.0.0.1 port 0."""

from __future__ import annotations

from collections.abc import Iterator
from urllib.parse import quote

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from embcache.service.config import Settings
from embcache.service.engine import CacheEngine
from embcache.service.observability.metrics import Metrics
from embcache.service.transport.http.app import create_app
from embcache.service.transport.http.testing import serve_in_thread

PAGE = 4096
TOKEN = "s3cret-token"


@pytest.fixture
def engine(shm_name: str) -> Iterator[CacheEngine]:
    settings = Settings(host_pool_bytes=64 * PAGE, page_bytes=PAGE, shm_name=shm_name, device="cpu")
    with CacheEngine(settings) as eng:
        yield eng


def _serve(engine: CacheEngine, token: str | None) -> Iterator[httpx.Client]:
    settings = engine.settings.model_copy(update={"auth_token": token})
    app = create_app(engine, settings, Metrics(engine))
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=10) as client:
        yield client


@pytest.fixture
def client(engine: CacheEngine) -> Iterator[httpx.Client]:
    yield from _serve(engine, None)


@pytest.fixture
def authed(engine: CacheEngine) -> Iterator[httpx.Client]:
    yield from _serve(engine, TOKEN)


def test_stats(client: httpx.Client, engine: CacheEngine) -> None:
    engine.put("a", torch.ones(4, 256))
    engine.get(["a", "b"], owner="t")
    body = client.get("/v1/stats").json()
    assert body["host"]["capacity_bytes"] == 64 * PAGE
    assert body["host"]["used_pages"] == 1
    assert (body["entries_ready"], body["hits"], body["misses"]) == (1, 1, 1)
    assert body["hit_rate"] == 0.5
    assert body["leases_active"] == 1


def test_entries_paging_filters_and_sorting(client: httpx.Client, engine: CacheEngine) -> None:
    for i, rows in enumerate([1, 8, 3, 5]):
        engine.put(f"k{i}", torch.ones(rows, 256))
    engine.get(["k2"], owner="t")
    page = client.get("/v1/entries", params={"limit": 2}).json()
    assert page["total"] == 4 and [e["key"] for e in page["items"]] == ["k0", "k1"]
    page = client.get("/v1/entries", params={"limit": 2, "offset": 3}).json()
    assert [e["key"] for e in page["items"]] == ["k3"]
    by_size = client.get("/v1/entries", params={"sort": "size"}).json()["items"]
    assert [e["key"] for e in by_size] == ["k1", "k3", "k2", "k0"]
    recent = client.get("/v1/entries", params={"sort": "recent", "limit": 1}).json()["items"]
    assert recent[0]["key"] == "k2"
    leased = client.get("/v1/entries", params={"state": "leased"}).json()
    assert leased["total"] == 1 and leased["items"][0]["leases"] == 1
    assert client.get("/v1/entries", params={"tier": "device"}).json()["total"] == 0
    assert client.get("/v1/entries", params={"tier": "host"}).json()["total"] == 4
    assert client.get("/v1/entries", params={"state": "filling"}).json()["total"] == 0
    assert client.get("/v1/entries", params={"state": "bogus"}).status_code == 422
    assert client.get("/v1/entries", params={"limit": 0}).status_code == 422


def test_entry_detail_with_slashes_in_key(client: httpx.Client, engine: CacheEngine) -> None:
    key = "img/2024/cat photo.png#1"
    engine.put(key, torch.ones(3, 1000))  # 12000 bytes -> 3 pages
    resp = client.get("/v1/entries/" + quote(key, safe="/"))
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["key"] == key and body["dtype"] == "float32" and body["shape"] == [3, 1000]
    assert body["num_pages"] == 3 and body["residency"] == ["host"]
    assert sum(r["byte_length"] for r in body["page_runs"]) == 12000


def test_delete_entry(client: httpx.Client, engine: CacheEngine) -> None:
    engine.put("free", torch.ones(4, 256))
    engine.put("held", torch.ones(4, 256))
    engine.get(["held"], owner="t")
    resp = client.delete("/v1/entries/free")
    assert resp.status_code == 200 and resp.json() == {
        "key": "free",
        "evicted": True,
        "freed_bytes": 4096,
    }
    resp = client.delete("/v1/entries/free")
    assert resp.status_code == 404
    assert resp.json()["error"] == "NotFound" and resp.json()["code"] == "NOT_FOUND"
    resp = client.delete("/v1/entries/held")
    assert resp.status_code == 409 and resp.json()["error"] == "EntryLeased"
    assert engine.exists(["free", "held"]) == [False, True]


def test_evict_keys_and_bytes(client: httpx.Client, engine: CacheEngine) -> None:
    for key in ("a", "b", "c", "d"):
        engine.put(key, torch.ones(4, 256))
    engine.get(["b"], owner="t")
    out = client.post("/v1/evict", json={"keys": ["a", "b", "zz", "a"]}).json()
    assert out == {
        "evicted": ["a"],
        "not_found": ["zz"],
        "leased": ["b"],
        "freed_entries": 1,
        "freed_bytes": 4096,
    }
    out = client.post("/v1/evict", json={"bytes": "4KiB"}).json()
    assert (out["freed_entries"], out["freed_bytes"]) == (1, PAGE)
    assert engine.exists(["b", "c", "d"]) == [True, False, True]  # c was least recently used
    for bad in ({}, {"keys": ["a"], "bytes": 1}, {"bytes": -1}, {"bytes": "lots"}, {"x": 1}):
        resp = client.post("/v1/evict", json=bad)
        assert resp.status_code == 422, bad
        assert resp.json()["error"] == "ValidationError"


def test_health(client: httpx.Client, engine: CacheEngine) -> None:
    assert client.get("/livez").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["status"] == "ready"
    engine.begin_drain()
    ready = client.get("/readyz")
    assert ready.status_code == 503
    assert ready.json()["draining"] is True and ready.json()["status"] == "not_ready"
    assert client.get("/livez").status_code == 200


def test_metrics_endpoint_counts_requests(client: httpx.Client, engine: CacheEngine) -> None:
    engine.put("secret-key", torch.ones(4, 256))
    client.get("/v1/entries/secret-key")
    client.get("/v1/entries/missing-key")
    client.get("/no/such/route")
    resp = client.get("/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    counts = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            if s.name == "embcache_rpc_duration_seconds_count":
                counts[(s.labels["method"], s.labels["code"])] = s.value
    assert counts[("GET /v1/entries/{key:path}", "200")] == 1
    assert counts[("GET /v1/entries/{key:path}", "404")] == 1
    assert counts[("unmatched", "404")] == 1
    assert "secret-key" not in resp.text and "missing-key" not in resp.text


def test_unknown_route_and_method_use_the_error_shape(client: httpx.Client) -> None:
    resp = client.get("/v2/nothing")
    assert resp.status_code == 404 and resp.json()["code"] == "NOT_FOUND"
    resp = client.put("/v1/stats")
    assert resp.status_code == 405 and set(resp.json()) == {"error", "code", "message", "details"}
    # A trailing slash is another path: the error shape, not an empty redirect (found by the
    # fuzzer: DELETE /v1/sessions/ with an empty session id).
    for method, path in (("DELETE", "/v1/sessions/"), ("GET", "/v1/stats/")):
        resp = client.request(method, path)
        assert resp.status_code == 404 and resp.json()["code"] == "NOT_FOUND", (method, path)


def test_openapi_and_docs(client: httpx.Client) -> None:
    spec = client.get("/openapi.json").json()
    for path in (
        "/v1/stats",
        "/v1/entries",
        "/v1/entries/{key}",
        "/v1/evict",
        "/livez",
        "/readyz",
        "/metrics",
        "/v1/pool-map",
    ):
        assert path in spec["paths"], path
    assert client.get("/docs").status_code == 200


def test_pool_map(client: httpx.Client, engine: CacheEngine) -> None:
    engine.put("a", torch.ones(8, 256))  # 2 pages ready
    engine.put("b", torch.ones(4, 256))  # 1 page, leased below
    engine.get(["b", "nope"], owner="t")
    body = client.get("/v1/pool-map", params={"max_cells": 32}).json()
    host = body["host"]
    assert host["num_pages"] == 64 and host["pages_per_cell"] == 2 and len(host["cells"]) == 32
    assert host["counts"] == {"free": 61, "filling": 0, "ready": 2, "leased": 1}
    assert host["cells"][0] == "2"  # pages 0-1: alpha, ready
    assert host["cells"][1] == "3"  # page 2 leased beats page 3 free on a tie
    assert body["device"] is None and body["ready"] is True
    assert body["summary"]["entries"] == 2 and body["summary"]["hits"] == 1
    assert body["history"]["window_s"] >= 60
    assert client.get("/v1/pool-map", params={"max_cells": 1}).status_code == 422


def test_pool_map_draws_each_device_pool(shm_name: str) -> None:
    # Two CPU "GPUs": the map draws the pool asked for, says how many there are, and still
    # draws (empty) a pool a device error took out, with the reason; no such pool: 409.
    from embcache.service.device.pool import DevicePool

    settings = Settings(host_pool_bytes=64 * PAGE, page_bytes=PAGE, shm_name=shm_name, device="cpu")
    pools = [DevicePool(torch.device("cpu"), 8 * PAGE, PAGE, index=i) for i in range(2)]
    with CacheEngine(settings, device_pools=pools) as engine:
        engine.put("a", torch.ones(8, 256))  # 2 pages
        engine.device.get(["a"], "t", device=1)  # leased on pool 1
        for client in _serve(engine, None):
            zero = client.get("/v1/pool-map").json()["device"]
            one = client.get("/v1/pool-map", params={"device": 1}).json()["device"]
            assert (zero["index"], zero["pools"], zero["counts"]["leased"]) == (0, 2, 0)
            assert (one["index"], one["counts"]["leased"], one["out_of_service"]) == (1, 2, "")
            pools[1].fail("CUDA error: test")
            one = client.get("/v1/pool-map", params={"device": 1}).json()["device"]
            assert one["out_of_service"] == "CUDA error: test" and one["counts"]["leased"] == 0
            missing = client.get("/v1/pool-map", params={"device": 2})
            assert missing.status_code == 409, missing.text


def test_evict_from_one_device_pool(shm_name: str) -> None:
    # 'device' evicts copies in that device pool only: the entry, its host copy and its
    # copy on the other pool stay; by bytes, LRU within that pool. No such pool: 409.
    from embcache.service.device.pool import DevicePool

    settings = Settings(host_pool_bytes=64 * PAGE, page_bytes=PAGE, shm_name=shm_name, device="cpu")
    pools = [DevicePool(torch.device("cpu"), 8 * PAGE, PAGE, index=i) for i in range(2)]
    with CacheEngine(settings, device_pools=pools) as engine:
        engine.put("a", torch.ones(8, 256))  # 2 pages
        for device in (0, 1):
            leased, _ = engine.device.get(["a"], "t", device=device)
            engine.release([d.lease.lease_id for d in leased if d is not None])
        for client in _serve(engine, None):
            out = client.post("/v1/evict", json={"keys": ["a", "zz"], "device": 1}).json()
            assert out["evicted"] == ["a"] and out["not_found"] == ["zz"], out
            assert engine.entry_info("a").residency == ("host", "device:0")  # type: ignore[union-attr]
            out = client.post("/v1/evict", json={"bytes": 1, "device": 0}).json()
            assert (out["freed_entries"], out["freed_bytes"]) == (1, 2 * PAGE), out
            assert engine.entry_info("a").residency == ("host",)  # type: ignore[union-attr]
            assert client.post("/v1/evict", json={"keys": ["a"], "device": 2}).status_code == 409
            assert client.post("/v1/evict", json={"keys": ["a"], "device": -1}).status_code == 422


def test_page_and_assets(client: httpx.Client) -> None:
    page = client.get("/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "static/poolmap.js" in page.text
    assert client.get("/static/poolmap.js").status_code == 200
    assert client.get("/static/poolmap.css").status_code == 200


def test_auth_required_when_token_set(authed: httpx.Client, engine: CacheEngine) -> None:
    engine.put("a", torch.ones(4, 256))
    for method, path in (
        ("GET", "/v1/stats"),
        ("GET", "/v1/entries"),
        ("GET", "/v1/entries/a"),
        ("DELETE", "/v1/entries/a"),
        ("POST", "/v1/evict"),
        ("GET", "/metrics"),
        ("GET", "/v1/pool-map"),
    ):
        resp = authed.request(method, path)
        assert resp.status_code == 401, path
        assert resp.json()["error"] == "Unauthenticated"
        assert resp.headers["www-authenticate"].startswith("Bearer")
        bad = authed.request(method, path, headers={"Authorization": "Bearer wrong"})
        assert bad.status_code == 401, path
    assert engine.exists(["a"]) == [True]  # the refused DELETE did nothing
    ok = {"Authorization": f"Bearer {TOKEN}"}
    assert authed.get("/v1/stats", headers=ok).status_code == 200
    assert authed.get("/v1/entries/a", headers=ok).status_code == 200
    assert authed.get("/metrics", headers=ok).status_code == 200
    # Probes, the page shell and its assets carry no cache data and stay open.
    for path in ("/livez", "/readyz", "/", "/static/poolmap.js", "/docs", "/openapi.json"):
        assert authed.get(path).status_code == 200, path


def test_no_auth_without_token(client: httpx.Client) -> None:
    assert client.get("/v1/stats").status_code == 200
    assert client.get("/v1/stats", headers={"Authorization": "Bearer x"}).status_code == 200


def test_device_tier_views(shm_name: str) -> None:
    """With a device pool (plain memory on CPU): residency, tier filter, device grid."""
    device_pool = pytest.importorskip("embcache.service.device.pool")
    settings = Settings(host_pool_bytes=64 * PAGE, page_bytes=PAGE, shm_name=shm_name,
                        device="cpu")  # fmt: skip
    pool = device_pool.DevicePool(torch.device("cpu"), 16 * PAGE, PAGE)
    with CacheEngine(settings, device_pools=[pool]) as engine:
        engine.put("on-device", torch.ones(2, 1024))  # 2 pages
        engine.put("host-only", torch.ones(1, 1024))
        results, _ = engine.device.get(["on-device"], "decoder-7")
        client_gen = _serve(engine, None)
        client = next(client_gen)
        try:
            page = client.get("/v1/entries", params={"tier": "device"}).json()
            assert [e["key"] for e in page["items"]] == ["on-device"]
            assert page["items"][0]["residency"] == ["host", "device:0"]
            detail = client.get("/v1/entries/on-device").json()
            assert [h["owner"] for h in detail["lease_holders"]] == ["decoder-7"]
            assert 0 < detail["lease_holders"][0]["expires_in_s"] <= settings.lease_ttl_s
            body = client.get("/v1/pool-map").json()
            assert body["device"]["num_pages"] == 16
            assert body["device"]["counts"] == {"free": 14, "resident": 0, "leased": 2}
            assert body["summary"]["device_capacity_bytes"] == 16 * PAGE
            stats = client.get("/v1/stats").json()
            assert stats["device"][0]["used_pages"] == 2 and stats["device_resident"] == [1]
        finally:
            client_gen.close()
        assert results[0] is not None
