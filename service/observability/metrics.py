"""Prometheus metrics: a collector over ``engine.stats()`` plus histograms transports feed.

Gauges and counters that the engine already keeps are read at scrape time (one
``engine.stats()`` call per scrape), so nothing is double-booked and a scrape always sees
one consistent snapshot. Latency and bandwidth are distributions only the callers can
time, so transports feed them through :meth:`Metrics.observe_rpc` and
:meth:`Metrics.observe_copy`. Every metric lives in the instance's own registry; no keys
ever appear in labels.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterator
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from embcache import build_info

PREFIX = "embcache"

# RPCs range from a sub-millisecond exists() to multi-second streams of large entries.
RPC_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
# Bytes per second, from 1e7 (a small copy held up by its overheads) to 8e10, more than a
# PCIe Gen5 x16 link carries.
BANDWIDTH_BUCKETS = tuple(
    float(x) * 1e9
    for x in (
        0.01,
        0.05,
        0.1,
        0.25,
        0.5,
        1,
        2,
        5,
        10,
        20,
        30,
        40,
        50,
        60,
        80,
    )
)


# The calls that move or look up entries (puts, gets, reads, releases, evictions), as the
# pool-map page counts operations: not the page's own polling, probes or listings, and not
# a session stream's lifetime (its calls count one by one).
_OPERATIONS = frozenset(
    {"put", "putfromdevice", "putfromdevicebatch", "putbatch", "putreserve", "putcommit",
     "putabort", "get", "getinto", "getbytes", "release", "renew", "exists", "evict",
     "prefetch"}
)  # fmt: skip
_HTTP_OPERATIONS = frozenset(
    {"PUT /v1/entries/{key:path}", "GET /v1/entries/{key:path}/data",
     "DELETE /v1/entries/{key:path}", "POST /v1/get", "POST /v1/release", "POST /v1/renew",
     "POST /v1/evict", "POST /v1/prefetch"}
)  # fmt: skip


def is_operation(transport: str, method: str) -> bool:
    """Whether a finished call is a data operation (see ``_OPERATIONS``)."""
    if transport == "http":
        return method in _HTTP_OPERATIONS
    name = method.rsplit(".", 1)[-1].replace("_", "").lower()  # "Session.get", "PutFromDevice"
    return name in _OPERATIONS


class _StatsSource(Protocol):
    def stats(self) -> Any: ...


class EngineCollector(Collector):
    """Reads one stats snapshot per scrape and turns it into metric families."""

    def __init__(self, engine: _StatsSource, metrics: Metrics) -> None:
        self._engine = engine
        self._metrics = metrics

    def describe(self) -> Iterator[Metric]:
        # Names only: lets the registry catch clashes without calling the engine.
        return iter(self._families())

    def collect(self) -> Iterator[Metric]:
        families = self._families()
        self._fill(families, self._engine.stats())
        return iter(families)

    @staticmethod
    def _families() -> list[Metric]:
        def gauge(name: str, doc: str, labels: list[str] | None = None) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=labels)

        def counter(name: str, doc: str, labels: list[str] | None = None) -> CounterMetricFamily:
            return CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=labels)

        return [
            gauge("pool_capacity_bytes", "Pool size in bytes.", ["tier", "device"]),
            gauge(
                "pool_used_bytes",
                "Bytes of the pool held by entries or reservations.",
                ["tier", "device"],
            ),
            gauge(
                "pool_pages",
                "Pages of the pool by state (used or free).",
                ["tier", "device", "state"],
            ),
            gauge("pool_largest_free_run_pages", "Longest run of free pages.", ["tier", "device"]),
            gauge(
                "pool_free_runs", "Number of free page runs (fragmentation).", ["tier", "device"]
            ),
            gauge(
                "pool_in_service",
                "1 while the pool serves; 0 once a device error took it out.",
                ["tier", "device"],
            ),
            gauge("entries", "Entries by state.", ["state"]),
            gauge("entries_by_runs", "READY entries by number of page runs.", ["runs"]),
            gauge("reserved_filling_bytes", "Bytes reserved by puts still filling."),
            gauge(
                "put_landing_bytes",
                "Host pool bytes set aside for puts from a device (counted as free).",
            ),
            gauge("leases_active", "Leases currently held."),
            gauge(
                "quarantined_bytes",
                "Pages held for live processes: views of leases that ended by force, and "
                "reserved pages a client may still be writing.",
            ),
            gauge("lease_owners", "Distinct owners holding leases."),
            gauge("draining", "1 while the daemon drains for shutdown."),
            counter("hits", "Keys found by get."),
            counter("misses", "Keys not found by get."),
            counter("evictions", "Entries evicted (LRU or explicit)."),
            counter("evicted_bytes", "Bytes freed by evictions."),
            counter("puts", "Puts by outcome.", ["outcome"]),
            counter("put_bytes", "Bytes committed by puts."),
            counter("hit_bytes", "Bytes of the entries hits handed out (host bytes out)."),
            counter("leases_expired", "Leases ended by their TTL."),
            counter("copy_bytes", "Bytes copied, by direction.", ["direction"]),
            gauge("restart_adopted_entries", "Entries adopted at a warm restart."),
            gauge("restart_adopted_bytes", "Bytes of the entries adopted at a warm restart."),
            gauge("restart_unverified_entries", "Adopted entries not checked yet."),
            gauge(
                "restart_dropped_entries",
                "Entries a warm restart dropped, by reason (checksum, layout, invalid, refused:"
                " a record a put would refuse).",
                ["reason"],
            ),
            gauge("restart_dropped_bytes", "Bytes a warm restart dropped.", ["reason"]),
        ]

    def _fill(self, families: list[Metric], s: Any) -> None:
        by_name = {f.name: f for f in families}

        def add(name: str, labels: list[str], value: float) -> None:
            by_name[f"{PREFIX}_{name}"].add_metric(labels, value)  # type: ignore[attr-defined]

        pools = [(s.host, "")] + [(p, str(i)) for i, p in enumerate(s.device)]
        for pool, device in pools:
            # Device pools name themselves "device:<index>"; the label splits that in two.
            name, _, index = pool.tier.partition(":")
            tier = [name, index or device]
            add("pool_capacity_bytes", tier, pool.capacity_bytes)
            add("pool_used_bytes", tier, pool.used_bytes)
            add("pool_pages", [*tier, "used"], pool.used_pages)
            add("pool_pages", [*tier, "free"], pool.free_pages)
            add("pool_largest_free_run_pages", tier, pool.largest_free_run_pages)
            add("pool_free_runs", tier, pool.free_runs)
            add("pool_in_service", tier, 0.0 if pool.out_of_service else 1.0)
        add("entries", ["ready"], s.entries_ready)
        add("entries", ["filling"], s.entries_filling)
        for bucket, count in sorted(s.runs_per_entry.items()):
            add("entries_by_runs", [bucket], count)
        add("reserved_filling_bytes", [], s.reserved_filling_bytes)
        add("put_landing_bytes", [], s.put_landing_bytes)
        add("leases_active", [], s.leases_active)
        add("quarantined_bytes", [], s.quarantined_bytes)
        add("lease_owners", [], s.lease_owners)
        add("draining", [], 1.0 if s.draining else 0.0)
        add("hits", [], s.hits)
        add("misses", [], s.misses)
        add("evictions", [], s.evictions)
        add("evicted_bytes", [], s.evicted_bytes)
        add("puts", ["committed"], s.puts_committed)
        add("puts", ["aborted"], s.puts_aborted)
        add("put_bytes", [], s.put_bytes)
        add("hit_bytes", [], s.hit_bytes)
        add("leases_expired", [], s.leases_expired)
        for direction, nbytes in sorted(self._metrics.copied_bytes(s).items()):
            add("copy_bytes", [direction], nbytes)
        r = s.restart
        add("restart_adopted_entries", [], r.get("adopted_entries", 0))
        add("restart_adopted_bytes", [], r.get("adopted_bytes", 0))
        add("restart_unverified_entries", [], r.get("unverified_entries", 0))
        for reason in ("checksum", "layout", "invalid", "refused"):
            add("restart_dropped_entries", [reason], r.get(f"dropped_{reason}_entries", 0))
        for reason in ("checksum", "layout"):
            add("restart_dropped_bytes", [reason], r.get(f"dropped_{reason}_bytes", 0))


class _IpcSource(Protocol):
    def stats(self) -> Any: ...


class IpcCollector(Collector):
    """Client GPU memory the daemon holds open through CUDA IPC (``device/ipc/cache.py``):
    an open mapping keeps a client's allocation alive after the client frees it."""

    def __init__(self, cache: _IpcSource) -> None:
        self._cache = cache

    def describe(self) -> Iterator[Metric]:
        return iter(self._families())

    def collect(self) -> Iterator[Metric]:
        families = self._families()
        s = self._cache.stats()
        for family, value in zip(
            families,
            (s.mappings, s.mapped_bytes, s.opens, s.closes, s.events, s.event_opens),
            strict=True,
        ):
            family.add_metric([], value)
        return iter(families)

    @staticmethod
    def _families() -> list[GaugeMetricFamily | CounterMetricFamily]:
        return [
            GaugeMetricFamily(f"{PREFIX}_ipc_mappings", "Client GPU allocations open now."),
            GaugeMetricFamily(
                f"{PREFIX}_ipc_mapped_bytes",
                "Bytes of the client GPU allocations open now (kept alive while open).",
            ),
            CounterMetricFamily(f"{PREFIX}_ipc_opens", "Client GPU allocations opened."),
            CounterMetricFamily(f"{PREFIX}_ipc_closes", "Client GPU allocations closed."),
            GaugeMetricFamily(f"{PREFIX}_ipc_events", "Client events kept open for sessions."),
            CounterMetricFamily(
                f"{PREFIX}_ipc_event_opens",
                "Client events opened (clients that reuse their events open few).",
            ),
        ]


