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
    "misses",  # lookups that found nothing (or failed): vLLM encodes the item itself
    "mismatches",  # entries found with the wrong rows, width or dtype (counted as misses)
    "lookup_errors",  # lookups answered as misses because a call failed or the breaker is open
    "breaker_trips",  # times the daemon was judged unwell (every lookup a miss meanwhile)
    "deferred",  # times a request waited a step for a lookup, a staging or an announced save
    "gave_up",  # items that waited past defer_limit_s and were encoded instead
    "namespace_mismatches",  # announced items saved under another namespace
    "staged",  # items loaded onto a worker ahead of their step
    "stage_failures",  # stagings that failed (the item is encoded instead; nothing is wrong)
    "loads",  # staged items handed to the encoder cache
    "load_bytes",
    "load_failures",  # an item scheduled from embcache that was not there (request failed)
    "saves",  # items stored by a producer
    "save_bytes",
    "save_failures",
    "saves_dropped",  # saves refused because max_pending_saves were already queued
)


@dataclass(frozen=True, slots=True)
class StageSpec:
    """One item a worker loads ahead of the step that uses it (kept apart until then)."""

    key: str  # the embcache key (names the staged tensor on the worker)
    dtype: str  # the model's dtype, as torch names it ("bfloat16")
    shape: tuple[int, ...]  # the entry's shape as pinned, or (rows, -1) where not known


@dataclass(frozen=True, slots=True)
class UseSpec:
    """A staged item this step's requests read: it goes into the encoder cache."""

    identifier: str  # vLLM's mm_features[i].identifier: the encoder-cache key
    key: str
    request_ids: tuple[str, ...]


@dataclass
class EmbCacheConnectorMetadata(ECConnectorMetadata):
    """Scheduler to workers: what to stage, use and drop this step, and under which key
    scopes (cache salts) each item this step encodes is saved."""

    stage: list[StageSpec] = field(default_factory=list)
    use: list[UseSpec] = field(default_factory=list)
    drop: list[str] = field(default_factory=list)
    save_scopes: dict[str, tuple[str, ...]] = field(default_factory=dict)


@dataclass
class EmbCacheWorkerMetadata(ECConnectorWorkerMetadata):
    """Workers to scheduler: keys staged and failed (key: reason), identifiers used and
    not found (identifier: reason), the counts."""

    staged: set[str] = field(default_factory=set)
    failed: dict[str, str] = field(default_factory=dict)
    used: set[str] = field(default_factory=set)
    use_failed: dict[str, str] = field(default_factory=dict)
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
        use_failed = {**self.use_failed, **other.use_failed}
        return EmbCacheWorkerMetadata(
            staged=(self.staged | other.staged) - set(failed),
            failed=failed,
            used=(self.used | other.used) - set(use_failed),
            use_failed=use_failed,
            stats=add_counts(self.stats, other.stats),
        )


def add_counts(a: dict[str, Any], b: dict[str, Any]) -> dict[str, int]:
    """The per-name sum of two count dicts."""
    return {k: int(a.get(k, 0)) + int(b.get(k, 0)) for k in {*a, *b}}
