"""The device tier: the device pools of the served GPUs, and the copies into them.

The tier knows nothing of keys, leases or the engine. The engine hands it entries it has
pinned (a reference each, so nothing evicts them meanwhile) and gets placements back: where
each entry lies in a pool, and the copies to wait for. Every call is made with the engine's
lock held; the copies are queued on the pool's stream under it (queuing is cheap) and waited
for outside it, so a slow copy never blocks another client's call.

A pool whose device fails (a CUDA error) is taken out of service: it forgets what it held,
and calls for it fail with DeviceUnavailable while the other pools go on serving.

With a read table (:meth:`DeviceTier.offer_copies`), each pool's finished copies are offered
to same-node clients there, and withdrawn before their pages can be reused
(``published.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np
import torch

from embcache.errors import DeviceUnavailable, PoolExhausted
from embcache.service.config import DeviceConfig
from embcache.service.device import loads
from embcache.service.device.copier import Copier, CopyObserver
from embcache.service.device.into import queue_into
from embcache.service.device.pending_get import DeviceLease, PendingGet, Placement
from embcache.service.device.pool import DevicePool
from embcache.service.device.published import PublishedCopies
from embcache.service.device.ready_events import ReadyEvents
from embcache.service.device.residency import Residency
from embcache.service.device.routing import PeerRates
from embcache.service.host.entries import Entry
from embcache.service.host.host_pool import HostPool
from embcache.service.host.leases import Lease
from embcache.service.host.read_table import ReadTable
from embcache.service.host.stats import PoolStats

T = TypeVar("T")
log = logging.getLogger(__name__)


class DeviceTier:
    """The device pools and their copies (module docstring)."""

    def __init__(
        self,
        pools: Sequence[DevicePool],
        host: HostPool,
        config: DeviceConfig,
        *,
        copy_observer: CopyObserver | None = None,
    ) -> None:
        self.pools = list(pools)
        self.host = host
        for pool in self.pools:
            pool.free_target = int(pool.num_pages * config.free_reserve)
            pool.flush_every_s = config.table_flush_s
        self.copier = Copier(
            host, backend=config.copy_backend, sm_budget=config.sm_budget, observer=copy_observer
        )
        self._ready: dict[int, ReadyEvents] = {}  # pool index -> its ring of IPC events
        # Host->GPU and GPU->GPU rates timed now decide where a device copy comes from.
        self.rates = PeerRates.calibrate(self.pools, host.tensor)

    # -- pools ---------------------------------------------------------------------------
    def pool(self, index: int) -> DevicePool:
        """Pool ``index`` if it is in service; DeviceUnavailable otherwise."""
        pool = self.at(index)
        if pool.failed:
            raise DeviceUnavailable(
                "device pool is out of service after a device error",
                device=index,
                reason=pool.failure,
            )
        return pool

    def at(self, index: int) -> DevicePool:
        """Pool ``index``, in service or not; DeviceUnavailable if there is none."""
        if not 0 <= index < len(self.pools):
            raise DeviceUnavailable(
                "no device pool with this index", device=index, pools=len(self.pools)
            )
        return self.pools[index]

    def index_of(self, gpu_uuid: str) -> int | None:
        """The pool serving the GPU with this uuid (None: no such pool)."""
        for index, pool in enumerate(self.pools):
            if pool.gpu_uuid == gpu_uuid:
                return index
        return None

    def pool_for(self, gpu_uuid: str) -> tuple[int, DevicePool]:
        """Index and pool serving the GPU with this uuid; DeviceUnavailable if none does."""
        index = self.index_of(gpu_uuid)
        if index is not None:
            return index, self.pools[index]
        if not self.pools:
            raise DeviceUnavailable(
                "device locations need the device pool, which this daemon does not have",
                gpu_uuid=gpu_uuid,
            )
        raise DeviceUnavailable(
            "this daemon has no device pool on that GPU",
            gpu_uuid=gpu_uuid,
            pools=[p.gpu_uuid for p in self.pools],
        )

    def offer_copies(self, reads: ReadTable | None) -> None:
        """Offer the pools' finished copies in the read table ``reads`` (None: none), each
        pool named by its index here, as sessions announce them."""
        for index, pool in enumerate(self.pools):
            pool.published = None if reads is None else PublishedCopies(reads, index)

    def offer_done(self, device: int) -> int:
        """Offer pool ``device``'s copies whose filling copy is complete now (after a get
        waited for its copies); returns how many. A device error takes the pool out of
        service instead of raising."""
        pool = self.at(device)
        return self._offer(pool)

    @staticmethod
    def _offer(pool: DevicePool) -> int:
        if pool.published is None:
            return 0
        if pool.failed:  # out of service: withdraw what it offered (its pages stay unused)
            pool.published.forget_all()
            return 0
        if not pool.published.waiting:
            return 0
        try:
            return pool.published.offer_done()
        except BaseException as exc:
            if not _take_out_of_service(pool, exc):
                raise
            return 0

    # -- entries -------------------------------------------------------------------------
    def prepare(self, entry: Entry) -> None:
        """Plan a new entry's host side for later copies to a device (its host runs never
        change), so a first get does not pay for it."""
        if self.pools and entry.nbytes:
            loads.host_columns(entry, self.host.page_bytes)

    def drop(self, entry: Entry) -> None:
        """Forget ``entry``'s copies (it is being evicted; nobody holds it)."""
        for pool in self.pools:
            pool.drop(entry)

    def residency(self, entry: Entry) -> tuple[str, ...]:
        """Where ``entry`` has copies: ``("host", "device:0", ...)``."""
        return ("host", *(f"device:{p.index}" for p in self.pools if p.is_resident(entry)))

    def evict_copies(self, entries: list[Entry], device: int) -> list[int | None]:
        """Drop these unleased entries' copies in pool ``device`` (host copies stay); per
        entry, the bytes of the pages its copy freed, or None when it had none."""
        pool = self.at(device)
        had = [pool.resident_bytes(entry) for entry in entries]
        present = [entry for entry, h in zip(entries, had, strict=True) if h is not None]
        self._guarded(pool, lambda: pool.evict_entries(present))
        return had

    def evict_pool_bytes(self, device: int, nbytes: int) -> tuple[int, int]:
        """Free ``nbytes`` of pool ``device`` by LRU over its unleased copies."""
        pool = self.at(device)
        return self._guarded(pool, lambda: pool.evict_bytes(nbytes))

    # -- get to device -------------------------------------------------------------------
    def place(
        self, entries: Sequence[Entry | None], device: int, *, defer_tables: bool = False
    ) -> Placement:
        """Make the pinned ``entries`` (None: a miss) resident in pool ``device``: reserve
        pages for those with no copy there and queue their copies, without waiting.

        Raises PoolExhausted when the pool cannot hold them (every other copy is leased) and
        DeviceUnavailable after a device error; either way nothing of the batch stays.
        ``defer_tables``: leave the page-table updates (and the free-reserve evictions)
        queued until :meth:`flush_tables` runs, e.g. once the reply is on its way."""
        pool = self.pool(device)
        todo: list[Entry] = []  # found entries that need a copy, each once
        seen: set[Entry] = set()
        for entry in entries:
            if entry is not None and entry not in seen:
                seen.add(entry)
                if pool.lookup(entry) is None:
                    todo.append(entry)
        reserved: list[tuple[Entry, Residency]] = []  # what is reserved so far, to unwind
        try:
            copied = {"h2d": 0, "d2d": 0}
            if todo:
                done = loads.load(self.copier, self.rates, self.pools, pool, todo, reserved)
                if done is None:
                    raise PoolExhausted(
                        "device pool is full of leased entries",
                        device=device,
                        nbytes=sum(x.nbytes for x in todo),
                        device_pages=pool.num_pages,
                    )
                copied = done
                if pool.published is not None:  # offered once their copies are complete
                    for entry, res in reserved:
                        pool.published.loaded(entry, res)
            if pool.published is not None and pool.published.waiting:
                pool.published.offer_done()  # earlier gets' copies, complete by now
            loaded = {id(entry) for entry, _ in reserved}
            residencies = [None if e is None else pool.peek(e) for e in entries]
            hits = [e is not None and id(e) not in loaded for e in entries]
            if not defer_tables:
                if todo:  # while the copies run, room for the next cold get
                    pool.evict_to_free_target()
                pool.flush_if_due()
        except BaseException as exc:
            if _take_out_of_service(pool, exc):
                raise DeviceUnavailable(
                    "device error; pool taken out of service", device=device, reason=str(exc)
                ) from exc
            for entry, _ in reserved:
                pool.drop(entry)
            raise
        pool.hits += sum(hits)
        events = {id(r.event): r.event for r in residencies if r is not None and r.event}
        return Placement(pool, list(entries), residencies, hits, list(events.values()), copied)

    def pending(self, placement: Placement, leases: Sequence[Lease | None]) -> PendingGet:
        """The get whose leases the engine took on ``placement``'s entries."""
        pool = placement.pool
        results: list[DeviceLease | None] = []
        for lease, res, hit in zip(leases, placement.residencies, placement.hits, strict=True):
            if lease is None:
                results.append(None)
                continue
            assert res is not None, "a leased entry of the batch has no residency"
            offset = res.runs[0][0] * pool.page_bytes if res.contiguous and res.runs else None
            if res.npages == 0:
                offset = 0
            page_ids = tuple(pool.page_ids(res))
            results.append(
                DeviceLease(
                    lease, pool.pool_id, pool.gpu_uuid, pool.page_bytes, page_ids, offset, hit
                )
            )
        return PendingGet(results, None, placement.events, placement.copied, self.copier.observe)

    def read_table(self, placement: Placement) -> torch.Tensor:
        """The batch's physical page table (per found entry), built on the device."""
        found = [
            (entry, res)
            for entry, res in zip(placement.entries, placement.residencies, strict=True)
            if entry is not None and res is not None
        ]
        return loads.read_table(placement.pool, found)

    def ready_event(self, pending: PendingGet, device: int) -> bytes | None:
        """An interprocess event handle that fires once ``pending``'s copies are complete,
        for a client that waits on the GPU (``ready_events.py``); None when they are
        complete already or the pool is not on a GPU."""
        left = pending.unfinished()
        pool = self.pool(device)
        if not left or pool.stream is None:
            return None
        ring = self._ready.get(device)
        if ring is None:
            ring = self._ready.setdefault(device, ReadyEvents(pool.device))
        return ring.mark(pool.stream, left)

    def wait(self, pending: PendingGet, device: int) -> None:
        """Wait for ``pending``'s copies; a device error takes the pool out of service."""
        self._guarded(self.at(device), pending.wait)

    # -- page tables ---------------------------------------------------------------------
    def flush_due(self) -> int:
        """Offer the copies complete by now in the read table (withdraw those of pools out
        of service), then launch the page-table updates that have waited
        ``device_table_flush_s`` in any pool; returns how many pools flushed."""
        for pool in self.pools:
            self._offer(pool)
        return sum(self._flush(pool, when_due=True) for pool in self.pools)

    def flush_tables(self, device: int, *, when_due: bool = False) -> None:
        """After a ``defer_tables`` get: evict down to the pool's free reserve, then launch
        the page-table updates left queued (``when_due``: only once they have waited
        ``device_table_flush_s``)."""
        pool = self.at(device)
        self._offer(pool)
        if not pool.failed:
            pool.evict_to_free_target()
        self._flush(pool, when_due=when_due)

    @staticmethod
    def _flush(pool: DevicePool, *, when_due: bool) -> bool:
        """Launch ``pool``'s queued table updates (``when_due``: only once due); a device
        error takes the pool out of service."""
        if pool.failed or not pool.tables_pending:
            return False
        try:
            if when_due:
                return pool.flush_if_due()
            pool.flush()
            return True
        except BaseException as exc:
            if not _take_out_of_service(pool, exc):
                raise
            return False

    # -- copies for clients --------------------------------------------------------------
    def queue_into(
        self,
        leases: Sequence[Lease | None],
        dest: torch.Tensor,
        offsets: Sequence[int],
        device: int | None,
        *,
        dest_ready: bool = False,
    ) -> torch.cuda.Stream | None:
        """Queue the copies of leased entries into ``dest`` (``into.py``); the stream to
        wait on (None: done already)."""
        pool = self.pool(device) if device is not None else None
        return queue_into(self.copier, pool, leases, dest, offsets, dest_ready=dest_ready)

    # -- stats and life cycle ------------------------------------------------------------
    def stats(self) -> list[PoolStats]:
        """Each pool's sizes, by index."""
        return [pool.stats() for pool in self.pools]

    def resident_entries(self) -> list[int]:
        """How many entries have a copy in each pool, by index."""
        return [pool.resident_entries for pool in self.pools]

    def page_states(self, index: int) -> np.ndarray:
        """One uint8 per page of pool ``index``: 0 free, 1 resident, 2 leased."""
        return self.at(index).page_states()

    @staticmethod
    def _guarded(pool: DevicePool, fn: Callable[[], T]) -> T:
        """``fn()`` on ``pool``; a device error takes the pool out of service."""
        try:
            return fn()
        except BaseException as exc:
            if _take_out_of_service(pool, exc):
                raise DeviceUnavailable(
                    "device error; pool taken out of service", device=pool.index, reason=str(exc)
                ) from exc
            raise

    def close(self) -> None:
        """Wait for the put streams' copies, then free every pool."""
        self.copier.close()
        for pool in self.pools:
            pool.close()


def _take_out_of_service(pool: DevicePool, exc: BaseException) -> bool:
    """After a failure in ``pool``'s work: if it is a device error, take the pool out of
    service (and say so) and return True; other errors leave it as it is."""
    if not _is_device_error(exc):
        return False
    pool.fail(str(exc))
    log.error("device pool %d out of service: %s", pool.index, exc)
    return True


def _is_device_error(exc: BaseException) -> bool:
    """A CUDA failure of the device itself (not a bad request, not a full pool)."""
    from embcache.kernels import CudaRuntimeError
    from embcache.kernels.cuda_mem import CudaMemError

    if isinstance(exc, (CudaMemError, CudaRuntimeError)):
        return True
    return isinstance(exc, RuntimeError) and "CUDA error" in str(exc)
