"""CacheEngine: the one API every transport uses (see docs/design.md).

One lock guards the tables; byte copies run outside it (a FILLING reservation has one
writer, a leased entry is never freed). Leases expire lazily inside calls and from the
daemon's reaper via :meth:`expire_leases`.
"""

from __future__ import annotations

import enum
import itertools
import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from . import admission, introspection
from .allocator import PageRunAllocator
from .config import Settings
from .device_pool import DevicePool
from .device_tier import CopyObserver, DeviceLease, DeviceTier, PendingGet
from .dtypes import from_torch
from .entries import Entry, EntryState, EntryTable
from .errors import (
    Draining,
    EntryLeased,
    InvalidArgument,
    LeaseExpired,
    MetadataConflict,
    NotFound,
    PoolExhausted,
    QuotaExceeded,
)
from .fill import PutHandle
from .host_pool import HostPool
from .leases import Lease, LeaseTable
from .stats import EngineStats, EntryInfo, run_bucket

log = logging.getLogger(__name__)


class EvictOutcome(enum.Enum):
    EVICTED = "evicted"
    NOT_FOUND = "not_found"
    LEASED = "leased"


SHARED_TIER_OWNER = "shared-tier"  # owner of the shared tier's own leases and fills


def default_device_pools(settings: Settings) -> list[DevicePool]:
    """One device pool per served GPU when a device pool size is set and CUDA is used."""
    if settings.device_pool_bytes == 0 or not cuda_wanted(settings):
        return []
    gpus = settings.gpu_indices(torch.cuda.device_count())
    pools: list[DevicePool] = []
    try:
        for index, gpu in enumerate(gpus):
            pools.append(
                DevicePool(
                    torch.device("cuda", gpu),
                    settings.device_pool_bytes,
                    settings.device_page_bytes,
                    ipc_mode=settings.ipc_mode,
                    index=index,
                    peers=[g for g in gpus if g != gpu],
                )
            )
    except BaseException:
        for pool in pools:
            pool.close()
        raise
    return pools


def cuda_wanted(settings: Settings) -> bool:
    if settings.device == "cpu":
        return False
    available = torch.cuda.is_available()
    if settings.device == "cuda" and not available:
        raise RuntimeError("device=cuda but no CUDA device is available")
    return available


def raise_for_evict(key: str, outcome: EvictOutcome, *, device: int | None = None) -> None:
    """The typed error of one key's eviction outcome (none when evicted); ``device``: the
    eviction was of that device pool's copies only."""
    if outcome is EvictOutcome.NOT_FOUND and device is not None:
        raise NotFound("no such entry, or no copy in that device pool", key=key, device=device)
    if outcome is EvictOutcome.NOT_FOUND:
        raise NotFound("no such entry", key=key)
    if outcome is EvictOutcome.LEASED:
        raise EntryLeased("entry is leased; it is evicted only once released", key=key)


