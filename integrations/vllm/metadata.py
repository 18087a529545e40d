"""What the connector's two halves tell each other each step, and the counts they keep.

Both travel between processes (scheduler to workers and back, workers to the stats
logger), so each is a plain dataclass of strings, numbers and tuples that pickles and
msgpack-encodes without help.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorMetadata,
    ECConnectorWorkerMetadata,
)

# Counters both halves keep; the scheduler reports their sum (its own and its workers').
STAT_NAMES = (
    "hits",  # lookups that found a usable entry
    "misses",  # lookups that found nothing
    "mismatches",  # entries found with the wrong rows, width or dtype (counted as misses)
    "loads",  # items loaded into the worker's encoder cache
    "load_bytes",
    "load_failures",  # loads that failed on the worker (the request is failed, retryable)
    "saves",  # items stored by a producer
    "save_bytes",
    "save_failures",
    "saves_dropped",  # saves refused because max_pending_saves were already queued
)


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """One item a worker loads this step."""

    identifier: str  # vLLM's mm_features[i].identifier: the encoder-cache key
    key: str  # the embcache key
    rows: int  # request.get_num_encoder_embeds(index)
    dtype: str  # the model's dtype, as torch names it ("bfloat16")
    # The entry's shape when the scheduler saw it (pinned); None: the worker checks it.
    shape: tuple[int, ...] | None
    request_ids: tuple[str, ...]
    # False: the scheduler already knows it cannot be had (a placeholder keeps the step
    # running; the requests are failed).
    available: bool = True
    fallback_width: int = 0  # placeholder width where the shape is not known


@dataclass
class EmbCacheConnectorMetadata(ECConnectorMetadata):
    """Scheduler to workers: the loads of this step."""

    loads: list[LoadSpec] = field(default_factory=list)


@dataclass
class EmbCacheWorkerMetadata(ECConnectorWorkerMetadata):
    """Workers to scheduler: what loaded, what failed (identifier: reason), the counts."""

    loaded: set[str] = field(default_factory=set)
    failed: dict[str, str] = field(default_factory=dict)
    stats: dict[str, int] = field(default_factory=dict)

    def aggregate(self, other: ECConnectorWorkerMetadata) -> ECConnectorWorkerMetadata:
        """Combine two ranks' reports: an item failed if it failed on any rank.

        Args:
            other: another rank's report of the same step.

        Returns:
            A new report; neither input is changed.

        Raises:
            TypeError: ``other`` is not an embcache report.
        """
        if not isinstance(other, EmbCacheWorkerMetadata):
            raise TypeError(f"cannot aggregate {type(other).__name__} into embcache metadata")
        failed = {**self.failed, **other.failed}
        return EmbCacheWorkerMetadata(
            loaded=(self.loaded | other.loaded) - set(failed),
            failed=failed,
            stats=add_counts(self.stats, other.stats),
        )


def add_counts(a: dict[str, Any], b: dict[str, Any]) -> dict[str, int]:
    """The per-name sum of two count dicts."""
    return {k: int(a.get(k, 0)) + int(b.get(k, 0)) for k in {*a, *b}}
