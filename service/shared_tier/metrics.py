"""Prometheus families for the shared tier, read from one counters snapshot per scrape."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from embcache.service.observability.metrics import PREFIX
from embcache.service.shared_tier.health import TierHealth


class _Tier(Protocol):
    """What the collector reads of a ``SharedTier``."""

    health: TierHealth

    @property
    def queue_depth(self) -> int: ...


_FETCH = {
    "hit": "fetch_hits",
    "miss": "fetch_misses",
    "corrupt": "fetch_corrupt",
    "rejected": "fetch_rejected",
    "skipped_degraded": "fetch_skipped_degraded",
}
_WRITES = {
    "ok": "writes_ok",
    "failed": "write_failed",
    "skipped_evicted": "write_skipped_evicted",
    "dropped": "queue_dropped",
}


class TierCollector(Collector):
    """The ``embcache_shared_tier_*`` families of one shared tier."""

    def __init__(self, tier: _Tier) -> None:
        self._tier = tier

    def describe(self) -> Iterator[Metric]:
        return iter(self._families({}, {}, 0, False))

    def collect(self) -> Iterator[Metric]:
        t = self._tier
        return iter(
            self._families(
                t.health.counters(), t.health.error_counts(), t.queue_depth, not t.health.ok
            )
        )

    def _families(
        self, c: dict[str, int], errors: dict[str, int], depth: int, degraded: bool
    ) -> list[Metric]:
        name = f"{PREFIX}_shared_tier"
        fetch = CounterMetricFamily(
            f"{name}_fetch_keys", "Keys looked up in the shared tier, by result.", labels=["result"]
        )
        for label, key in _FETCH.items():
            fetch.add_metric([label], c.get(key, 0))
        writes = CounterMetricFamily(
            f"{name}_writes", "Entries written through, by result.", labels=["result"]
        )
        for label, key in _WRITES.items():
            writes.add_metric([label], c.get(key, 0))
        errs = CounterMetricFamily(
            f"{name}_errors", "Failed shared-tier operations, by operation.", labels=["op"]
        )
        for op in ("connect", "ping", "fetch", "exists", "write", "delete"):
            errs.add_metric([op], errors.get(op, 0))

        def counter(suffix: str, doc: str, key: str) -> CounterMetricFamily:
            return CounterMetricFamily(f"{name}_{suffix}", doc, value=c.get(key, 0))

        return [
            fetch,
            writes,
            errs,
            counter("fetch_bytes", "Bytes filled from the shared tier.", "fetch_bytes"),
            counter("write_bytes", "Bytes written through.", "write_bytes"),
            counter("write_retries", "Write-through batch retries.", "write_retries"),
            counter("queue_full", "Puts that found the write-through queue full.", "queue_full"),
            counter("ack_timeouts", "Sync acks that gave up waiting.", "ack_timeouts"),
            counter("outages", "Times the shared tier went degraded.", "outages"),
            counter("prefetch_keys", "Keys asked for by Prefetch.", "prefetch_keys"),
            GaugeMetricFamily(f"{name}_queue_depth", "Entries waiting for write-through.", depth),
            GaugeMetricFamily(
                f"{name}_degraded", "1 while the shared tier is unreachable.", float(degraded)
            ),
        ]
