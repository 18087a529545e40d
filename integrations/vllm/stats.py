"""Connector statistics in vLLM's forms: ``ECConnectorStats`` for the periodic log line
and ``ECConnectorPromMetrics`` for Prometheus counters (``vllm:embcache_<name>``).

vLLM (0.33 and 0.34) collects connector stats only from the scheduler-side instance; the workers'
counts reach it inside the worker metadata (``metadata.py``), so one object carries the
whole engine's hits, misses, loads and saves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.ec_transfer.ec_connector.metrics import (
    ECConnectorPromMetrics,
    ECConnectorStats,
)

from embcache.integrations.vllm.metadata import STAT_NAMES, add_counts


@dataclass
class EmbCacheECStats(ECConnectorStats):
    """Counts of one interval (``data``: name -> count)."""

    def reset(self) -> None:
        """Zero every count."""
        self.data = {}

    def aggregate(self, other: ECConnectorStats) -> ECConnectorStats:
        """Add ``other``'s counts to these (in place); returns self."""
        self.data = add_counts(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        """The interval's counts, every known name present."""
        return {name: int(self.data.get(name, 0)) for name in STAT_NAMES}

    def is_empty(self) -> bool:
        """True when nothing was counted."""
        return not any(self.data.values())


class EmbCachePromMetrics(ECConnectorPromMetrics):
    """One Prometheus counter per statistic, labelled per engine like vLLM's own."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for name in STAT_NAMES:
            counter = self._counter_cls(
                name=f"vllm:embcache_{name}",
                documentation=f"embcache EC connector: {name.replace('_', ' ')}",
                labelnames=labelnames,
            )
            self._counters[name] = {
                idx: counter.labels(*values) for idx, values in per_engine_labelvalues.items()
            }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Add one report's counts to the counters of ``engine_idx``."""
        for name, value in transfer_stats_data.items():
            per_engine = self._counters.get(name)
            if per_engine is not None and value and engine_idx in per_engine:
                per_engine[engine_idx].inc(value)
