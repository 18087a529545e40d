"""REST and gRPC on one engine: what one transport writes the other reads, and both obey
the same collision guard and lease rules.

In process: a gRPC server (``serving.serving``) and the FastAPI app under uvicorn on the
same engine, with the real client library. Then once through ``embcache serve`` as a
subprocess (both listeners on one loop, as deployed), stopped by its pid.
"""

from __future__ import annotations

import tempfile
import time
import uuid
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch

from embcache.clients import EmbCacheClient
from embcache.errors import EntryLeased, MetadataConflict
from embcache.service.config import Settings
from embcache.service.engine import CacheEngine
from embcache.service.observability.metrics import Metrics
from embcache.service.transport.http.app import create_app
from embcache.service.transport.http.testing import serve_in_thread
from embcache.service.transport.serving import serving

KiB = 1 << 10
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@dataclass
class Both:
    engine: CacheEngine
    rest: httpx.Client
    grpc: EmbCacheClient


@pytest.fixture
def both(shm_name: str) -> Iterator[Both]:
    with tempfile.TemporaryDirectory(prefix="ecr-") as d:
        settings = Settings(
            grpc_port=0,
            grpc_socket=Path(d) / "g.sock",
            shm_name=shm_name,
            host_pool_bytes=1 << 20,
            page_bytes=16 * KiB,
            device="cpu",
        )
        with serving(settings) as (engine, thread):
            assert thread.service is not None
            app = create_app(engine, settings, Metrics(engine))
            with (
                serve_in_thread(app) as url,
                httpx.Client(base_url=url, timeout=10) as rest,
                EmbCacheClient(f"unix:{thread.service.socket_path}", timeout=10) as client,
            ):
                yield Both(engine, rest, client)


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def rest_put(rest: httpx.Client, key: str, t: torch.Tensor) -> httpx.Response:
    data = raw(t)
    headers = {
        "X-Embcache-Dtype": str(t.dtype).removeprefix("torch."),
        "X-Embcache-Shape": ",".join(map(str, t.shape)),
        "X-Embcache-Checksum": str(zlib.crc32(data)),
    }
    return rest.put(f"/v1/entries/{key}", content=data, headers=headers)


@pytest.mark.parametrize("dtype", DTYPES)
def test_put_over_rest_read_over_grpc(both: Both, dtype: torch.dtype) -> None:
    src = (torch.randn(41, 77) * 3).to(dtype)
    assert rest_put(both.rest, "r/1", src).status_code == 201
    got = both.grpc.get_bytes("r/1")
    assert got is not None and got.dtype == str(dtype).removeprefix("torch.")
    assert torch.equal(got.tensor(), src)
    with both.grpc.get(["r/1"]) as (view,):  # zero-copy from the shared segment
        assert torch.equal(view, src)
    assert both.grpc.put("r/1", src) is False  # same metadata: idempotent across transports


@pytest.mark.parametrize("dtype", DTYPES)
def test_put_over_grpc_read_over_rest(both: Both, dtype: torch.dtype) -> None:
    src = (torch.randn(3, 5000) * 3).to(dtype)
    data = raw(src)
    assert both.grpc.put("g/1", src) is True
    resp = both.rest.get("/v1/entries/g/1/data")
    assert resp.status_code == 200 and resp.content == data
    assert resp.headers["x-embcache-checksum"] == str(zlib.crc32(data))  # the client's CRC
    part = both.rest.get("/v1/entries/g/1/data", headers={"Range": "bytes=100-"})
    assert part.status_code == 206 and part.content == data[100:]
    body = both.rest.post("/v1/get", json={"keys": ["g/1"]}).json()
    runs = body["results"][0]["location"]["runs"]
    pool = both.engine.host_pool.array
    assert b"".join(pool[r["offset"] : r["offset"] + r["length"]].tobytes() for r in runs) == data
    assert both.rest.post("/v1/release", json={"lease_ids": [body["results"][0]["lease_id"]]})
    assert rest_put(both.rest, "g/1", src).status_code == 200  # idempotent


def test_collision_guard_is_shared(both: Both) -> None:
    both.grpc.put("c", torch.ones(4, 4))
    r = rest_put(both.rest, "c", torch.ones(2, 8))
    assert r.status_code == 409 and r.json()["error"] == "MetadataConflict"
    assert rest_put(both.rest, "d", torch.ones(4, 4)).status_code == 201
    with pytest.raises(MetadataConflict):
        both.grpc.put("d", torch.ones(16))


def test_leases_hold_across_transports(both: Both) -> None:
    both.grpc.put("l", torch.ones(64))
    lease_id = both.rest.post("/v1/get", json={"keys": ["l"]}).json()["results"][0]["lease_id"]
    with pytest.raises(EntryLeased):  # a REST lease stops a gRPC evict
        both.grpc.evict("l")
    assert both.grpc.release([int(lease_id)]) == 0  # only its owner ends it (item 8)
    assert both.rest.post("/v1/release", json={"lease_ids": [lease_id]}).json()["released"] == 1
    with both.grpc.get(["l"], zero_copy=True):  # a view, leased (a copy holds nothing)
        r = both.rest.delete("/v1/entries/l")  # a gRPC lease stops a REST delete
        assert r.status_code == 409 and r.json()["error"] == "EntryLeased"
        assert both.rest.post("/v1/evict", json={"keys": ["l", "x"]}).json()["leased"] == ["l"]
    deadline = time.monotonic() + 5
    while both.engine.stats().leases_active and time.monotonic() < deadline:
        time.sleep(0.01)
    assert both.grpc.evict("l") == "evicted"
    assert both.rest.delete("/v1/entries/l").status_code == 404


def test_daemon_serves_both_planes(start_daemon) -> None:  # type: ignore[no-untyped-def]
    shm = f"embcache-test-rest-{uuid.uuid4().hex[:10]}"
    flags = ["--shm-name", shm, "--host-pool-bytes", "64MiB", "--device", "cpu"]
    daemon = start_daemon(*flags, "--drain-grace-s", "1")
    src = torch.randn(1 << 20).to(torch.bfloat16)  # 2 MiB: several HTTP body chunks
    with (
        httpx.Client(base_url=daemon.http_url, timeout=30) as rest,
        EmbCacheClient(daemon.grpc_target, timeout=30) as client,
    ):
        assert rest_put(rest, "from/rest", src).status_code == 201
        got = client.get_bytes("from/rest")
        assert got is not None and torch.equal(got.tensor(), src)
        assert client.put("from/grpc", src * 2) is True
        assert rest.get("/v1/entries/from/grpc/data").content == raw(src * 2)
        assert rest.get("/v1/stats").json()["leases_active"] == 0
    assert daemon.stop(timeout=30) == 0
    assert not Path("/dev/shm", shm).exists()
