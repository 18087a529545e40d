"""The Grafana dashboard and the alert rules query only what the daemon really exports.

Metric names come from a LIVE daemon's ``/metrics`` after a put, a get and an exists that
are calls (so the RPC histogram has samples), not from the source: a renamed metric breaks
this test.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from embcache.clients import EmbCacheClient

# -- a small PromQL scanner ----------------------------------------------------------------

_STRING = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(
    r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", re.IGNORECASE
)
_NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?:e[+-]?\d+)?(?![\w.])", re.IGNORECASE)
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_DURATION = re.compile(r"(?<![\w.])(?:\d+(?:ms|s|m|h|d|w|y))+(?![\w.])")
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan", "atan2", "group_left",
             "group_right"}  # fmt: skip


def promql_metric_names(expr: str) -> set[str]:
    """Metric names an expression selects: identifiers that are neither functions,
    aggregations, keywords, label names (inside {} or by(...)), nor numbers."""
    text = _STRING.sub(" ", expr)
    text = _MATCHERS.sub(" ", text)
    text = _RANGE.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    text = _DURATION.sub(" ", text)
    text = _NUMBER.sub(" ", text)
    names = set()
    for match in _IDENT.finditer(text):
        word = match.group(0)
        if text[match.end() :].lstrip().startswith("("):
            continue  # a function or an aggregation
        if word.lower() in _KEYWORDS:
            continue
        names.add(word)
    return names


def test_promql_scanner() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le, method) (rate(a_bucket{x="$i", y=~"b|c"}'
        "[$__rate_interval]))) / clamp_min(sum(rate(b_total[5m])) + on(i) group_left c, 1e-9)"
        " > bool 0.5 unless sum(d offset 1h) by (job)"
    )
    assert promql_metric_names(expr) == {"a_bucket", "b_total", "c", "d"}


# -- what the live daemon exports ----------------------------------------------------------


@pytest.fixture(scope="module")
def exported(live_daemon: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Series names a Prometheus server would store from the daemon, with the raw text."""
    # Through the Unix socket with the token, as the example client pods do.
    target = f"unix:{live_daemon['grpc_socket']}"
    with EmbCacheClient(target, token=live_daemon["token"], timeout=30) as client:
        emb = torch.arange(64, dtype=torch.float32).reshape(4, 16)
        assert client.put("deploy/emb-0", emb) is True
        assert client.exists(["deploy/emb-0"]) == [True]  # its posted commit is applied
        # Read out of the read table with no call: the daemon counts the hit from the touch
        # the client posts on its session (the lane).
        with client.get("deploy/emb-0") as (hit,):
            assert hit is not None and torch.equal(hit, emb)
        # A get the table cannot serve whole (a miss) is a call on the lane, answered after
        # the touch posted before it.
        with client.get(["deploy/emb-0", "deploy/missing"]) as (hit, miss):
            assert hit is not None and torch.equal(hit, emb) and miss is None
        # A key the table does not list is asked of the daemon: a gRPC call.
        assert client.exists(["deploy/emb-0", "deploy/missing"]) == [True, False]
    base = f"http://127.0.0.1:{live_daemon['http_port']}"
    auth = {"Authorization": f"Bearer {live_daemon['token']}"}
    with httpx.Client(base_url=base, timeout=30, headers=auth) as http:
        stats = http.get("/v1/stats")
        assert stats.status_code == 200
        response = http.get("/metrics")  # as the ServiceMonitor scrapes it
    assert response.status_code == 200
    families = list(text_string_to_metric_families(response.text))
    names: set[str] = set()
    for family in families:
        names |= {sample.name for sample in family.samples}
        # Families without samples yet (a histogram nothing has observed) still have a
        # TYPE line; Prometheus stores them under these names once they do.
        suffixes = {
            "counter": ("_total",),
            "histogram": ("_bucket", "_sum", "_count"),
            "summary": ("_sum", "_count"),
        }.get(family.type, ("",))
        names |= {family.name + suffix for suffix in suffixes}
    yield {"names": names, "families": {f.name: f for f in families}, "stats": stats.json()}


def test_probes_are_open_and_metrics_need_the_token(live_daemon: dict[str, Any]) -> None:
    # What the manifests rely on: kubelet probes carry no token, Prometheus sends one.
    with httpx.Client(base_url=f"http://127.0.0.1:{live_daemon['http_port']}") as http:
        assert http.get("/livez").status_code == 200
        assert http.get("/readyz").status_code == 200
        assert http.get("/metrics").status_code == 401
        wrong = {"Authorization": "Bearer not-the-token"}
        assert http.get("/metrics", headers=wrong).status_code == 401


