"""Listings of entries that never hold the engine's lock for a whole scan.

The lock is what every put and get waits for, and building the infos of many thousands of
entries under it stalled the data plane. A listing instead:

1. takes a snapshot of the entries under the lock: one copy of the tables' values (O(n),
   but a C loop of pointer copies, under a millisecond per 100,000 entries);
2. filters it (``leased``, a tier) in slices of :data:`SLICE` entries, taking the lock for
   each slice;
3. sorts it without the lock, by fields that never change (key, size) or that a get sets
   in one step (``last_access``: the order is that of one moment);
4. builds the infos of the page asked for only, again a slice per lock.

Entries that left between the snapshot and a slice (evicted, or a put that aborted) are
left out, so a page may hold fewer items than ``limit`` and ``total`` is that of the
snapshot: a listing is a view of one moment, as it always was.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from embcache.errors import InvalidArgument
from embcache.service.device.tier import DeviceTier
from embcache.service.engine.gate import Gate
from embcache.service.engine.stats import EntryInfo, entry_info
from embcache.service.host.entries import Entry, EntryState
from embcache.service.host.store import HostStore

SLICE = 512  # entries handled per hold of the lock


@dataclass(frozen=True, slots=True)
class Query:
    """What a listing asks for: ``entries[offset:offset+limit]`` of those that match,
    ordered by ``sort`` (``none``: READY in insertion order, then FILLING)."""

    offset: int = 0
    limit: int = 100
    state: str | None = None  # ready, filling; leased: READY ones with a lease
    tier: str | None = None  # host or device: entries with a copy there
    sort: str = "none"  # size: largest first; recent: most recently used first; idle: least

    def check(self) -> Query:
        """This query, or InvalidArgument naming the field that is wrong."""
        if self.state not in (None, "ready", "filling", "leased"):
            raise InvalidArgument("state must be ready, filling or leased", state=self.state)
        if self.tier not in (None, "host", "device"):
            raise InvalidArgument("tier must be host or device", tier=self.tier)
        if self.sort not in ("none", "size", "recent", "idle"):
            raise InvalidArgument("sort must be none, size, recent or idle", sort=self.sort)
        return self


def list_entries(
    gate: Gate,
    store: HostStore,
    tier: DeviceTier,
    clock: Callable[[], float],
    query: Query,
) -> tuple[int, list[EntryInfo]]:
    """``(total, infos of the page)`` for ``query`` (module docstring)."""
    query.check()
    with gate:
        entries = store.snapshot("ready" if query.state == "leased" else query.state)
    if query.state == "leased" or query.tier is not None:
        entries = _filtered(gate, tier, entries, query)
    if query.sort == "size":
        entries.sort(key=lambda e: (-e.nbytes, e.key))
    elif query.sort in ("recent", "idle"):
        entries.sort(key=lambda e: (-e.last_access, e.key), reverse=query.sort == "idle")
    start = max(query.offset, 0)
    page = entries[start : start + max(query.limit, 0)]
    infos: list[EntryInfo] = []
    for chunk in _slices(page):
        with gate:
            now = clock()
            infos.extend(entry_info(e, tier, now) for e in chunk if e.state is not EntryState.FREED)
    return len(entries), infos


def entry_detail(store: HostStore, tier: DeviceTier, now: float, key: str) -> EntryInfo | None:
    """One READY entry with its lease holders (the caller holds the lock)."""
    entry = store.peek(key)
    if entry is None:
        return None
    return entry_info(entry, tier, now, store.leases.holders(entry, now))


def _filtered(gate: Gate, tier: DeviceTier, entries: list[Entry], query: Query) -> list[Entry]:
    """The entries that match ``query``'s ``leased`` state and tier, a slice per lock."""
    kept: list[Entry] = []
    for chunk in _slices(entries):
        with gate:
            for e in chunk:
                if e.state is EntryState.FREED or (query.state == "leased" and not e.ref_cnt):
                    continue
                if query.tier is not None and not _on_tier(tier.residency(e), query.tier):
                    continue
                kept.append(e)
    return kept


def _on_tier(residency: Sequence[str], wanted: str) -> bool:
    if wanted == "host":
        return "host" in residency
    return any(r != "host" for r in residency)


def _slices(entries: list[Entry]) -> Iterator[list[Entry]]:
    for i in range(0, len(entries), SLICE):
        yield entries[i : i + SLICE]
