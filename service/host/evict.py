"""The outcomes of evictions by key, and their typed errors (the host store evicts)."""

from __future__ import annotations

import enum
from collections.abc import Iterable

from embcache.errors import EntryLeased, NotFound


class EvictOutcome(enum.Enum):
    """What an eviction did to one key (leased entries are never forced)."""

    EVICTED = "evicted"
    NOT_FOUND = "not_found"
    LEASED = "leased"


class EvictResults(list[EvictOutcome]):
    """The outcome of each key, in key order (a list), and ``freed_bytes``: the pool memory
    the evictions made free, in whole pages (what an eviction by bytes counts too)."""

    def __init__(self, outcomes: Iterable[EvictOutcome], freed_bytes: int) -> None:
        super().__init__(outcomes)
        self.freed_bytes = freed_bytes


def raise_for_evict(key: str, outcome: EvictOutcome, *, device: int | None = None) -> None:
    """The typed error of one key's eviction outcome (none when evicted); ``device``: the
    eviction was of that device pool's copies only."""
    if outcome is EvictOutcome.NOT_FOUND and device is not None:
        raise NotFound("no such entry, or no copy in that device pool", key=key, device=device)
    if outcome is EvictOutcome.NOT_FOUND:
        raise NotFound("no such entry", key=key)
    if outcome is EvictOutcome.LEASED:
        raise EntryLeased("entry is leased; it is evicted only once released", key=key)
