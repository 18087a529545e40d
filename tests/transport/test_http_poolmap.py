"""Pool-map helpers: page-state downsampling and the rate history."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from embcache.service.observability.metrics import Metrics, is_operation
from embcache.service.transport.http.poolmap import (
    HOST_STATES,
    Counters,
    History,
    bucket_quantile,
    downsample,
)


def test_downsample_identity_when_small() -> None:
    states = np.array([0, 1, 2, 3, 2, 0], dtype=np.uint8)
    out = downsample(states, HOST_STATES, 4096)
    assert (out.num_pages, out.pages_per_cell, out.cells) == (6, 1, "012320")
    assert out.counts == {"free": 2, "filling": 1, "ready": 2, "leased": 1}


def test_downsample_majority_then_priority() -> None:
    states = np.array([2, 2, 0, 3, 0, 0, 1, 0, 3], dtype=np.uint8)
    out = downsample(states, HOST_STATES, 3)
    # cell 0: ready wins 2-1; cell 1: free 2 beats leased 1; cell 2: tie of 3 -> leased, the
    # most important state, beats free and filling.
    assert (out.pages_per_cell, out.cells) == (3, "203")


def test_downsample_partial_last_cell_and_empty() -> None:
    out = downsample(np.array([3] * 5, dtype=np.uint8), HOST_STATES, 2)
    assert (out.pages_per_cell, out.cells) == (3, "33")
    empty = downsample(np.zeros(0, dtype=np.uint8), HOST_STATES, 16)
    assert empty.cells == "" and empty.counts["free"] == 0
    with pytest.raises(ValueError, match="max_cells"):
        downsample(np.zeros(4, dtype=np.uint8), HOST_STATES, 0)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 3), min_size=1, max_size=3000),
    st.integers(1, 5000),
)
def test_downsample_properties(pages: list[int], max_cells: int) -> None:
    states = np.array(pages, dtype=np.uint8)
    out = downsample(states, HOST_STATES, max_cells)
    assert 1 <= len(out.cells) <= max_cells
    assert len(out.cells) == -(-len(pages) // out.pages_per_cell)
    assert sum(out.counts.values()) == len(pages)
    for i, digit in enumerate(out.cells):
        group = pages[i * out.pages_per_cell : (i + 1) * out.pages_per_cell]
        assert group.count(int(digit)) == max(group.count(s) for s in range(4))


def test_history_rates() -> None:
    now = [0.0]
    counters = {"hits": 0, "misses": 0, "h2d": 0.0}

    def read() -> tuple[int, int, dict[str, float]]:
        return counters["hits"], counters["misses"], {"h2d": counters["h2d"]}

    hist = History(
        read, interval_s=2, window_s=6, clock=lambda: now[0], wall_clock=lambda: 1000 + now[0]
    )
    hist.sample()
    assert hist.series().t == []
    for hits, misses, copied in ((3, 1, 4000.0), (3, 1, 4000.0), (4, 4, 10000.0)):
        now[0] += 2
        counters.update(hits=hits, misses=misses, h2d=copied)
        hist.maybe_sample()
        hist.maybe_sample()  # within the interval: ignored
    series = hist.series()
    assert series.t == [1002, 1004, 1006]
    assert series.hit_rate == [0.75, None, 0.25]
    assert series.bandwidth == {"h2d": [2000.0, 0.0, 3000.0]}
    now[0] += 2
    hist.sample()
    assert len(hist.series().t) == 3  # the window keeps 6 s: 4 samples, 3 intervals
    with pytest.raises(ValueError):
        History(read, interval_s=0)


def test_history_host_bytes_operations_and_latency() -> None:
    bounds = (0.001, 0.01, 0.1)
    now = [0.0]
    state = {"in": 0, "out": 0, "ops": (0, 0, 0, 0)}

    def read() -> Counters:
        return Counters(1, 0, {}, host_in=state["in"], host_out=state["out"],
                        operations=state["ops"])  # fmt: skip

    hist = History(read, interval_s=2, window_s=10, latency_bounds_s=bounds,
                   clock=lambda: now[0], wall_clock=lambda: now[0])  # fmt: skip
    hist.sample()
    # 100 operations in 2 s: 90 under 1 ms, 9 under 10 ms, 1 under 100 ms.
    state.update({"in": 4_000_000, "out": 8_000_000, "ops": (90, 9, 1, 0)})
    now[0] += 2
    hist.sample()
    now[0] += 2
    hist.sample()  # an idle interval
    series = hist.series()
    assert series.host_in == [2_000_000.0, 0.0] and series.host_out == [4_000_000.0, 0.0]
    assert series.ops == [50.0, 0.0]
    assert series.p50_s[0] == pytest.approx(0.001 * 50 / 90, abs=1e-6)  # rounded to 1 us
    assert series.p99_s[0] == pytest.approx(0.01)
    assert series.p50_s[1] is None and series.p99_s[1] is None


def test_bucket_quantile_edges() -> None:
    assert bucket_quantile(0.5, (1.0, 2.0), (0, 0, 0)) is None
    assert bucket_quantile(0.99, (1.0, 2.0), (0, 0, 5)) == 2.0  # the open top bucket
    assert bucket_quantile(0.5, (1.0, 2.0), (0, 4, 0)) == pytest.approx(1.5)


def test_operations_are_data_calls_only() -> None:
    for transport, method in (("grpc", "Put"), ("grpc", "GetBytes"), ("lane", "Session.get"),
                              ("grpc", "Session.put_reserve"), ("http", "POST /v1/get"),
                              ("http", "PUT /v1/entries/{key:path}")):  # fmt: skip
        assert is_operation(transport, method), (transport, method)
    for transport, method in (("grpc", "Session"), ("grpc", "Stats"), ("grpc", "Lanes"),
                              ("http", "GET /v1/pool-map"), ("http", "GET /v1/entries"),
                              ("http", "GET /livez"), ("http", "unmatched")):  # fmt: skip
        assert not is_operation(transport, method), (transport, method)
    metrics = Metrics()
    metrics.observe_rpc("http", "POST /v1/get", "200", 0.0004)
    metrics.observe_rpc("http", "GET /v1/pool-map", "200", 0.0004)
    metrics.observe_rpc("grpc", "Get", "OK", 100.0)
    buckets = metrics.operation_buckets()
    assert sum(buckets) == 2 and buckets[2] == 1 and buckets[-1] == 1  # 0.5 ms bucket, +Inf
