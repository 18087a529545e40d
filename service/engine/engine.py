"""CacheEngine: the one API every transport uses (see docs/design.md).

One lock guards the tables; byte copies run outside it (a FILLING reservation has one
writer, a leased entry is never freed). Leases expire lazily inside calls and from the
daemon's reaper via :meth:`expire_leases`.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from embcache.errors import (
    Draining,
)
from embcache.service.config import Settings
from embcache.service.device import into as device_io
from embcache.service.device.pool import DevicePool
from embcache.service.device.puts import PendingPut, start_puts
from embcache.service.device.tier import CopyObserver, DeviceLease, DeviceTier, PendingGet
from embcache.service.engine import introspection
from embcache.service.engine.evict import EvictOps, EvictOutcome, raise_for_evict
from embcache.service.engine.leases import SHARED_TIER_OWNER, LeaseOps
from embcache.service.engine.puts import PutOps
from embcache.service.host.allocator import PageRunAllocator
from embcache.service.host.entries import Entry, EntryTable
from embcache.service.host.host_pool import HostPool
from embcache.service.host.leases import Lease, LeaseTable
from embcache.service.host.prealloc import PutLanding
from embcache.service.host.stats import EngineStats, EntryInfo

log = logging.getLogger(__name__)


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


__all__ = [
    "SHARED_TIER_OWNER",
    "CacheEngine",
    "EvictOutcome",
    "cuda_wanted",
    "default_device_pools",
    "raise_for_evict",
]


class CacheEngine(PutOps, LeaseOps, EvictOps):
    """The engine (module docstring): puts in ``engine_puts.py``, gets and leases in
    ``engine_leases.py``, exists and eviction in ``engine_evict.py``, device copies in
    ``device_tier.py``; this module holds the state, the device-tier and introspection
    entry points, and the life cycle."""

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
        landing = settings.device_put_landing_bytes // settings.page_bytes
        self._landing = PutLanding(min(landing, self._alloc.num_pages // 16))
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
        ``defer_tables``: the caller runs :meth:`settle_device` (or
        :meth:`flush_device_tables`) later, off its critical path (the tables are only read
        by whoever flushes first)."""
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
        """Launch device ``device``'s deferred page-table updates now."""
        self.device_tier.flush_tables(device)

    def settle_device(self, device: int = 0) -> None:
        """After a ``defer_tables`` get's reply: refill device ``device``'s free reserve and
        launch its page-table updates once they have waited ``device_table_flush_s``."""
        self.device_tier.flush_tables(device, when_due=True)

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
        return device_io.get_into(self.device_tier, keys, owner, dest, offsets, device=device)

    def put_from_device(
        self,
        key: str,
        src: torch.Tensor,
        *,
        owner: str = "local",
        checksum: int | None = None,
        src_ready: bool = False,
    ) -> bool:
        """Store a (device) tensor; returns once its bytes are in the host pool. The copy
        follows the work queued so far on the current stream (``src_ready``: the caller
        knows ``src`` is written already, e.g. it waited for its producer's event)."""
        pending = start_puts(self.device_tier, [(key, src)], owner, [checksum], src_ready=src_ready)
        return pending.finish()[0]

    def put_from_device_many(
        self,
        items: Sequence[tuple[str, torch.Tensor]],
        *,
        owner: str = "local",
        checksums: Sequence[int | None] | None = None,
        src_ready: bool = False,
    ) -> list[bool]:
        """Store several (device) tensors, ``(key, tensor)`` each; returns once all their
        bytes are in the host pool (one wait for the batch). True per created entry.
        ``checksums``: a CRC32 or None per item. All or nothing: an error (a checksum
        mismatch included) leaves none of the batch visible. ``src_ready``: as for
        :meth:`put_from_device`."""
        return start_puts(self.device_tier, items, owner, checksums, src_ready=src_ready).finish()

    def start_put_from_device_many(
        self,
        items: Sequence[tuple[str, torch.Tensor]],
        *,
        owner: str = "local",
        checksums: Sequence[int | None] | None = None,
        src_ready: bool = False,
    ) -> PendingPut:
        """:meth:`put_from_device_many` without waiting for the copies, for callers that
        wait their own way (an event loop): ``pending.finish()`` once ``pending.done()``
        commits the batch, ``pending.abort()`` gives it up. The tensors must stay readable
        until then."""
        return start_puts(self.device_tier, items, owner, checksums, src_ready=src_ready)

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
