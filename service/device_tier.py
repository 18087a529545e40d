"""Device-side operations of the engine: get-to-device, get-into, put-from-device.

Bookkeeping (leases, residency, page binding) happens under the engine lock; the copies
are queued on the device pool's stream while the lock is held (queuing is cheap) and
waited for outside it, so a slow copy never blocks other clients' calls.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from embcache import kernels

from .copy_plan import PlanBuilder, row_bytes_for
from .device_pool import DevicePool, Residency
from .dtypes import from_torch
from .errors import DeviceUnavailable, InvalidArgument, PoolExhausted
from .leases import Lease

if TYPE_CHECKING:
    from .engine import CacheEngine
    from .entries import Entry

CopyObserver = Callable[[str, int, float], None]
Placed = tuple[Lease, Residency, bool]  # lease, residency, resident hit


@dataclass(frozen=True, slots=True)
class DeviceLease:
    """Where a leased entry's bytes are in a device pool."""

    lease: Lease
    pool_id: str
    gpu_uuid: str
    page_bytes: int
    page_ids: tuple[int, ...]  # physical device pages, in order
    offset: int | None  # byte offset when the pages are one run, else None
    resident_hit: bool  # True: no copy was needed

    @property
    def key(self) -> str:
        return self.lease.key


class DeviceTier:
    def __init__(self, engine: CacheEngine, pools: Sequence[DevicePool]) -> None:
        self._engine = engine
        self.pools = list(pools)
        self._put_streams: dict[int, torch.cuda.Stream] = {}
        self._config = kernels.TransferConfig(sm_budget=engine.settings.copy_sm_budget)

    def pool(self, index: int) -> DevicePool:
        if not 0 <= index < len(self.pools):
            raise DeviceUnavailable(
                "no device pool with this index", device=index, pools=len(self.pools)
            )
        return self.pools[index]

    def drop(self, entry: Entry) -> None:
        for pool in self.pools:
            pool.drop(entry)

    # -- get to device -------------------------------------------------------------------
    def get_to_device(
        self, keys: Sequence[str], owner: str, *, ttl_s: float | None, device: int, read_table: bool
    ) -> tuple[list[DeviceLease | None], torch.Tensor | None]:
        e = self._engine
        pool = self.pool(device)
        loads: list[tuple[Entry, Residency]] = []
        e.fill_misses(keys)  # shared tier, outside the lock
        with e._lock:
            leases = e._get(keys, owner, ttl_s=ttl_s)
            placed: list[Placed | None] = []
            try:
                for lease in leases:
                    if lease is None:
                        placed.append(None)
                        continue
                    res = pool.lookup(lease.entry)
                    hit = res is not None
                    if res is None:
                        res = pool.reserve(lease.entry)
                        if res is None:
                            raise PoolExhausted(
                                "device pool is full of leased entries",
                                device=device,
                                nbytes=lease.nbytes,
                                device_pages=pool.num_pages,
                            )
                        loads.append((lease.entry, res))
                    placed.append((lease, res, hit))
                if loads:
                    self._load(pool, loads)
            except BaseException:
                for entry, _ in loads:
                    pool.drop(entry)
                pool.flush()
                e.release(x.lease_id for x in leases if x is not None)
                raise
            pool.hits += sum(1 for p in placed if p is not None and p[2])
            table = self._read_table(pool, placed) if read_table else None
        start = time.perf_counter()
        for event in {id(p[1].event): p[1].event for p in placed if p and p[1].event}.values():
            event.synchronize()
        if loads:
            self._observe(
                "h2d", sum(entry.nbytes for entry, _ in loads), time.perf_counter() - start
            )
        out: list[DeviceLease | None] = []
        for p in placed:
            if p is None:
                out.append(None)
                continue
            lease, res, hit = p
            offset = res.runs[0][0] * pool.page_bytes if res.contiguous and res.runs else None
            if res.npages == 0:
                offset = 0
            out.append(
                DeviceLease(
                    lease,
                    pool.pool_id,
                    pool.gpu_uuid,
                    pool.page_bytes,
                    tuple(pool.page_ids(res)),
                    offset,
                    hit,
                )
            )
        return out, table

    def _load(self, pool: DevicePool, loads: list[tuple[Entry, Residency]]) -> None:
        """One ``transfer_ranges`` call gathers every entry of the batch host -> device."""
        host = self._engine.host_pool
        plan = PlanBuilder(16)
        page = host.page_bytes
        for entry, res in loads:
            src = [(s * page, k * page) for s, k in entry.runs]
            plan.add(src, pool.byte_runs(res), entry.nbytes)
        if len(plan):
            s, d, n = plan.rows()
            self._transfer(host.tensor.view(-1, 16), pool.tensor.view(-1, 16), s, d, n, pool.stream)
        pool.bind([res for _, res in loads])  # one table launch for the whole batch
        event = self._record(pool.stream)
        for _, res in loads:
            res.event = event
        self._engine._count_copy("h2d", plan.nbytes)

    def _read_table(self, pool: DevicePool, placed: list[Placed | None]) -> torch.Tensor:
        """Physical pages per found key, built on the device by ``build_read_table``."""
        found = [p for p in placed if p is not None]
        bs = len(found)
        max_pages = max((res.npages for _, res, _ in found), default=0)
        vtable = torch.full((bs, max(max_pages, 1)), -1, dtype=torch.int64)
        for b, (_, res, _) in enumerate(found):
            vtable[b, : res.npages] = torch.arange(res.vstart, res.vstart + res.npages)
        lengths = torch.tensor([lease.nbytes for lease, _, _ in found], dtype=torch.int64)
        out = torch.full((bs, max(max_pages, 1)), -1, dtype=torch.int64, device=pool.device)
        with pool._on_stream():
            kernels.build_read_table(
                vtable.to(pool.device),
                torch.arange(bs, device=pool.device),
                lengths.to(pool.device),
                pool.v2p,
                out,
                pool.page_bytes,
            )
        if pool.stream is not None:  # the caller reads the table on its own stream
            torch.cuda.current_stream(pool.device).wait_stream(pool.stream)
        return out

    # -- get into a client buffer --------------------------------------------------------
    def get_into(
        self,
        keys: Sequence[str],
        owner: str,
        dest: torch.Tensor,
        offsets: Sequence[int],
        *,
        device: int | None,
    ) -> list[Lease | None]:
        """Copy each found entry to ``dest[offsets[i]:]`` (flat uint8); leases end after."""
        e = self._engine
        if len(offsets) != len(keys):
            raise InvalidArgument("one offset per key", keys=len(keys), offsets=len(offsets))
        if dest.dim() != 1 or dest.dtype != torch.uint8 or not dest.is_contiguous():
            raise InvalidArgument("destination must be a flat contiguous uint8 buffer")
        pool = self.pool(device) if device is not None else None
        e.fill_misses(keys)
        with e._lock:
            leases = e._get(keys, owner)
            try:
                self._check_slots(leases, offsets, dest.numel())
                stream = self._queue_into(pool, leases, dest, offsets)
            except BaseException:
                e.release(x.lease_id for x in leases if x is not None)
                raise
        try:
            start = time.perf_counter()
            if stream is not None:
                stream.synchronize()
            self._observe("h2d", sum(x.nbytes for x in leases if x), time.perf_counter() - start)
        finally:
            e.release(x.lease_id for x in leases if x is not None)
        return leases

    @staticmethod
    def _check_slots(leases: list[Lease | None], offsets: Sequence[int], size: int) -> None:
        spans = []
        for lease, off in zip(leases, offsets, strict=True):
            if lease is None:
                continue
            if off < 0 or off + lease.nbytes > size:
                raise InvalidArgument(
                    "entry does not fit the destination at its offset",
                    key=lease.key,
                    offset=off,
                    nbytes=lease.nbytes,
                    destination_bytes=size,
                )
            spans.append((off, off + lease.nbytes, lease.key))
        spans.sort()
        for (_, end, k1), (start, _, k2) in itertools.pairwise(spans):
            if start < end:
                raise InvalidArgument("destination slots overlap", keys=[k1, k2])

    def _queue_into(
        self,
        pool: DevicePool | None,
        leases: list[Lease | None],
        dest: torch.Tensor,
        offsets: Sequence[int],
    ) -> torch.cuda.Stream | None:
        found = [(x, off) for x, off in zip(leases, offsets, strict=True) if x is not None]
        row = row_bytes_for(
            dest.data_ptr(), *(off for _, off in found), *(x.nbytes for x, _ in found)
        )
        host_plan, dev_plan = PlanBuilder(row), PlanBuilder(row)
        for lease, off in found:
            res = pool.lookup(lease.entry) if pool is not None else None
            if res is not None and res.event is not None and not res.event.query():
                res = None  # still loading: read the host copy instead of waiting
            if pool is not None and res is not None:
                dev_plan.add(pool.byte_runs(res), [(off, lease.nbytes)], lease.nbytes)
            else:
                page = self._engine.host_pool.page_bytes
                src = [(s * page, k * page) for s, k in lease.entry.runs]
                host_plan.add(src, [(off, lease.nbytes)], lease.nbytes)
        stream = pool.stream if pool is not None else self._stream_for(dest)
        if stream is not None:  # in-process callers may still be writing dest on their stream
            stream.wait_stream(torch.cuda.current_stream(dest.device))
        dview = dest[: dest.numel() // row * row].view(-1, row)
        if len(host_plan):
            s, d, n = host_plan.rows()
            self._transfer(self._engine.host_pool.tensor.view(-1, row), dview, s, d, n, stream)
            self._engine._count_copy("h2d", host_plan.nbytes)
        if len(dev_plan):
            assert pool is not None
            src = pool.tensor.view(-1, row)
            s, d, n = dev_plan.rows()
            with pool._on_stream():
                for si, di, ni in zip(s.tolist(), d.tolist(), n.tolist(), strict=True):
                    dview[di : di + ni].copy_(src[si : si + ni], non_blocking=True)
            self._engine._count_copy("d2d", dev_plan.nbytes)
        return stream

    # -- put from device -----------------------------------------------------------------
    def put_from_device(
        self, key: str, src: torch.Tensor, owner: str, checksum: int | None
    ) -> bool:
        """Copy a device tensor into a new entry; returns once the bytes are in the pool."""
        dt = from_torch(src.dtype)
        if dt is None:
            raise InvalidArgument("unsupported dtype", dtype=str(src.dtype))
        if not src.is_contiguous():
            raise InvalidArgument("source tensor must be contiguous")
        e = self._engine
        handle = e.begin_put(key, dt.name, tuple(src.shape), owner=owner, checksum=checksum)
        with handle:
            if handle.exists_already:
                handle.skip_bytes()
                return handle.commit()
            nbytes = handle.nbytes
            flat = src.reshape(-1).view(torch.uint8)
            row = row_bytes_for(flat.data_ptr(), nbytes)
            page = e.host_pool.page_bytes

            def copy(_byte_runs: object) -> None:
                plan = PlanBuilder(row)
                plan.add(
                    [(0, nbytes)], [(s * page, k * page) for s, k in handle.entry.runs], nbytes
                )
                if not len(plan):
                    return
                stream = self._stream_for(src)
                if stream is not None:  # an in-process producer may still be writing src
                    stream.wait_stream(torch.cuda.current_stream(src.device))
                s, d, n = plan.rows()
                start = time.perf_counter()
                self._transfer(
                    flat.view(-1, row), e.host_pool.tensor.view(-1, row), s, d, n, stream
                )
                if stream is not None:
                    stream.synchronize()
                self._observe("d2h", nbytes, time.perf_counter() - start)
                e._count_copy("d2h", nbytes)

            handle.fill_with(copy)
            return handle.commit()

    # -- plumbing ------------------------------------------------------------------------
    def _transfer(
        self,
        src: torch.Tensor,
        dst: torch.Tensor,
        s: np.ndarray,
        d: np.ndarray,
        n: np.ndarray,
        stream: torch.cuda.Stream | None,
    ) -> None:
        cfg = self._config
        on_cuda = src.device.type == "cuda" or dst.device.type == "cuda"
        backend = self._engine.settings.copy_backend if on_cuda else "torch"
        kernels.transfer_ranges(
            src,
            dst,
            s,
            d,
            n,
            stream=stream,
            backend=backend,
            host_registered=self._engine.host_pool.registered,
            config=cfg,
        )

    def _stream_for(self, t: torch.Tensor) -> torch.cuda.Stream | None:
        if t.device.type != "cuda":
            return None
        index = t.device.index or 0
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
        for pool in self.pools:
            pool.close()