class CacheEngine:
    def __init__(
        self,
        settings: Settings,
        *,
        clock: Callable[[], float] = time.monotonic,
        device_pools: Sequence[DevicePool] | None = None,
    ) -> None:
        self.settings = settings
        self._clock = clock
        self._lock = threading.RLock()
        self._uses_cuda = cuda_wanted(settings)
        self.host_pool = HostPool(
            settings.effective_shm_name,
            settings.host_pool_bytes,
            settings.page_bytes,
            register_cuda=self._uses_cuda,
            mode=int(settings.shm_mode, 8),
        )
        self._alloc = PageRunAllocator(self.host_pool.num_pages)
        self._entries = EntryTable()
        self._filling: dict[int, tuple[Entry, str]] = {}  # put id -> (entry, owner)
        self._put_ids = itertools.count(1)
        self._inflight: Counter[str] = Counter()  # owner -> bytes reserved in open puts
        self._leases = LeaseTable()
        self._runs_hist: Counter[str] = Counter()
        self._counters: Counter[str] = Counter()
        self._draining = False
        self._closed = False
        # Called as (direction, nbytes, seconds) after each finished copy (metrics).
        self.copy_observer: CopyObserver | None = None
        # Shared-tier hooks (service/tiers), None/empty when there is none: fetch local
        # misses into the pool; answer exists for local misses; hear of every new entry.
        self.miss_fetcher: Callable[[list[str]], None] | None = None
        self.remote_exists: Callable[[list[str]], list[bool]] | None = None
        self.commit_listeners: list[Callable[[str, str], None]] = []  # (key, owner)
        self.shared_tier: Any = None  # the attached SharedTier (prefetch, health), if any
        pools: Sequence[DevicePool] = ()
        try:
            pools = default_device_pools(settings) if device_pools is None else device_pools
            self.device_tier = DeviceTier(self, pools)
        except BaseException:
            if device_pools is None:  # ours to close; a caller's pools stay the caller's
                for pool in pools:
                    pool.close()
            self.host_pool.close()
            raise

    # -- puts ----------------------------------------------------------------------------
    def begin_put(
        self,
        key: str,
        dtype: str,
        shape: Sequence[int],
        *,
        nbytes: int | None = None,
        checksum: int | None = None,
        owner: str = "local",
    ) -> PutHandle:
        """Validate, then reserve pages for a new entry (evicting LRU entries if needed)."""
        key = admission.check_key(key, self.settings)
        meta = admission.check_meta(dtype, shape, nbytes, self.settings)
        crc = admission.check_checksum(checksum)
        npages = -(-meta.nbytes // self.settings.page_bytes)
        with self._lock:
            self._check_open()
            existing = self._entries.get(key)
            if existing is not None:
                self._check_same_meta(existing, meta.dtype, meta.shape)
                self._entries.touch(existing)
                return PutHandle(None, 0, existing, (), crc)
            if self._inflight[owner] + meta.nbytes > self.settings.inflight_limit:
                raise QuotaExceeded(
                    "too many bytes in unfinished puts",
                    owner=owner,
                    inflight=self._inflight[owner],
                    nbytes=meta.nbytes,
                    limit=self.settings.inflight_limit,
                )
            runs = self._reserve(npages, meta.nbytes)
            entry = Entry(
                key,
                meta.dtype,
                meta.shape,
                meta.nbytes,
                tuple(runs),
                EntryState.FILLING,
                crc,
                0,
                self._clock(),
            )
            put_id = next(self._put_ids)
            self._filling[put_id] = (entry, owner)
            self._inflight[owner] += meta.nbytes
        byte_runs = tuple(self.host_pool.byte_runs(entry.runs, meta.nbytes))
        return PutHandle(self, put_id, entry, byte_runs, crc)

    def put(self, key: str, tensor: torch.Tensor, *, owner: str = "local") -> bool:
        """Store a CPU tensor in one call. True if created, False if it already existed."""
        dt = from_torch(tensor.dtype)
        if dt is None:
            raise InvalidArgument("unsupported dtype", dtype=str(tensor.dtype))
        handle = self.begin_put(key, dt.name, tuple(tensor.shape), owner=owner)
        with handle:
            handle.write(tensor.detach().cpu().contiguous())
            return handle.commit()

    def _reserve(self, npages: int, nbytes: int) -> list[tuple[int, int]]:
        if self._alloc.num_free_pages + self._entries.evictable_pages < npages:
            raise PoolExhausted(
                "no room: the pool is full of leased or filling entries",
                nbytes=nbytes,
                free_pages=self._alloc.num_free_pages,
                evictable_pages=self._entries.evictable_pages,
            )
        while self._alloc.num_free_pages < npages:
            victim = self._entries.lru_oldest()
            assert victim is not None, "evictable page count out of step with the LRU"
            self._evict_locked(victim)
        runs = self._alloc.allocate(npages)
        assert runs is not None, "allocation failed with enough free pages"
        return runs

    @property
    def closed(self) -> bool:
        return self._closed

    def _commit_fill(self, put_id: int) -> bool:
        with self._lock:
            if put_id not in self._filling:
                raise Draining("engine closed before the put committed")
            entry, owner = self._end_fill(put_id)
            existing = self._entries.get(entry.key)
            if existing is not None:  # a concurrent put of the same key committed first
                self._alloc.free(entry.runs)
                self._check_same_meta(existing, entry.dtype, entry.shape)
                return False
            entry.state = EntryState.READY
            entry.last_access = self._clock()
            self._entries.add_ready(entry)
            self._runs_hist[run_bucket(len(entry.runs))] += 1
            self._counters["puts_committed"] += 1
            self._counters["put_bytes"] += entry.nbytes
        self.device_tier.prepare(entry)
        for listener in self.commit_listeners:
            try:
                listener(entry.key, owner)
            except Exception:  # a listener (e.g. write-through) never fails the put
                log.exception("commit listener failed for %r", entry.key)
        return True

    def _abort_fill(self, put_id: int) -> None:
        with self._lock:
            if put_id not in self._filling:
                return  # already dropped by close()
            entry, _ = self._end_fill(put_id)
            self._alloc.free(entry.runs)
            entry.state = EntryState.FREED
            self._counters["puts_aborted"] += 1

    def _end_fill(self, put_id: int) -> tuple[Entry, str]:
        entry, owner = self._filling.pop(put_id)
        self._inflight[owner] -= entry.nbytes
        if not self._inflight[owner]:
            del self._inflight[owner]
        return entry, owner

    @staticmethod
    def _check_same_meta(existing: Entry, dtype: Any, shape: tuple[int, ...]) -> None:
        if not existing.same_meta(dtype, shape):
            raise MetadataConflict(
                "key exists with different metadata",
                key=existing.key,
                existing_dtype=existing.dtype.name,
                existing_shape=list(existing.shape),
                dtype=dtype.name,
                shape=list(shape),
            )

    # -- gets and leases -----------------------------------------------------------------
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

    # -- exists / evict ------------------------------------------------------------------
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

    # -- device tier (see device_tier.py) ----------------------------------------------
    def get_to_device(
        self,
        keys: Sequence[str],
        owner: str,
        *,
        ttl_s: float | None = None,
        device: int = 0,
        read_table: bool = False,
    ) -> tuple[list[DeviceLease | None], torch.Tensor | None]:
        """Lease each key and make it resident in device pool ``device`` (one batched copy).

        Returns per key a DeviceLease (or None for a miss) and, with ``read_table``, the
        batch's physical page table built on the device by ``build_read_table``.
        """
        return self.device_tier.get_to_device(
            keys, owner, ttl_s=ttl_s, device=device, read_table=read_table
        )

    def start_get_to_device(
        self,
        keys: Sequence[str],
        owner: str,
        *,
        ttl_s: float | None = None,
        device: int = 0,
        fill_misses: bool = True,
        defer_tables: bool = False,
    ) -> PendingGet:
        """:meth:`get_to_device` without waiting for the copies: for callers that wait
        their own way (an event loop). Hand out ``pending.results`` only once
        ``pending.done()`` or ``pending.wait()``; the leases are the caller's either way.
        ``defer_tables``: the caller runs :meth:`flush_device_tables` later, off its
        critical path (the tables are only read by whoever flushes first)."""
        return self.device_tier.start_get(
            keys,
            owner,
            ttl_s=ttl_s,
            device=device,
            read_table=False,
            fill_misses=fill_misses,
            defer_tables=defer_tables,
        )

    def ready_event(self, pending: PendingGet, device: int = 0) -> bytes | None:
        """For a client that waits on the GPU: an interprocess event handle that fires once
        ``pending``'s copies are complete, so its results may be handed out now (None: they
        are complete already, or the pool is not on a GPU)."""
        return self.device_tier.ready_event(pending, device)

    def flush_device_tables(self, device: int = 0) -> None:
        """Launch device ``device``'s deferred page-table updates."""
        self.device_tier.flush_tables(device)

    def get_into(
        self,
        keys: Sequence[str],
        owner: str,
        dest: torch.Tensor,
        offsets: Sequence[int],
        *,
        device: int | None = None,
    ) -> list[Lease | None]:
        """Copy each found entry into ``dest`` (flat uint8) at its offset; None for misses."""
        return self.device_tier.get_into(keys, owner, dest, offsets, device=device)

    def put_from_device(
        self, key: str, src: torch.Tensor, *, owner: str = "local", checksum: int | None = None
    ) -> bool:
        """Store a (device) tensor; returns once its bytes are in the host pool."""
        return self.device_tier.put_from_device(key, src, owner, checksum)

    def put_from_device_many(
        self,
        items: Sequence[tuple[str, torch.Tensor]],
        *,
        owner: str = "local",
        checksums: Sequence[int | None] | None = None,
    ) -> list[bool]:
        """Store several (device) tensors, ``(key, tensor)`` each; returns once all their
        bytes are in the host pool (one wait for the batch). True per created entry.
        ``checksums``: a CRC32 or None per item. All or nothing: an error (a checksum
        mismatch included) leaves none of the batch visible."""
        return self.device_tier.put_from_device_many(items, owner, checksums)

    def prefetch(self, keys: Sequence[str], *, device: int | None = None) -> dict[str, int]:
        """Warm the local tiers: fetch missing keys from the shared tier (if any) and, with
        ``device``, make them resident in that device pool. Never fails on a tier outage."""
        if self.shared_tier is not None:
            result: dict[str, int] = self.shared_tier.prefetch(keys, device=device).to_dict()
            return result
        wanted = list(dict.fromkeys(k for k in keys if isinstance(k, str)))
        present = [k for k, hit in zip(wanted, self.exists(wanted), strict=True) if hit]
        resident = 0
        if device is not None and present:
            placed, _ = self.get_to_device(present, SHARED_TIER_OWNER, device=device)
            self.release(p.lease.lease_id for p in placed if p is not None)
            resident = sum(1 for p in placed if p is not None)
        return {
            "requested": len(wanted),
            "local": len(present),
            "fetched": 0,
            "missing": len(wanted) - len(present),
            "resident": resident,
        }

    def _count_copy(self, direction: str, nbytes: int) -> None:
        with self._lock:
            self._counters[f"copy_{direction}"] += nbytes

    # -- introspection (introspection.py) -------------------------------------------------
    def stats(self) -> EngineStats:
        return introspection.stats(self)

    def entry_info(self, key: str) -> EntryInfo | None:
        """Metadata, page runs, residency and lease holders of one READY entry."""
        return introspection.entry_info(self, key)

    def list_entries(
        self, offset: int = 0, limit: int = 100, state: str | None = None
    ) -> tuple[int, list[EntryInfo]]:
        """Entries in insertion order; ``state`` filters ``ready`` / ``filling``."""
        return introspection.list_entries(self, offset, limit, state)

    def page_states(self) -> np.ndarray:
        """One uint8 per host page: 0 free, 1 filling, 2 ready, 3 leased."""
        return introspection.page_states(self)

    def device_page_states(self, index: int = 0) -> np.ndarray:
        """One uint8 per page of device pool ``index``: 0 free, 1 resident, 2 leased."""
        return introspection.device_page_states(self, index)

    # -- life cycle ----------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        """Pools allocated (and registered with CUDA where CUDA is used), not draining."""
        pool = self.host_pool
        return (
            not self._closed
            and not self._draining
            and not pool.closed
            and (pool.registered or not self._uses_cuda)
        )

    @property
    def draining(self) -> bool:
        return self._draining

    def begin_drain(self) -> None:
        """Refuse new puts and gets; in-flight puts may still commit."""
        with self._lock:
            self._draining = True

    def _check_open(self) -> None:
        if self._closed:
            raise Draining("engine is closed")
        if self._draining:
            raise Draining("daemon is draining")

    def close(self) -> None:
        """Drop every lease and reservation and remove the shared-memory segment."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._draining = True
            for lease_id in self._leases.all_ids():
                self._end_lease(lease_id)
            self._filling.clear()
            self._inflight.clear()
        self.device_tier.close()
        self.host_pool.close()

    def __enter__(self) -> CacheEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