def test_metrics_are_live_and_histograms_have_samples(exported: dict[str, Any]) -> None:
    names = exported["names"]
    assert all(n.startswith(("embcache_", "process_")) for n in names)
    assert {"embcache_build_info", "process_resident_memory_bytes"} <= names
    rpc = exported["families"]["embcache_rpc_duration_seconds"]
    transports = {s.labels.get("transport") for s in rpc.samples if s.name.endswith("_count")}
    assert {"grpc", "lane", "http"} <= transports  # put and miss on the lane, exists on gRPC
    # Two hits, one of them a table read (counted among the table's reads as well).
    hits = exported["families"]["embcache_hits"]
    assert [s.value for s in hits.samples if s.name == "embcache_hits_total"] == [2.0]
    assert exported["stats"]["read_table"]["reads"] == 1
    touches = {s.labels.get("method") for s in rpc.samples if s.labels.get("transport") == "lane"}
    assert "Session.Touch" in touches, sorted(touches)
    # the gRPC server exports its IPC cache: nothing mapped by a CPU daemon
    mapped = exported["families"]["embcache_ipc_mapped_bytes"]
    assert [s.value for s in mapped.samples] == [0.0]
    assert "embcache_ipc_event_opens_total" in names


# -- the dashboard -------------------------------------------------------------------------


def _panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])  # collapsed rows keep their panels inside


@pytest.fixture(scope="module")
def dashboard(repo: Path) -> dict[str, Any]:
    return json.loads((repo / "deploy" / "grafana" / "embcache-dashboard.json").read_text())


@pytest.fixture(scope="module")
def dashboard_queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expression) for every query, the template variables' included."""
    queries = [
        (panel["title"], target["expr"])
        for panel in _panels(dashboard)
        for target in panel.get("targets", [])
    ]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            text = query["query"] if isinstance(query, dict) else query
            # label_values(metric, label) -> the metric as an expression.
            queries.append(
                (f"${variable['name']}", re.sub(r"label_values\((.*),\s*\w+\)", r"\1", text))
            )
    return queries


def test_dashboard_is_well_formed(dashboard: dict[str, Any]) -> None:
    assert dashboard["uid"] and dashboard["title"]
    ids = [p["id"] for p in _panels(dashboard)]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    for panel in _panels(dashboard):
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]


def test_dashboard_only_queries_exported_metrics(
    dashboard_queries: list[tuple[str, str]], exported: dict[str, Any]
) -> None:
    for title, expr in dashboard_queries:
        used = promql_metric_names(expr)
        assert used, f"{title}: no metric in {expr!r}"
        unknown = used - exported["names"]
        assert not unknown, f"{title}: {sorted(unknown)} not exported by the daemon"


def test_dashboard_covers_what_operators_watch(dashboard_queries: list[tuple[str, str]]) -> None:
    exprs = [expr for _, expr in dashboard_queries]
    used = set().union(*(promql_metric_names(e) for e in exprs))
    required = {
        "embcache_pool_used_bytes",  # occupancy per tier
        "embcache_pool_capacity_bytes",
        "embcache_hits_total",  # hit rate
        "embcache_misses_total",
        "embcache_evictions_total",
        "embcache_leases_active",
        "embcache_copy_bytes_total",  # copy bandwidth
        "embcache_copy_bandwidth_bytes_per_second_bucket",
        "embcache_rpc_duration_seconds_bucket",  # latency percentiles
    }
    assert required <= used, sorted(required - used)
    assert any(
        "embcache_pool_used_bytes" in e and re.search(r"by \([^)]*\btier\b", e) for e in exprs
    ), "occupancy split per tier"
    quantiles = {
        float(q)
        for e in exprs
        if "embcache_rpc_duration_seconds_bucket" in e
        for q in re.findall(r"histogram_quantile\(\s*([\d.]+)", e)
    }
    assert {0.5, 0.95, 0.99} <= quantiles
    # Percentiles aggregate buckets by `le`, or histogram_quantile gets nonsense.
    for e in exprs:
        if "histogram_quantile" in e:
            assert re.search(r"by \([^)]*\ble\b", e), e


# -- alert rules ---------------------------------------------------------------------------


def test_alert_rules_only_query_exported_metrics(
    repo: Path, load_yaml: Callable[[Path], list[dict[str, Any]]], exported: dict[str, Any]
) -> None:
    (rules,) = load_yaml(repo / "deploy" / "prometheus" / "embcache-rules.yaml")
    alerts = [rule for group in rules["groups"] for rule in group["rules"]]
    assert alerts
    for rule in alerts:
        assert rule["alert"] and rule["labels"]["severity"] and rule["annotations"]["summary"]
        used = promql_metric_names(rule["expr"])
        # `up` is Prometheus's own series for every target.
        unknown = used - exported["names"] - {"up"}
        assert used and not unknown, f"{rule['alert']}: {sorted(unknown)}"
