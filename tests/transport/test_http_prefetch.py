from __future__ import annotations

from collections.abc import Iterator

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


@pytest.fixture
def client(shm_name: str) -> Iterator[tuple[httpx.Client, CacheEngine]]:
    settings = Settings(host_pool_bytes=64 * PAGE, page_bytes=PAGE, shm_name=shm_name, device="cpu")
    pool = DevicePool(torch.device("cpu"), 8 * PAGE, PAGE)
    with CacheEngine(settings, device_pools=[pool]) as engine:
        app = create_app(engine, settings, Metrics(engine))
        with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=10) as c:
            yield c, engine


def test_prefetch_warms_the_device(client: tuple[httpx.Client, CacheEngine]) -> None:
    http, engine = client
    engine.put("a", torch.ones(100))
    r = http.post("/v1/prefetch", json={"keys": ["a", "b"], "gpu_uuid": "CPU-0"})
    assert r.status_code == 200
    assert r.json() == {"requested": 2, "local": 1, "fetched": 0, "missing": 1, "resident": 1}
    assert engine.entry_info("a").residency == ("host", "device:0")  # type: ignore[union-attr]
    assert engine.stats().leases_active == 0
    r = http.post("/v1/prefetch", json={"keys": ["a"], "gpu_uuid": "GPU-nope"})
    assert r.status_code == 409 and r.json()["error"] == "DeviceUnavailable"
    assert http.post("/v1/prefetch", json={"keys": []}).status_code == 422
