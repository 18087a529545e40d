"""The operator plane on a CUDA machine: readiness with a registered pool, the device grid,
device-tier metrics fed by real H2D copies. Skipped without a GPU (``gpu`` marker)."""

from __future__ import annotations

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from embcache.service.config import Settings
from embcache.service.engine import CacheEngine
from embcache.service.observability.metrics import Metrics
from embcache.service.transport.http.app import create_app
from embcache.service.transport.http.testing import serve_in_thread

pytestmark = pytest.mark.gpu
MiB = 1024**2


def test_rest_and_metrics_with_a_device_pool(shm_name: str) -> None:
    settings = Settings(host_pool_bytes=64 * MiB, page_bytes="64KiB", shm_name=shm_name,
                        device="cuda", device_pool_bytes=32 * MiB,
                        device_page_bytes="64KiB", ipc_mode="legacy")  # fmt: skip
    metrics = Metrics()  # the engine reports its copies to it (constructor hook)
    with CacheEngine(settings, copy_observer=metrics.observe_copy) as engine:
        metrics.watch_engine(engine)
        engine.put("a", torch.randn(256, 1024))  # 1 MiB: 16 pages on either side
        engine.put("b", torch.randn(64, 1024))
        leased, _ = engine.device.get(["a"], "decoder-0")
        assert leased[0] is not None
        app = create_app(engine, settings, metrics)
        with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=30) as client:
            ready = client.get("/readyz")
            assert ready.status_code == 200, ready.text
            assert ready.json()["cuda_ready"] is True

            body = client.get("/v1/pool-map").json()
            assert body["device"]["num_pages"] == 512
            assert body["device"]["counts"]["leased"] == 16
            pools = len(engine.device_tier.pools)  # one per visible GPU
            assert body["summary"]["device_capacity_bytes"] == pools * 32 * MiB

            page = client.get("/v1/entries", params={"tier": "device"}).json()
            assert [e["key"] for e in page["items"]] == ["a"]
            assert page["items"][0]["residency"] == ["host", "device:0"]

            samples = {}
            for family in text_string_to_metric_families(client.get("/metrics").text):
                for s in family.samples:
                    samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
            dev = (("device", "0"), ("tier", "device"))
            assert samples[("embcache_pool_capacity_bytes", dev)] == 32 * MiB
            assert samples[("embcache_pool_used_bytes", dev)] == 1 * MiB
            assert samples[("embcache_copy_bytes_total", (("direction", "h2d"),))] == 1 * MiB
            key = ("embcache_copy_bandwidth_bytes_per_second_count", (("direction", "h2d"),))
            assert samples[key] >= 1
        engine.release([leased[0].lease.lease_id])
