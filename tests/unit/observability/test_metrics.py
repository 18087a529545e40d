"""Metrics: the collector over engine stats, and the histograms transports feed."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from embcache import build_info
from embcache.service.config import Settings
from embcache.service.engine import CacheEngine
from embcache.service.observability.metrics import Metrics

PAGE = 4096


@pytest.fixture
def engine(shm_name: str) -> Iterator[CacheEngine]:
    settings = Settings(host_pool_bytes=64 * PAGE, page_bytes=PAGE, shm_name=shm_name, device="cpu")
    with CacheEngine(settings) as eng:
        yield eng


def scrape(metrics: Metrics) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of one scrape, parsed back by prometheus-client's own parser."""
    text = generate_latest(metrics.registry).decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def test_known_sequence_of_operations(engine: CacheEngine) -> None:
    metrics = Metrics(engine)
    # 3 puts: 2 pages, 1 page, 5 pages (fp32 rows of 1 KiB).
    engine.put("alpha", torch.zeros(8, 256))
    engine.put("beta", torch.zeros(4, 256))
    engine.put("gamma", torch.zeros(20, 256))
    assert engine.put("beta", torch.zeros(4, 256)) is False  # idempotent, not a new put
    leases = engine.get(["alpha", "beta", "nope", "alpha"], owner="t")
    engine.get(["missing"], owner="t")
    engine.release([lease.lease_id for lease in leases if lease and lease.key == "beta"])
    engine.evict(["beta"])
    # A direction the engine does not count itself (e.g. a transport's own copies).
    metrics.observe_copy("net_in", 3 * PAGE, 0.001)
    metrics.observe_copy("net_in", PAGE, 0.0)  # zero time: counted, kept out of the histogram

    s = scrape(metrics)
    host = {"tier": "host", "device": ""}
    assert value(s, "embcache_pool_capacity_bytes", **host) == 64 * PAGE
    assert value(s, "embcache_pool_used_bytes", **host) == 7 * PAGE
    assert value(s, "embcache_pool_pages", state="free", **host) == 57
    assert value(s, "embcache_entries", state="ready") == 2
    assert value(s, "embcache_entries", state="filling") == 0
    assert value(s, "embcache_hits_total") == 3
    assert value(s, "embcache_misses_total") == 2
    assert value(s, "embcache_evictions_total") == 1
    assert value(s, "embcache_evicted_bytes_total") == 4 * 256 * 4
    assert value(s, "embcache_puts_total", outcome="committed") == 3
    assert value(s, "embcache_put_bytes_total") == (8 + 4 + 20) * 1024
    assert value(s, "embcache_leases_active") == 2  # two leases on alpha remain
    assert value(s, "embcache_lease_owners") == 1
    assert value(s, "embcache_draining") == 0
    assert value(s, "embcache_copy_bytes_total", direction="net_in") == 4 * PAGE
    assert value(s, "embcache_copy_bandwidth_bytes_per_second_count", direction="net_in") == 1
    assert value(s, "embcache_copy_bandwidth_bytes_per_second_sum", direction="net_in") == (
        pytest.approx(3 * PAGE / 0.001)
    )
    # Keys never become label values.
    label_values = {v for (_, labels) in s for _, v in labels}
    assert not label_values & {"alpha", "beta", "gamma", "nope", "missing"}

    engine.begin_drain()
    assert value(scrape(metrics), "embcache_draining") == 1


def test_rpc_histogram(engine: CacheEngine) -> None:
    metrics = Metrics(engine)
    metrics.observe_rpc("grpc", "Get", "OK", 0.002)
    metrics.observe_rpc("grpc", "Get", "OK", 0.004)
    metrics.observe_rpc("http", "GET /v1/stats", "200", 0.5)
    s = scrape(metrics)
    ok = {"transport": "grpc", "method": "Get", "code": "OK"}
    assert value(s, "embcache_rpc_duration_seconds_count", **ok) == 2
    assert value(s, "embcache_rpc_duration_seconds_sum", **ok) == pytest.approx(0.006)
    assert value(s, "embcache_rpc_duration_seconds_bucket", le="0.0025", **ok) == 1
    assert value(s, "embcache_rpc_duration_seconds_bucket", le="+Inf", **ok) == 2
    http = {"transport": "http", "method": "GET /v1/stats", "code": "200"}
    assert value(s, "embcache_rpc_duration_seconds_count", **http) == 1


