"""Device copies that move bytes for a client, not into the device tier.

``get_into`` copies entries into a buffer the client registered (from the device pool when
an entry is resident there, else from the host pool); ``put_from_device`` copies a client's
device tensor into a new entry of the host pool.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from embcache import kernels

from .copy_plan import PlanBuilder, row_bytes_for
from .device_pool import DevicePool
from .dtypes import from_torch
from .errors import InvalidArgument
from .leases import Lease

if TYPE_CHECKING:
    from .device_tier import DeviceTier


def get_into(
    tier: DeviceTier,
    keys: Sequence[str],
    owner: str,
    dest: torch.Tensor,
    offsets: Sequence[int],
    *,
    device: int | None,
) -> list[Lease | None]:
    """Copy each found entry to ``dest[offsets[i]:]`` (flat uint8); leases end after."""
    e = tier._engine
    if len(offsets) != len(keys):
        raise InvalidArgument("one offset per key", keys=len(keys), offsets=len(offsets))
    if dest.dim() != 1 or dest.dtype != torch.uint8 or not dest.is_contiguous():
        raise InvalidArgument("destination must be a flat contiguous uint8 buffer")
    pool = tier.pool(device) if device is not None else None
    e.fill_misses(keys)
    with e._lock:
        leases = e._get(keys, owner)
        try:
            _check_slots(leases, offsets, dest.numel())
            stream = _queue_into(tier, pool, leases, dest, offsets)
        except BaseException:
            e.release(x.lease_id for x in leases if x is not None)
            raise
    try:
        start = time.perf_counter()
        if stream is not None:
            stream.synchronize()
        tier._observe("h2d", sum(x.nbytes for x in leases if x), time.perf_counter() - start)
    finally:
        e.release(x.lease_id for x in leases if x is not None)
    return leases


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
    tier: DeviceTier,
    pool: DevicePool | None,
    leases: list[Lease | None],
    dest: torch.Tensor,
    offsets: Sequence[int],
) -> torch.cuda.Stream | None:
    found = [(x, off) for x, off in zip(leases, offsets, strict=True) if x is not None]
    row = row_bytes_for(dest.data_ptr(), *(off for _, off in found), *(x.nbytes for x, _ in found))
    host_plan, dev_plan = PlanBuilder(row), PlanBuilder(row)
    for lease, off in found:
        res = pool.lookup(lease.entry) if pool is not None else None
        if res is not None and res.event is not None and not res.event.query():
            res = None  # still loading: read the host copy instead of waiting
        if pool is not None and res is not None:
            dev_plan.add(pool.byte_runs(res), [(off, lease.nbytes)], lease.nbytes)
        else:
            page = tier._engine.host_pool.page_bytes
            src = [(s * page, k * page) for s, k in lease.entry.runs]
            host_plan.add(src, [(off, lease.nbytes)], lease.nbytes)
    stream = pool.stream if pool is not None else tier._stream_for(dest)
    if stream is not None:  # in-process callers may still be writing dest on their stream
        stream.wait_stream(torch.cuda.current_stream(dest.device))
    dview = dest[: dest.numel() // row * row].view(-1, row)
    if len(host_plan):
        s, d, n = host_plan.rows()
        tier._transfer(tier._engine.host_pool.tensor.view(-1, row), dview, s, d, n, stream)
        tier._engine._count_copy("h2d", host_plan.nbytes)
    if len(dev_plan):
        assert pool is not None
        src = pool.tensor.view(-1, row)
        s, d, n = dev_plan.rows()
        with pool._on_stream():
            for si, di, ni in zip(s.tolist(), d.tolist(), n.tolist(), strict=True):
                dview[di : di + ni].copy_(src[si : si + ni], non_blocking=True)
        tier._engine._count_copy("d2d", dev_plan.nbytes)
    return stream


def put_from_device(
    tier: DeviceTier, key: str, src: torch.Tensor, owner: str, checksum: int | None
) -> bool:
    """Copy a device tensor into a new entry; returns once the bytes are in the pool."""
    return put_from_device_many(tier, [(key, src)], owner, [checksum])[0]


def put_from_device_many(
    tier: DeviceTier,
    items: Sequence[tuple[str, torch.Tensor]],
    owner: str,
    checksums: Sequence[int | None] | None = None,
) -> list[bool]:
    """Copy several device tensors into new entries; returns once all their bytes are in
    the pool. Each copy is queued as soon as its pages are reserved, so the copy engine
    moves one tensor while the next is being reserved and planned, and the batch waits once.
    ``checksums``: a CRC32 (or None) per item, checked once the copies are done. All or
    nothing: if any put fails, none of the batch becomes visible."""
    if len(items) > 1 and len({key for key, _ in items}) != len(items):
        raise InvalidArgument("a key appears more than once in the batch")
    if checksums is None:
        checksums = [None] * len(items)
    elif len(checksums) != len(items):
        raise InvalidArgument("one checksum per item", items=len(items), checksums=len(checksums))
    dtypes = [_source_dtype(src) for _, src in items]
    e = tier._engine
    start = time.perf_counter()
    streams: dict[int, torch.cuda.Stream] = {}
    nbytes = 0
    with contextlib.ExitStack() as stack:  # aborts every put not committed when it unwinds
        handles = []
        try:
            for (key, src), dtype, crc in zip(items, dtypes, checksums, strict=True):
                handle = e.begin_put(key, dtype, tuple(src.shape), owner=owner, checksum=crc)
                stack.enter_context(handle)
                handles.append(handle)
                if handle.exists_already:
                    handle.skip_bytes()
                    continue

                def copy(byte_runs: tuple[tuple[int, int], ...], src: torch.Tensor = src) -> None:
                    stream = _queue_d2h(tier, src, byte_runs)
                    if stream is not None:
                        streams[id(stream)] = stream

                handle.fill_with(copy, complete=False)
                nbytes += handle.nbytes
            for handle in handles:  # while the copies run: what a first get needs planned
                if not handle.exists_already:
                    tier.prepare(handle.entry)
        finally:
            # Before anything is aborted too: freed pages must not still be copied into.
            for stream in streams.values():
                stream.synchronize()
        _count_d2h(tier, nbytes, start)
        for handle in handles:  # every checksum before any commit: all or nothing
            handle.filled()
        return [handle.commit() for handle in handles]


def _source_dtype(src: torch.Tensor) -> str:
    """The dtype name of a tensor a put may copy from; InvalidArgument if it may not."""
    dt = from_torch(src.dtype)
    if dt is None:
        raise InvalidArgument("unsupported dtype", dtype=str(src.dtype))
    if not src.is_contiguous():
        raise InvalidArgument("source tensor must be contiguous")
    return dt.name


def _queue_d2h(
    tier: DeviceTier, src: torch.Tensor, byte_runs: tuple[tuple[int, int], ...]
) -> torch.cuda.Stream | None:
    """Queue the copy of contiguous ``src`` into the host byte runs (filled in order) and
    return the stream it runs on (None: done already, a CPU tensor, or no bytes).

    Runs of copy-engine size go straight to the copy engine (``copy_to_host_runs``: a put
    waits for its copy, so the host time before it counts); small runs, or a backend forced
    in the settings, take ``transfer_ranges``' general path."""
    total = sum(n for _, n in byte_runs)
    if not total:
        return None
    host = tier._engine.host_pool
    stream = tier._stream_for(src)
    if stream is not None:
        # An in-process producer may still be writing src on its stream: the copy waits for
        # that stream's work, unless it has none left (a query costs less than a wait).
        current = torch.cuda.current_stream(src.get_device())
        if not current.query():
            stream.wait_stream(current)
    big = len(byte_runs) == 1 or total >= len(byte_runs) * tier._config.copy_engine_from_bytes
    if tier._engine.settings.copy_backend == "auto" and big:
        kernels.copy_to_host_runs(
            src, host.tensor, list(byte_runs), stream=stream, host_registered=host.registered
        )
        return stream
    flat = src.reshape(-1).view(torch.uint8)
    row = row_bytes_for(flat.data_ptr(), total, *(off for off, _ in byte_runs))
    lengths = np.array([n for _, n in byte_runs], dtype=np.int64)
    dst_rows = np.array([off for off, _ in byte_runs], dtype=np.int64) // row
    src_rows = (np.cumsum(lengths) - lengths) // row
    tier._transfer(
        flat.view(-1, row), host.tensor.view(-1, row), src_rows, dst_rows, lengths // row, stream
    )
    return stream


def _count_d2h(tier: DeviceTier, nbytes: int, start: float) -> None:
    if nbytes:
        tier._observe("d2h", nbytes, time.perf_counter() - start)
        tier._engine._count_copy("d2h", nbytes)
