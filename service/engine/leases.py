"""Gets, leases and reading bytes of :class:`~embcache.service.engine.CacheEngine`.

A get pins each entry it finds (a reference: nothing evicts it) and hands out one lease per
entry; leases end when released, when their owner goes, or when their TTL passes (lazily
inside calls, and from the daemon's reaper through ``expire_leases``)."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Iterator, Sequence

import torch

from embcache.errors import InvalidArgument, LeaseExpired
from embcache.service.engine.state import EngineState
from embcache.service.host.entries import Entry
from embcache.service.host.leases import Lease

log = logging.getLogger("embcache.service.engine")

SHARED_TIER_OWNER = "shared-tier"  # owner of the shared tier's own leases and fills


class LeaseOps(EngineState):
    def get(
        self, keys: Sequence[str], owner: str, *, ttl_s: float | None = None
    ) -> list[Lease | None]:
        """One lease per key found (None for a miss). Leased entries are never evicted.

        With a shared tier, local misses are fetched into the host pool first.
        """
        self.fill_misses(keys)
        return self._get(keys, owner, ttl_s=ttl_s)

    def fill_misses(self, keys: Sequence[str]) -> None:
        """Ask the shared tier (if any) for keys missing here; never raises."""
        fetch = self.miss_fetcher
        if fetch is None:
            return
        with self._lock:
            missing = [k for k in keys if isinstance(k, str) and self._entries.get(k) is None]
        if not missing:
            return
        try:
            fetch(list(dict.fromkeys(missing)))
        except Exception:  # an outage of the shared tier is a miss, not an error
            log.warning("shared tier fetch failed for %d keys", len(missing), exc_info=True)

    def _get(
        self, keys: Sequence[str], owner: str, *, ttl_s: float | None = None
    ) -> list[Lease | None]:
        ttl = self._ttl(ttl_s)
        with self._lock:
            entries, now = self._pin(keys, owner)
            return self._lease_pinned(entries, owner, now + ttl)

    def _pin(self, keys: Sequence[str], owner: str) -> tuple[list[Entry | None], float]:
        """Caller holds the lock: look the keys up, count hits and misses, and pin each found
        entry (a reference, so nothing evicts it) without a lease yet; also the time now.
        A device get pins first and leases once its copy is queued (:meth:`_lease_pinned`);
        whoever pins either leases or unpins (:meth:`_unpin`)."""
        self._check_open()
        now = self._clock()
        self._expire_locked(now)
        out: list[Entry | None] = []
        counted = owner != SHARED_TIER_OWNER  # write-through reads are not client hits
        for key in keys:
            entry = self._entries.get(key) if isinstance(key, str) else None
            if entry is None:
                self._counters["misses"] += counted
                out.append(None)
                continue
            self._counters["hits"] += counted
            self._entries.acquire(entry)
            entry.last_access = now
            out.append(entry)
        return out, now

    def _lease_pinned(
        self, entries: Sequence[Entry | None], owner: str, expires_at: float
    ) -> list[Lease | None]:
        """Caller holds the lock: one lease per entry pinned by :meth:`_pin` (never fails)."""
        page, add = self.settings.page_bytes, self._leases.add
        return [None if e is None else add(e, owner, expires_at, page) for e in entries]

    def _unpin(self, entries: Sequence[Entry | None]) -> None:
        """Caller holds the lock: undo :meth:`_pin` for entries that got no lease."""
        for entry in entries:
            if entry is not None:
                self._entries.release(entry)

    def _ttl(self, ttl_s: float | None) -> float:
        if ttl_s is None:
            return self.settings.lease_ttl_s
        if not (isinstance(ttl_s, (int, float)) and math.isfinite(ttl_s) and ttl_s > 0):
            raise InvalidArgument("ttl_s must be a positive finite number", ttl_s=str(ttl_s))
        if ttl_s > self.settings.max_lease_ttl_s:
            raise InvalidArgument(
                "ttl_s is longer than max_lease_ttl_s",
                ttl_s=ttl_s,
                max_lease_ttl_s=self.settings.max_lease_ttl_s,
            )
        return float(ttl_s)

    def release(self, lease_ids: Iterable[int]) -> int:
        """End leases; unknown or already-ended ids are skipped. Returns how many ended."""
        with self._lock:
            return sum(self._end_lease(i) for i in lease_ids)

    def _end_lease(self, lease_id: int) -> bool:
        lease = self._leases.pop(lease_id)
        if lease is None:
            return False
        self._entries.release(lease.entry)
        return True

    def renew(self, lease_ids: Iterable[int], ttl_s: float | None = None) -> int:
        ttl = self._ttl(ttl_s)
        with self._lock:
            now = self._clock()
            self._expire_locked(now)
            renewed = 0
            for lease_id in lease_ids:
                lease = self._leases.get(lease_id)
                if lease is not None:
                    self._leases.renew(lease, now + ttl)
                    renewed += 1
            return renewed

    def lease_alive(self, lease: Lease) -> bool:
        with self._lock:
            return self._leases.get(lease.lease_id) is lease and lease.expires_at > self._clock()

    def drop_owner(self, owner: str) -> int:
        """A client went away: end every lease it holds."""
        with self._lock:
            return sum(self._end_lease(i) for i in self._leases.owned_by(owner))

    def expire_leases(self) -> int:
        with self._lock:
            return self._expire_locked(self._clock())

    def _expire_locked(self, now: float) -> int:
        expired = self._leases.pop_expired(now)
        for lease in expired:
            self._entries.release(lease.entry)
        self._counters["leases_expired"] += len(expired)
        return len(expired)

    # -- reading bytes -------------------------------------------------------------------
    def tensor(self, lease: Lease) -> torch.Tensor:
        """The entry as a tensor: a zero-copy view of the pool when it is one run."""
        self._require(lease)
        entry = lease.entry
        pool = self.host_pool.tensor
        if lease.contiguous:
            off = lease.byte_runs[0][0] if lease.byte_runs else 0
            flat = pool[off : off + entry.nbytes]
        else:
            flat = torch.empty(entry.nbytes, dtype=torch.uint8)
            pos = 0
            for off, length in lease.byte_runs:
                flat[pos : pos + length].copy_(pool[off : off + length])
                pos += length
            self._require(lease)  # copied while the lease lived, so no page was reused
        return flat.view(entry.dtype.torch_dtype).view(entry.shape)

    def iter_bytes(
        self, lease: Lease, offset: int = 0, length: int | None = None, chunk_bytes: int = 1 << 20
    ) -> Iterator[bytes]:
        """The entry's bytes ``[offset, offset+length)`` in chunks, copied under the lease."""
        if length is None:
            length = lease.nbytes - offset
        if offset < 0 or length < 0 or offset + length > lease.nbytes or chunk_bytes <= 0:
            raise InvalidArgument(
                "byte range outside the entry", offset=offset, length=length, nbytes=lease.nbytes
            )
        pool = self.host_pool.array
        end = offset + length
        base = 0
        for off, run_len in lease.byte_runs:
            lo, hi = max(offset, base), min(end, base + run_len)
            pos = lo
            while pos < hi:
                take = min(chunk_bytes, hi - pos)
                self._require(lease)
                data = pool[off + pos - base : off + pos - base + take].tobytes()
                self._require(lease)  # still leased after the copy: the bytes are the entry's
                yield data
                pos += take
            base += run_len

    def _require(self, lease: Lease) -> None:
        if not self.lease_alive(lease):
            raise LeaseExpired("lease has ended", lease_id=lease.lease_id, key=lease.key)
