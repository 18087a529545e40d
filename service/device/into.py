"""Device copies that move bytes for a client, not into the device tier.

``get_into`` copies entries into a buffer the client registered (from the device pool when
an entry is resident there, else from the host pool). Puts from a client's device tensor
are in ``pending_put.py``.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from embcache.errors import InvalidArgument
from embcache.service.device.copy_plan import PlanBuilder, row_bytes_for
from embcache.service.device.pool import DevicePool
from embcache.service.host.leases import Lease

if TYPE_CHECKING:
    from embcache.service.device.tier import DeviceTier


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
