"""Device-side operations of the engine: get-to-device, get-into, put-from-device.

Bookkeeping (leases, residency, page binding) happens under the engine lock; the copies
are queued on the device pool's stream while the lock is held (queuing is cheap) and
waited for outside it, so a slow copy never blocks other clients' calls.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import torch

from embcache import kernels
from embcache.errors import DeviceUnavailable, PoolExhausted
from embcache.service.device import loads as device_loads
from embcache.service.device.copy_plan import entry_columns
from embcache.service.device.loads import ROW, Placed
from embcache.service.device.pending_get import DeviceLease, PendingGet
from embcache.service.device.pool import DevicePool, Residency
from embcache.service.device.ready_events import ReadyEvents
from embcache.service.device.routing import PeerRates
from embcache.service.host.leases import Lease

T = TypeVar("T")

if TYPE_CHECKING:
    from embcache.service.engine import CacheEngine
    from embcache.service.host.entries import Entry

log = logging.getLogger(__name__)
CopyObserver = Callable[[str, int, float], None]
__all__ = ["CopyObserver", "DeviceLease", "DeviceTier", "PendingGet"]


class DeviceTier:
    def __init__(self, engine: CacheEngine, pools: Sequence[DevicePool]) -> None:
        self._engine = engine
        self.pools = list(pools)
        for pool in self.pools:  # see DevicePool.refill
            pool.free_target = int(pool.num_pages * engine.settings.device_free_reserve)
            pool.flush_every_s = engine.settings.device_table_flush_s
        self._put_streams: dict[int, torch.cuda.Stream] = {}
        self._ready: dict[int, ReadyEvents] = {}  # pool index -> its ring of IPC events
        self._config = kernels.TransferConfig(sm_budget=engine.settings.copy_sm_budget)
        # Measured host->GPU and GPU->GPU rates decide where a device copy comes from.
        self.rates = PeerRates.calibrate(self.pools, engine.host_pool.tensor)

    def pool(self, index: int) -> DevicePool:
        pool = self._at(index)
        if pool.failed:
            raise DeviceUnavailable(
                "device pool is out of service after a device error",
                device=index,
                reason=pool.failure,
            )
        return pool

    def _at(self, index: int) -> DevicePool:
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

    def prepare(self, entry: Entry) -> None:
        """Plan a new entry's host side for later copies to a device (its host runs never
        change), so a first get does not pay for it."""
        if self.pools and entry.nbytes and entry.host_cols is None:
            page = self._engine.host_pool.page_bytes
            entry.host_cols = entry_columns(entry.runs, page, entry.nbytes, ROW)

    def drop(self, entry: Entry) -> None:
        for pool in self.pools:
            pool.drop(entry)

    def evict_copies(self, entries: list[Entry], device: int) -> list[bool]:
        """Drop these unleased entries' copies in pool ``device`` (host copies stay); per
        entry, whether it had one. Caller holds the engine lock."""
        pool = self._at(device)
        had = [pool.is_resident(entry) for entry in entries]
        present = [entry for entry, h in zip(entries, had, strict=True) if h]
        self._guarded(pool, lambda: pool.evict_entries(present))
        return had

    def evict_pool_bytes(self, device: int, nbytes: int) -> tuple[int, int]:
        """Free ``nbytes`` of pool ``device`` by LRU over its unleased copies."""
        pool = self._at(device)
        return self._guarded(pool, lambda: pool.evict_bytes(nbytes))

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

    # -- get to device -------------------------------------------------------------------
    def start_get(
        self,
        keys: Sequence[str],
        owner: str,
        *,
        ttl_s: float | None,
        device: int,
        read_table: bool,
        fill_misses: bool = True,
        defer_tables: bool = False,
    ) -> PendingGet:
        """Lease the keys and queue the copies of the non-resident ones; do not wait for
        them (see :class:`PendingGet`). ``fill_misses=False``: the caller asked the shared
        tier already (it may block on the network; this call blocks only on the lock).
        ``defer_tables=True``: the page-table updates stay queued until the caller runs
        :meth:`flush_tables` (e.g. once its reply is on its way)."""
        e = self._engine
        pool = self.pool(device)
        loads: list[tuple[Entry, Residency]] = []
        copied: dict[str, int] = {}
        if fill_misses:
            e.fill_misses(keys)  # shared tier, outside the lock
        ttl = e._ttl(ttl_s)
        with e._lock:
            entries, now = e._pin(keys, owner)
            leases: list[Lease | None] | None = None
            placed: list[Placed | None] = []
            try:
                todo: list[Entry] = []  # found entries that need a copy, each once
                seen: set[Entry] = set()
                for entry in entries:
                    if entry is None or entry in seen:
                        continue
                    seen.add(entry)
                    if pool.lookup(entry) is None:
                        todo.append(entry)
                # The copies are queued before the leases are made, so they start sooner:
                # making them cannot fail, and the pins keep every entry of the batch in place.
                # ``loads`` holds what is reserved so far, for the unwinding below.
                done = device_loads.load(self, pool, todo, loads) if todo else copied
                if done is None:
                    raise PoolExhausted(
                        "device pool is full of leased entries",
                        device=device,
                        nbytes=sum(x.nbytes for x in todo),
                        device_pages=pool.num_pages,
                    )
                copied = done
                leases = e._lease_pinned(entries, owner, now + ttl)
                loaded = {id(entry) for entry, _ in loads}
                for lease in leases:
                    if lease is None:
                        placed.append(None)
                        continue
                    res = pool.peek(lease.entry)
                    assert res is not None
                    placed.append((lease, res, id(lease.entry) not in loaded))
                if not defer_tables:
                    if todo:  # while the copies run, room for the next cold get
                        pool.refill()
                    pool.flush_if_due()
            except BaseException as exc:
                if leases is None:
                    e._unpin(entries)
                else:
                    e.release(x.lease_id for x in leases if x is not None)
                if _take_out_of_service(pool, exc):
                    raise DeviceUnavailable(
                        "device error; pool taken out of service", device=device, reason=str(exc)
                    ) from exc
                for entry, _ in loads:
                    pool.drop(entry)
                raise
            pool.hits += sum(1 for p in placed if p is not None and p[2])
            table = device_loads.read_table(pool, placed) if read_table else None
        results = [None if p is None else self._device_lease(pool, *p) for p in placed]
        events = list({id(p[1].event): p[1].event for p in placed if p and p[1].event}.values())
        return PendingGet(results, table, events, copied, self._observe)

    def ready_event(self, pending: PendingGet, device: int) -> bytes | None:
        """An interprocess event handle that fires once ``pending``'s copies are complete,
        for a client that waits on the GPU (see ``ready_events.py``); None when they are
        complete already or the pool is not on a GPU."""
        left = pending.unfinished()
        pool = self.pool(device)
        if not left or pool.stream is None:
            return None
        ring = self._ready.get(device)
        if ring is None:
            ring = self._ready.setdefault(device, ReadyEvents(pool.device))
        return ring.mark(pool.stream, left)

    def get_to_device(
        self, keys: Sequence[str], owner: str, *, ttl_s: float | None, device: int, read_table: bool
    ) -> tuple[list[DeviceLease | None], torch.Tensor | None]:
        pending = self.start_get(keys, owner, ttl_s=ttl_s, device=device, read_table=read_table)
        try:
            return self._guarded(self._at(device), pending.wait)
        except BaseException:  # nobody receives these leases
            self._engine.release(d.lease.lease_id for d in pending.results if d is not None)
            raise

    @staticmethod
    def _device_lease(pool: DevicePool, lease: Lease, res: Residency, hit: bool) -> DeviceLease:
        offset = res.runs[0][0] * pool.page_bytes if res.contiguous and res.runs else None
        if res.npages == 0:
            offset = 0
        return DeviceLease(
            lease,
            pool.pool_id,
            pool.gpu_uuid,
            pool.page_bytes,
            tuple(pool.page_ids(res)),
            offset,
            hit,
        )

    def flush_due(self) -> int:
        """Launch the page-table updates that have waited ``device_table_flush_s`` in any
        pool (the daemon's reaper calls this, so the tables catch up once gets stop);
        returns how many pools flushed."""
        with self._engine._lock:
            return sum(self._flush(pool, when_due=True) for pool in self.pools)

    def flush_tables(self, device: int, *, when_due: bool = False) -> None:
        """After a ``defer_tables`` get's reply: evict down to the pool's free reserve
        (``DevicePool.refill``), then launch the page-table updates left queued (if any;
        ``when_due``: only once they have waited ``device_table_flush_s``)."""
        pool = self._at(device)
        with self._engine._lock:
            if not pool.failed:
                pool.refill()
            self._flush(pool, when_due=when_due)

    @staticmethod
    def _flush(pool: DevicePool, *, when_due: bool) -> bool:
        """Launch ``pool``'s queued table updates (``when_due``: only once due); a device
        error takes the pool out of service. Caller holds the engine lock."""
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

    # -- plumbing ------------------------------------------------------------------------
    def _transfer(
        self,
        src: torch.Tensor,
        dst: torch.Tensor,
        s: np.ndarray,
        d: np.ndarray,
        n: np.ndarray,
        stream: torch.cuda.Stream | None,
        *,
        checked: bool = True,
    ) -> None:
        """``transfer_ranges``, or (``checked=False``) ``transfer_planned`` for a plan the
        engine made from its allocators' own runs, which holds by construction."""
        on_cuda = src.device.type == "cuda" or dst.device.type == "cuda"
        backend = self._engine.settings.copy_backend if on_cuda else "torch"
        if not checked:
            kernels.transfer_planned(
                src, dst, s, d, n, stream=stream, backend=backend, config=self._config
            )
            return
        kernels.transfer_ranges(
            src,
            dst,
            s,
            d,
            n,
            stream=stream,
            backend=backend,
            host_registered=self._engine.host_pool.registered,
            config=self._config,
        )

    def _stream_for(self, t: torch.Tensor) -> torch.cuda.Stream | None:
        if not t.is_cuda:
            return None
        index = t.get_device()
        if index not in self._put_streams:
            self._put_streams[index] = torch.cuda.Stream(t.device)
        return self._put_streams[index]

    @staticmethod
    def _record(stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
        if stream is None:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def _observe(self, direction: str, nbytes: int, seconds: float) -> None:
        observer = self._engine.copy_observer
        if observer is not None and nbytes:
            observer(direction, nbytes, seconds)

    def close(self) -> None:
        # Puts' copies into the host pool may still run (a put the engine dropped as it
        # closed): they end before the pool is unregistered and unmapped after this.
        for stream in self._put_streams.values():
            stream.synchronize()
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
    from embcache.kernels._cudart import CudaRuntimeError
    from embcache.kernels.cuda_mem import CudaMemError

    if isinstance(exc, (CudaMemError, CudaRuntimeError)):
        return True
    return isinstance(exc, RuntimeError) and "CUDA error" in str(exc)