class Metrics:
    """All daemon metrics, in one registry of their own.

    Give :meth:`observe_copy` to the engine (``CacheEngine(copy_observer=...)``) so every
    timed copy lands in the bandwidth histogram. ``embcache_copy_bytes_total`` comes from
    the engine's counters (``stats().bytes_copied``); bytes passed to :meth:`observe_copy`
    count there only for directions the engine does not count itself, so no copy is counted
    twice.
    """

    def __init__(self, engine: _StatsSource | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        # The standard process_* metrics (CPU seconds, resident memory, open fds, start
        # time) and which build is running, as Prometheus exporters conventionally do.
        ProcessCollector(registry=self.registry)
        Gauge(
            f"{PREFIX}_build_info",
            "Always 1; the labels say which build runs.",
            ["version", "commit"],
            registry=self.registry,
        ).labels(build_info.version(), build_info.git_commit()).set(1)
        self._lock = threading.Lock()
        self._observed_copy: dict[str, float] = {}
        self._operations = [0] * (len(RPC_BUCKETS) + 1)
        self.rpc_duration = Histogram(
            f"{PREFIX}_rpc_duration_seconds",
            "Time to serve one RPC or HTTP request, by transport, method and result code.",
            ["transport", "method", "code"],
            buckets=RPC_BUCKETS,
            registry=self.registry,
        )
        self.copy_bandwidth = Histogram(
            f"{PREFIX}_copy_bandwidth_bytes_per_second",
            "Bandwidth of individual copies, by direction.",
            ["direction"],
            buckets=BANDWIDTH_BUCKETS,
            registry=self.registry,
        )
        self.session_refusals = Counter(
            f"{PREFIX}_session_socket_refusals",
            "Session-socket connections refused or closed before their session opened, by "
            "listener (unix, tcp) and reason (connections: over max_session_connections; "
            "hello_timeout; hello_too_large; unauthenticated; bad_hello).",
            ["listener", "reason"],
            registry=self.registry,
        )
        self.touches_dropped = Counter(
            f"{PREFIX}_touches_dropped",
            "Touches (read-table hits a session reports) dropped because the session sent "
            "more keys than max_touch_keys_per_s.",
            registry=self.registry,
        )
        if engine is not None:
            self.watch_engine(engine)

    def watch_engine(self, engine: _StatsSource) -> None:
        """Export the engine's stats (read once per scrape). The engine reports its copies
        through :meth:`observe_copy`, which it is given at construction."""
        self.registry.register(EngineCollector(engine, self))

    def watch_ipc(self, cache: _IpcSource) -> None:
        """Export the IPC cache's gauges and counters (once per registry)."""
        self.registry.register(IpcCollector(cache))

    def observe_rpc(self, transport: str, method: str, code: str, seconds: float) -> None:
        """One finished call. ``method`` is a route template or RPC name, never a key."""
        self.rpc_duration.labels(transport, method, str(code)).observe(max(seconds, 0.0))
        if is_operation(transport, method):
            slot = bisect.bisect_left(RPC_BUCKETS, seconds)  # le: the first bound >= seconds
            with self._lock:
                self._operations[slot] += 1

    def operation_buckets(self) -> tuple[int, ...]:
        """Cumulative calls of the data operations (:func:`is_operation`) per latency bucket
        of ``RPC_BUCKETS`` (one more for +Inf); the pool-map page turns them into rates and
        quantiles."""
        with self._lock:
            return tuple(self._operations)

    def observe_refusal(self, listener: str, reason: str) -> None:
        """A session-socket connection refused or closed before its session opened."""
        self.session_refusals.labels(listener, reason).inc()

    def observe_dropped_touch(self) -> None:
        """A session's touch dropped by its rate limit."""
        self.touches_dropped.inc()

    def observe_copy(self, direction: str, nbytes: int, seconds: float) -> None:
        """One finished copy of ``nbytes`` in ``direction`` that took ``seconds``."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        with self._lock:
            self._observed_copy[direction] = self._observed_copy.get(direction, 0.0) + nbytes
        if seconds > 0 and nbytes > 0:
            self.copy_bandwidth.labels(direction).observe(nbytes / seconds)

    def copied_bytes(self, stats: Any) -> dict[str, float]:
        """Cumulative bytes per direction: the engine's counters, else observed copies."""
        with self._lock:
            total = dict(self._observed_copy)
        total.update({d: float(n) for d, n in stats.bytes_copied.items()})
        return total
