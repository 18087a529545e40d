"""Exists and eviction of :class:`~embcache.service.engine.CacheEngine`: never of a
leased entry; by key (host and device copies, or one device pool's copies only) or by bytes
(LRU)."""

from __future__ import annotations

import enum
import logging
from collections.abc import Sequence

from embcache.errors import EntryLeased, InvalidArgument, NotFound
from embcache.service.engine.state import EngineState
from embcache.service.host.entries import Entry
from embcache.service.host.stats import run_bucket

log = logging.getLogger("embcache.service.engine")


class EvictOutcome(enum.Enum):
    EVICTED = "evicted"
    NOT_FOUND = "not_found"
    LEASED = "leased"


def raise_for_evict(key: str, outcome: EvictOutcome, *, device: int | None = None) -> None:
    """The typed error of one key's eviction outcome (none when evicted); ``device``: the
    eviction was of that device pool's copies only."""
    if outcome is EvictOutcome.NOT_FOUND and device is not None:
        raise NotFound("no such entry, or no copy in that device pool", key=key, device=device)
    if outcome is EvictOutcome.NOT_FOUND:
        raise NotFound("no such entry", key=key)
    if outcome is EvictOutcome.LEASED:
        raise EntryLeased("entry is leased; it is evicted only once released", key=key)


class EvictOps(EngineState):
    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key can be served; with a shared tier, local misses ask it too."""
        with self._lock:
            out = [isinstance(k, str) and self._entries.get(k) is not None for k in keys]
        remote = self.remote_exists
        if remote is not None and not all(out):
            idx = [i for i, hit in enumerate(out) if not hit and isinstance(keys[i], str)]
            try:
                for i, hit in zip(idx, remote([keys[i] for i in idx]), strict=True):
                    out[i] = bool(hit)
            except Exception:  # an outage of the shared tier: answer from the local tiers
                log.warning("shared tier exists failed", exc_info=True)
        return out

    def evict(self, keys: Sequence[str]) -> list[EvictOutcome]:
        """Evict each key unless it is leased (never forced)."""
        with self._lock:
            out = self._evictable(keys)
            for _, entry in out:
                if entry is not None:
                    self._evict_locked(entry)
            return [outcome for outcome, _ in out]

    def evict_device(self, keys: Sequence[str], device: int) -> list[EvictOutcome]:
        """Drop each key's copy in device pool ``device``; its host copy stays. NOT_FOUND:
        no such entry, or no copy there; LEASED: refused (never forced)."""
        with self._lock:
            out = self._evictable(keys)
            todo = [entry for _, entry in out if entry is not None]
            had = iter(self.device_tier.evict_copies(todo, device))
            return [
                EvictOutcome.NOT_FOUND if entry is not None and not next(had) else outcome
                for outcome, entry in out
            ]

    def _evictable(self, keys: Sequence[str]) -> list[tuple[EvictOutcome, Entry | None]]:
        """Each key's outcome, with its entry when it may go (EVICTED); a key named again is
        NOT_FOUND the second time (gone by then). Caller holds the lock."""
        self._expire_locked(self._clock())
        out: list[tuple[EvictOutcome, Entry | None]] = []
        seen: set[int] = set()
        for key in keys:
            entry = self._entries.get(key) if isinstance(key, str) else None
            if entry is None or id(entry) in seen:
                out.append((EvictOutcome.NOT_FOUND, None))
            elif entry.ref_cnt:
                out.append((EvictOutcome.LEASED, None))
            else:
                seen.add(id(entry))
                out.append((EvictOutcome.EVICTED, entry))
        return out

    def evict_device_bytes(self, device: int, nbytes: int) -> tuple[int, int]:
        """Free ``nbytes`` of device pool ``device`` by LRU over its unleased copies (host
        copies stay): (entries, bytes of pages freed)."""
        if nbytes < 0:
            raise InvalidArgument("nbytes must be >= 0", nbytes=nbytes)
        with self._lock:
            self._expire_locked(self._clock())
            return self.device_tier.evict_pool_bytes(device, nbytes)

    def evict_one(self, key: str) -> None:
        raise_for_evict(key, self.evict([key])[0])

    def evict_bytes(self, nbytes: int) -> tuple[int, int]:
        """Evict LRU entries until ``nbytes`` are freed or none is left. (entries, bytes)."""
        if nbytes < 0:
            raise InvalidArgument("nbytes must be >= 0", nbytes=nbytes)
        with self._lock:
            self._expire_locked(self._clock())
            count = freed = 0
            while freed < nbytes and (victim := self._entries.lru_oldest()) is not None:
                freed += victim.num_pages * self.settings.page_bytes
                self._evict_locked(victim)
                count += 1
            return count, freed

    def _evict_locked(self, entry: Entry) -> None:
        self.device_tier.drop(entry)
        self._entries.remove(entry)
        self._alloc.free(entry.runs)
        self._runs_hist[run_bucket(len(entry.runs))] -= 1
        self._counters["evictions"] += 1
        self._counters["evicted_bytes"] += entry.nbytes
