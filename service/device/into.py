"""Get-into: copies of leased entries into a buffer a client registered.

Each entry comes from its copy in the device pool when it is resident there (and loaded),
else from the host pool. Every slot is checked against the destination and the others
before anything is copied.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from embcache.errors import InvalidArgument
from embcache.service.device.copier import Copier
from embcache.service.device.copy_plan import PlanBuilder, row_bytes_for
from embcache.service.device.pool import DevicePool
from embcache.service.host.leases import Lease


def check_destination(dest: torch.Tensor, keys: int, offsets: int) -> None:
    """A get-into's destination: a flat contiguous uint8 buffer and one offset per key."""
    if offsets != keys:
        raise InvalidArgument("one offset per key", keys=keys, offsets=offsets)
    if dest.dim() != 1 or dest.dtype != torch.uint8 or not dest.is_contiguous():
        raise InvalidArgument("destination must be a flat contiguous uint8 buffer")


def queue_into(
    copier: Copier,
    pool: DevicePool | None,
    leases: Sequence[Lease | None],
    dest: torch.Tensor,
    offsets: Sequence[int],
) -> torch.cuda.Stream | None:
    """Check every slot, then queue the copies of the leased entries to
    ``dest[offsets[i]:]``; returns the stream to wait on (None: copied already)."""
    _check_slots(leases, offsets, dest.numel())
    return _queue(copier, pool, leases, dest, offsets)


def _check_slots(leases: Sequence[Lease | None], offsets: Sequence[int], size: int) -> None:
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


def _queue(
    copier: Copier,
    pool: DevicePool | None,
    leases: Sequence[Lease | None],
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
            page = copier.host.page_bytes
            src = [(s * page, k * page) for s, k in lease.entry.runs]
            host_plan.add(src, [(off, lease.nbytes)], lease.nbytes)
    stream = pool.stream if pool is not None else copier.stream_for(dest)
    if stream is not None:  # in-process callers may still be writing dest on their stream
        stream.wait_stream(torch.cuda.current_stream(dest.device))
    dview = dest[: dest.numel() // row * row].view(-1, row)
    if len(host_plan):
        s, d, n = host_plan.rows()
        copier.transfer(copier.host.tensor.view(-1, row), dview, s, d, n, stream)
        copier.count("h2d", host_plan.nbytes)
    if len(dev_plan):
        assert pool is not None
        src = pool.tensor.view(-1, row)
        s, d, n = dev_plan.rows()
        with pool.on_stream():
            for si, di, ni in zip(s.tolist(), d.tolist(), n.tolist(), strict=True):
                dview[di : di + ni].copy_(src[si : si + ni], non_blocking=True)
        copier.count("d2d", dev_plan.nbytes)
    return stream