def test_registries_are_per_instance(engine: CacheEngine) -> None:
    a, b = Metrics(engine), Metrics(engine)  # a global registry would refuse the second
    a.observe_rpc("http", "GET /livez", "200", 0.001)
    assert not any(name == "embcache_rpc_duration_seconds_count" for name, _ in scrape(b))
    assert a.registry is not b.registry


def test_every_name_is_prefixed_and_typed(engine: CacheEngine) -> None:
    text = generate_latest(Metrics(engine).registry).decode()
    families = list(text_string_to_metric_families(text))
    assert families
    for family in families:  # the standard process_* metrics keep their standard names
        assert family.name.startswith(("embcache_", "process_")), family.name
        if family.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in family.samples)


def test_observe_copy_rejects_negative_bytes(engine: CacheEngine) -> None:
    with pytest.raises(ValueError, match="nbytes"):
        Metrics(engine).observe_copy("d2h", -1, 1.0)


def test_device_copies_counted_once(shm_name: str) -> None:
    """Engine copies: bytes from the engine's counters, bandwidth from its observer hook."""
    device_pool = pytest.importorskip("embcache.service.device.pool")
    settings = Settings(host_pool_bytes=64 * PAGE, page_bytes=PAGE, shm_name=shm_name,
                        device="cpu")  # fmt: skip
    pool = device_pool.DevicePool(torch.device("cpu"), 16 * PAGE, PAGE)
    metrics = Metrics()
    with CacheEngine(settings, device_pools=[pool], copy_observer=metrics.observe_copy) as engine:
        metrics.watch_engine(engine)
        assert engine.device_tier.copier.observer == metrics.observe_copy
        engine.put("a", torch.ones(3, 1024))  # 12 KiB
        results, _ = engine.device.get(["a"], "dec")
        engine.release([r.lease.lease_id for r in results if r is not None])
        engine.device.get(["a"], "dec")  # resident now: no second copy
        s = scrape(metrics)
        assert value(s, "embcache_copy_bytes_total", direction="h2d") == 3 * PAGE
        device = {"tier": "device", "device": "0"}
        assert value(s, "embcache_pool_capacity_bytes", **device) == 16 * PAGE
        assert value(s, "embcache_pool_used_bytes", **device) == 3 * PAGE
        h2d = value(s, "embcache_copy_bandwidth_bytes_per_second_count", direction="h2d")
        assert h2d == 1


def test_the_put_landing_is_free_capacity_on_loan(engine: CacheEngine) -> None:
    metrics = Metrics(engine)
    engine.device.put("dev", torch.ones(2 * PAGE, dtype=torch.uint8))  # asks for 2 pages
    s = scrape(metrics)
    host = {"tier": "host", "device": ""}
    assert value(s, "embcache_put_landing_bytes") == 2 * PAGE  # topped up for the next one
    assert value(s, "embcache_pool_used_bytes", **host) == 2 * PAGE  # the entry only
    assert value(s, "embcache_pool_pages", state="free", **host) == 62


def test_build_info_and_process_metrics(engine: CacheEngine) -> None:
    samples = scrape(Metrics(engine))
    labels = {"version": build_info.version(), "commit": build_info.git_commit()}
    assert value(samples, "embcache_build_info", **labels) == 1
    names = {name for name, _ in samples}
    for name in ("process_cpu_seconds_total", "process_resident_memory_bytes",
                 "process_open_fds", "process_start_time_seconds"):  # fmt: skip
        assert name in names, name
