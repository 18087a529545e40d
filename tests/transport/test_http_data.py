"""REST data plane against a real engine behind uvicorn on 127.0.0.1 port 0: puts of raw
bodies, streamed reads with Range, batch gets with host and device locations, leases.

Transport behaviour only; malformed uploads are in test_http_data_malformed.py and the
gRPC interplay in test_http_data_grpc.py.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
import time
import zlib
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch

from embcache.service.config import Settings
from embcache.service.device.pool import DevicePool
from embcache.service.engine import CacheEngine
from embcache.service.observability.metrics import Metrics
from embcache.service.transport.http.app import create_app
from embcache.service.transport.http.testing import serve_in_thread

PAGE = 4096
TOKEN = "data-token"


def settings_for(shm_name: str, **kw: Any) -> Settings:
    return Settings(
        host_pool_bytes=kw.pop("pool", 64 * PAGE),
        page_bytes=PAGE,
        shm_name=shm_name,
        device="cpu",
        **kw,
    )


@pytest.fixture
def engine(shm_name: str) -> Iterator[CacheEngine]:
    with CacheEngine(settings_for(shm_name)) as eng:
        yield eng


@pytest.fixture
def client(engine: CacheEngine) -> Iterator[httpx.Client]:
    app = create_app(engine, engine.settings, Metrics(engine))
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=10) as c:
        yield c


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def put(client: httpx.Client, key: str, t: torch.Tensor, **headers: str) -> httpx.Response:
    hdrs = {
        "X-Embcache-Dtype": str(t.dtype).removeprefix("torch."),
        "X-Embcache-Shape": ",".join(map(str, t.shape)),
        "Content-Type": "application/octet-stream",
        **headers,
    }
    return client.put(f"/v1/entries/{key}", content=raw(t), headers=hdrs)


def decode(resp: httpx.Response) -> torch.Tensor:
    dtype = getattr(torch, resp.headers["x-embcache-dtype"])
    shape = [int(d) for d in resp.headers["x-embcache-shape"].split(",") if d]
    return torch.frombuffer(bytearray(resp.content), dtype=dtype).view(shape)


def idle(engine: CacheEngine, timeout: float = 5.0) -> None:
    """No lease, no reservation (a lease may end just after its response was sent)."""
    deadline = time.monotonic() + timeout
    while True:
        s = engine.stats()
        state = (s.leases_active, s.entries_filling, s.reserved_filling_bytes)
        if state == (0, 0, 0) or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert state == (0, 0, 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_round_trip(client: httpx.Client, engine: CacheEngine, dtype: torch.dtype) -> None:
    src = (torch.randn(37, 129) * 5).to(dtype)  # odd sizes, several pages
    data = raw(src)
    r = put(client, "emb/1", src, **{"X-Embcache-Checksum": str(zlib.crc32(data))})
    assert r.status_code == 201, r.text
    assert r.json() == {
        "key": "emb/1",
        "created": True,
        "dtype": str(dtype).removeprefix("torch."),
        "shape": [37, 129],
        "nbytes": len(data),
    }
    got = client.get("/v1/entries/emb/1/data")
    assert got.status_code == 200 and got.content == data
    assert got.headers["content-type"] == "application/octet-stream"
    assert got.headers["x-embcache-checksum"] == str(zlib.crc32(data))
    assert got.headers["x-embcache-nbytes"] == str(len(data))
    assert torch.equal(decode(got), src)
    assert put(client, "emb/1", src).status_code == 200  # idempotent: created false
    idle(engine)


def test_query_params_and_chunked_body(client: httpx.Client, engine: CacheEngine) -> None:
    src = torch.arange(3000, dtype=torch.float32)
    data = raw(src)

    def pieces() -> Iterator[bytes]:  # no Content-Length: chunked, odd piece sizes
        for i in range(0, len(data), 777):
            yield data[i : i + 777]

    crc = hex(zlib.crc32(data))
    params = {"dtype": "float32", "shape": "3000", "checksum": crc}
    r = client.put("/v1/entries/q", params=params, content=pieces())
    assert r.status_code == 201, r.text
    assert client.get("/v1/entries/q/data").content == data
    # header and query may both be given when they agree; not when they differ
    r = client.put(
        "/v1/entries/q", params=params, headers={"X-Embcache-Dtype": "float32"}, content=data
    )
    assert r.status_code == 200
    r = client.put("/v1/entries/q", params=params, headers={"X-Embcache-Shape": "1"}, content=data)
    assert r.status_code == 400 and r.json()["error"] == "InvalidArgument"
    scalar = client.put("/v1/entries/s", params={"dtype": "int64", "shape": ""}, content=b"\1" * 8)
    assert scalar.status_code == 201 and scalar.json()["shape"] == []
    idle(engine)


def test_fragmented_entry(client: httpx.Client, engine: CacheEngine) -> None:
    # Fill the pool with 2-page entries, free every other one: a 6-page entry takes 3 runs.
    filler = torch.zeros(PAGE // 2, dtype=torch.float32)  # 2 pages
    for i in range(32):
        engine.put(f"f{i}", filler)
    engine.evict([f"f{i}" for i in range(0, 32, 2)][:3])
    src = torch.randn(6 * PAGE // 4)
    assert put(client, "frag", src).status_code == 201
    assert client.get("/v1/entries/frag").json()["num_runs"] == 3
    data = raw(src)
    assert client.get("/v1/entries/frag/data").content == data
    # a range that crosses run boundaries
    r = client.get("/v1/entries/frag/data", headers={"Range": f"bytes={PAGE}-{5 * PAGE + 9}"})
    assert r.status_code == 206 and r.content == data[PAGE : 5 * PAGE + 10]
    idle(engine)


def test_conflict_and_limits(shm_name: str) -> None:
    s = settings_for(shm_name, max_entry_bytes=32 * PAGE, max_inflight_bytes_per_client=16 * PAGE)
    with CacheEngine(s) as engine:
        app = create_app(engine, s, Metrics(engine))
        with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=10) as client:
            assert put(client, "k", torch.ones(4, 4)).status_code == 201
            r = put(client, "k", torch.ones(2, 8))
            assert r.status_code == 409 and r.json()["error"] == "MetadataConflict"
            r = put(client, "big", torch.ones(33 * PAGE // 4))
            assert r.status_code == 413 and r.json()["error"] == "EntryTooLarge"
            r = put(client, "quota", torch.ones(17 * PAGE // 4))
            assert r.status_code == 429 and r.json()["error"] == "QuotaExceeded"
            for i in range(4):  # fill the pool with leased entries
                engine.put(f"l{i}", torch.ones(15 * PAGE // 4))
            for owner in ("holder", "other"):  # each may lease half the pool at most
                engine.get([f"l{i}" for i in range(4) if (i % 2) == (owner == "other")], owner)
            r = put(client, "full", torch.ones(8 * PAGE // 4))
            assert r.status_code == 507 and r.json()["error"] == "PoolExhausted"
            engine.drop_owner("holder")
            engine.drop_owner("other")
            engine.begin_drain()
            r = put(client, "late", torch.ones(4))
            assert r.status_code == 503 and r.json()["error"] == "Draining"
            assert client.post("/v1/get", json={"keys": ["k"]}).status_code == 503
            assert client.get("/v1/entries/k/data").status_code == 503
            idle(engine)


def test_keys_with_slashes_and_a_data_suffix(client: httpx.Client, engine: CacheEngine) -> None:
    a, b = torch.ones(8), torch.full((8,), 2.0)
    assert put(client, "img/2024/x", a).status_code == 201
    assert put(client, "img/2024/x/data", b).status_code == 405  # /data: the bytes suffix
    assert put(client, "img/2024/x%2Fdata", b).status_code == 201  # the key ending in /data
    assert client.get("/v1/entries/img/2024/x/data").content == raw(a)
    assert client.get("/v1/entries/img/2024/x/data/data").content == raw(b)
    detail = client.get("/v1/entries/img/2024/x%2Fdata")  # the entry 'img/2024/x/data' itself
    assert detail.status_code == 200 and detail.json()["key"] == "img/2024/x/data"
    assert client.get("/v1/entries/img/2024/x").json()["key"] == "img/2024/x"
    assert client.get("/v1/entries/nope/data").status_code == 404
    assert client.delete("/v1/entries/img/2024/x/data").status_code == 405
    assert client.delete("/v1/entries/img/2024/x%2Fdata").json()["key"] == "img/2024/x/data"
    assert engine.exists(["img/2024/x", "img/2024/x/data"]) == [True, False]
    idle(engine)


@pytest.mark.parametrize(
    ("header", "status", "span"),
    [
        ("bytes=0-0", 206, (0, 1)),
        ("bytes=10-19", 206, (10, 20)),
        ("bytes=100-", 206, (100, 400)),
        ("bytes=-7", 206, (393, 400)),
        ("bytes=-1000", 206, (0, 400)),
        ("bytes=390-5000", 206, (390, 400)),
        ("bytes=0-1,5-9", 200, (0, 400)),  # several ranges: ignored, whole entry
        ("items=0-3", 200, (0, 400)),  # another unit: ignored
        ("bytes=9-3", 200, (0, 400)),  # malformed: ignored
        ("bytes=400-", 416, None),
        ("bytes=-0", 416, None),
    ],
)
def test_range(
    client: httpx.Client, engine: CacheEngine, header: str, status: int, span: Any
) -> None:
    src = torch.randn(100)
    data = raw(src)
    put(client, "r", src)
    r = client.get("/v1/entries/r/data", headers={"Range": header})
    assert r.status_code == status, r.text
    if span is None:
        assert r.headers["content-range"] == "bytes */400"
        assert r.json()["error"] == "RangeNotSatisfiable"
    else:
        assert r.content == data[span[0] : span[1]]
        assert r.headers["content-length"] == str(span[1] - span[0])
        if status == 206:
            assert r.headers["content-range"] == f"bytes {span[0]}-{span[1] - 1}/400"
    idle(engine)  # the read lease ended with the response


def test_empty_entry(client: httpx.Client, engine: CacheEngine) -> None:
    r = client.put("/v1/entries/z", params={"dtype": "float16", "shape": "0,4"}, content=b"")
    assert r.status_code == 201
    got = client.get("/v1/entries/z/data")
    assert got.status_code == 200 and got.content == b""
    assert got.headers["x-embcache-shape"] == "0,4"
    assert client.get("/v1/entries/z/data", headers={"Range": "bytes=0-"}).status_code == 416
    idle(engine)


def test_reader_that_leaves_early_gives_its_lease_back(shm_name: str) -> None:
    s = settings_for(shm_name, pool=4096 * PAGE)
    with CacheEngine(s) as engine:
        app = create_app(engine, s, Metrics(engine))
        with serve_in_thread(app) as url:
            engine.put("big", torch.randn((12 << 20) // 4))  # more than socket buffers hold
            port = int(url.rsplit(":", 1)[1])
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.settimeout(10)
            sock.connect(("127.0.0.1", port))
            sock.sendall(b"GET /v1/entries/big/data HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
            assert engine.stats().leases_active == 1  # the stream is still being sent
            sock.close()  # the reader leaves mid-body
            idle(engine, timeout=10)


READER = """
import json, mmap, os, sys, zlib
req = json.loads(sys.stdin.read())
pool = req["pool"]
fd = os.open("/dev/shm/" + pool["segment_name"], os.O_RDONLY)
st = os.fstat(fd)
assert (st.st_dev, st.st_ino) == (pool["st_dev"], pool["st_ino"]), "another segment"
mm = mmap.mmap(fd, pool["size"], flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
os.close(fd)
out = {}
for key, runs in req["entries"].items():
    data = b"".join(mm[r["offset"] : r["offset"] + r["length"]] for r in runs)
    out[key] = [len(data), zlib.crc32(data)]
print(json.dumps(out))
"""


def test_batch_get_host_locations_read_by_another_process(
    client: httpx.Client, engine: CacheEngine
) -> None:
    engine.put("pad", torch.zeros(PAGE // 4))
    srcs = {
        "a": torch.randn(300).to(torch.bfloat16),
        "b/c": torch.randn(3 * PAGE // 4),
        "d": torch.randn(50).to(torch.float16),
    }
    for key, t in srcs.items():
        assert put(client, key, t).status_code == 201
    engine.evict(["pad"])
    body = client.post("/v1/get", json={"keys": ["a", "missing", "b/c", "d"], "ttl_s": 30}).json()
    assert [r["found"] for r in body["results"]] == [True, False, True, True]
    assert body["results"][1] == {"key": "missing", "found": False}
    assert body["ttl_s"] == 30
    (pool,) = body["pools"]
    assert pool["kind"] == "host_shm" and pool["segment_name"] == engine.host_pool.name
    hits = [r for r in body["results"] if r["found"]]
    assert all(r["location"]["pool_id"] == pool["pool_id"] for r in hits)
    assert all(isinstance(r["lease_id"], str) for r in hits)
    holders = client.get("/v1/entries/a").json()["lease_holders"]
    assert [h["owner"] for h in holders] == ["rest:127.0.0.1"]
    assert engine.evict(["a"])[0].value == "leased"  # leased: never evicted
    request = {"pool": pool, "entries": {r["key"]: r["location"]["runs"] for r in hits}}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(READER)],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    for key, t in srcs.items():
        data = raw(t)
        assert seen[key] == [len(data), zlib.crc32(data)], key
    ids = [r["lease_id"] for r in hits]
    assert client.post("/v1/release", json={"lease_ids": ids}).json() == {"released": 3}
    assert client.post("/v1/release", json={"lease_ids": ids}).json() == {"released": 0}
    idle(engine)


def test_rest_leases_expire_by_ttl_and_renew(client: httpx.Client, engine: CacheEngine) -> None:
    engine.put("t", torch.ones(4))
    body = client.post("/v1/get", json={"keys": ["t", "t"], "ttl_s": 0.3}).json()
    ids = [int(r["lease_id"]) for r in body["results"]]
    renewed = client.post("/v1/renew", json={"lease_ids": [ids[0]], "ttl_s": 30})
    assert renewed.json() == {"renewed": 1}
    time.sleep(0.5)
    assert engine.expire_leases() == 1  # the daemon's reaper does this
    assert client.post("/v1/release", json={"lease_ids": ids}).json() == {"released": 1}
    r = client.post("/v1/get", json={"keys": ["t"], "ttl_s": 1e9})
    assert r.status_code == 400 and r.json()["error"] == "InvalidArgument"  # > max_lease_ttl_s
    for bad in ([-1], ["12a"], [False], "nope"):
        assert client.post("/v1/release", json={"lease_ids": bad}).status_code == 422
    # An integer no lease has is skipped, however large (the schema bounds it below only).
    assert client.post("/v1/release", json={"lease_ids": [2**64]}).json() == {"released": 0}
    idle(engine)


def test_delete_and_evict_respect_rest_leases(client: httpx.Client, engine: CacheEngine) -> None:
    engine.put("e", torch.ones(4))
    lease_id = client.post("/v1/get", json={"keys": ["e"]}).json()["results"][0]["lease_id"]
    r = client.delete("/v1/entries/e")
    assert r.status_code == 409 and r.json()["error"] == "EntryLeased"
    assert client.post("/v1/evict", json={"keys": ["e"]}).json()["leased"] == ["e"]
    client.post("/v1/release", json={"lease_ids": [lease_id]})
    assert client.delete("/v1/entries/e").json()["evicted"] is True
    assert client.delete("/v1/entries/e").status_code == 404


def test_batch_get_device_locations(shm_name: str) -> None:
    s = settings_for(shm_name)
    pool = DevicePool(torch.device("cpu"), 16 * PAGE, PAGE, ipc_mode="fd", index=0)
    with CacheEngine(s, device_pools=[pool]) as engine:
        app = create_app(engine, s, Metrics(engine))
        with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=10) as client:
            srcs = {"x": torch.randn(PAGE), "y": torch.randn(10).to(torch.bfloat16)}
            for key, t in srcs.items():
                put(client, key, t)
            body = client.post("/v1/get", json={"keys": ["x", "n", "y"], "gpu_uuid": "CPU-0"})
            assert body.status_code == 200, body.text
            res = body.json()
            (desc,) = res["pools"]
            assert desc["kind"] == "device" and desc["ipc_mode"] == "none"
            assert desc["gpu_uuid"] == "CPU-0" and desc["size"] == 16 * PAGE
            assert "ipc_handle" not in desc and "fd_token" not in desc
            for r in res["results"]:
                if not r["found"]:
                    continue
                loc, data = r["location"], raw(srcs[r["key"]])
                assert loc["kind"] == "device" and loc["pool_id"] == desc["pool_id"]
                flat = pool.tensor
                if "offset" in loc:
                    got = flat[loc["offset"] : loc["offset"] + len(data)]
                else:
                    pages = flat.view(-1, PAGE)[torch.tensor(loc["page_ids"])]
                    got = pages.view(-1)[: len(data)]
                assert got.numpy().tobytes() == data
            ids = [r["lease_id"] for r in res["results"] if r["found"]]
            assert client.post("/v1/release", json={"lease_ids": ids}).json()["released"] == 2
            r = client.post("/v1/get", json={"keys": ["x"], "gpu_uuid": "GPU-other"})
            assert r.status_code == 409 and r.json()["error"] == "DeviceUnavailable"
            idle(engine)


def test_device_get_without_device_pool(client: httpx.Client, engine: CacheEngine) -> None:
    engine.put("x", torch.ones(4))
    r = client.post("/v1/get", json={"keys": ["x"], "gpu_uuid": "GPU-123"})
    assert r.status_code == 409 and r.json()["error"] == "DeviceUnavailable"
    idle(engine)


def test_token_guards_data_routes(engine: CacheEngine) -> None:
    s = engine.settings.model_copy(update={"auth_token": TOKEN})
    app = create_app(engine, s, Metrics(engine))
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=10) as client:
        engine.put("k", torch.ones(4))
        assert put(client, "new", torch.ones(4)).status_code == 401
        assert client.get("/v1/entries/k/data").status_code == 401
        r = client.post("/v1/get", json={"keys": ["k"]})
        assert r.status_code == 401 and "pools" not in r.json()  # no descriptors
        auth = {"Authorization": f"Bearer {TOKEN}"}
        assert put(client, "new", torch.ones(4), **auth).status_code == 201
        assert client.get("/v1/entries/k/data", headers=auth).content == raw(torch.ones(4))
        body = client.post("/v1/get", json={"keys": ["k"]}, headers=auth).json()
        assert body["pools"][0]["kind"] == "host_shm"
        ids = [body["results"][0]["lease_id"]]
        client.post("/v1/release", json={"lease_ids": ids}, headers=auth)
        idle(engine)


def test_openapi_documents_bodies_and_headers(client: httpx.Client) -> None:
    spec = client.get("/openapi.json").json()
    put_op = spec["paths"]["/v1/entries/{key}"]["put"]
    assert put_op["requestBody"]["content"]["application/octet-stream"]["schema"]["format"] == (
        "binary"
    )
    params = {(p["in"], p["name"]) for p in put_op["parameters"]}
    assert {
        ("header", "X-Embcache-Dtype"),
        ("header", "X-Embcache-Shape"),
        ("header", "X-Embcache-Checksum"),
        ("query", "dtype"),
        ("query", "shape"),
        ("query", "checksum"),
        ("path", "key"),
    } <= params
    assert {"200", "201", "409", "413", "429", "503", "507"} <= set(put_op["responses"])
    data_op = spec["paths"]["/v1/entries/{key}/data"]["get"]
    assert ("header", "Range") in {(p["in"], p["name"]) for p in data_op["parameters"]}
    for code in ("200", "206"):
        resp = data_op["responses"][code]
        assert "application/octet-stream" in resp["content"]
        assert {"X-Embcache-Dtype", "X-Embcache-Shape"} <= set(resp["headers"])
    assert "416" in data_op["responses"]
    for path in ("/v1/get", "/v1/release", "/v1/renew"):
        op = spec["paths"][path]["post"]
        assert "application/json" in op["requestBody"]["content"]
        assert "application/json" in op["responses"]["200"]["content"]
