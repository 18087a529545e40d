"""Get-into: copies of leased entries into a buffer a client registered.

Each entry comes from its copy in the device pool when it is resident there (and loaded),
else from the host pool. Every slot is checked against the destination and the others
before anything is copied.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch

from embcache.errors import InvalidArgument
from embcache.service.device.copier import Copier
from embcache.service.device.copy_plan import entry_columns, row_bytes_for, truncate_runs
from embcache.service.device.loads import ROW, host_columns
from embcache.service.device.pool import DevicePool
from embcache.service.host.entries import Entry
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
    *,
    dest_ready: bool = False,
) -> torch.cuda.Stream | None:
    """Check every slot, then queue the copies of the leased entries to
    ``dest[offsets[i]:]``; returns the stream to wait on (None: copied already).

    ``dest_ready``: nothing in this process writes ``dest`` on its current stream (a
    client's buffer, which the client's own event orders), so the copies follow nothing;
    otherwise they follow the work queued on the current stream so far."""
    _check_slots(leases, offsets, dest.numel())
    return _queue(copier, pool, leases, dest, offsets, dest_ready)


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
    dest_ready: bool,
) -> torch.cuda.Stream | None:
    found = [(x, off) for x, off in zip(leases, offsets, strict=True) if x is not None and x.nbytes]
    from_host: list[tuple[Entry, int]] = []
    from_pool: list[tuple[list[tuple[int, int]], int, int]] = []  # (byte runs, offset, nbytes)
    for lease, off in found:
        res = pool.lookup(lease.entry) if pool is not None else None
        if res is not None and res.event is not None and not res.event.query():
            res = None  # still loading: read the host copy instead of waiting
        if pool is not None and res is not None:
            from_pool.append((pool.byte_runs(res), off, lease.nbytes))
        else:
            from_host.append((lease.entry, off))
    stream = pool.stream if pool is not None else copier.stream_for(dest)
    if stream is not None and not dest_ready:  # this process may still write dest
        stream.wait_stream(torch.cuda.current_stream(dest.device))
    if from_host:
        _copy_from_host(copier, from_host, dest, stream)
    if from_pool:
        assert pool is not None
        with pool.on_stream():
            for runs, off, nbytes in from_pool:
                for start, length in truncate_runs(runs, nbytes):
                    dest[off : off + length].copy_(
                        pool.tensor[start : start + length], non_blocking=True
                    )
                    off += length
        copier.count("d2d", sum(n for _, _, n in from_pool))
    return stream


def _copy_from_host(
    copier: Copier,
    items: list[tuple[Entry, int]],
    dest: torch.Tensor,
    stream: torch.cuda.Stream | None,
) -> None:
    """One copy of the host page runs of ``items`` (entry, byte offset in ``dest``), planned
    here in the widest row that divides every address, offset and size: each host run is one
    piece, since the destination of an entry is contiguous. The slots were checked and the
    runs are the allocator's, so the copy skips ``transfer_ranges``' checks."""
    host = copier.host
    row = row_bytes_for(dest.data_ptr(), *(off for _, off in items), *(e.nbytes for e, _ in items))
    cols = []
    for entry, off in items:
        if row == ROW:  # the usual case: the entry's columns, planned when it was committed
            c = host_columns(entry, host.page_bytes)
        else:
            c = entry_columns(entry.runs, host.page_bytes, entry.nbytes, row)
        cols.append((c[0], c[2] + off // row, c[1]))
    if len(cols) == 1:
        s, d, n = cols[0]
    else:
        s, d, n = (np.concatenate(parts) for parts in zip(*cols, strict=True))
    src = host.rows if row == ROW else host.tensor.view(-1, row)
    dview = dest[: dest.numel() // row * row].view(-1, row)
    copier.transfer(src, dview, s, d, n, stream, checked=False)
    copier.count("h2d", sum(e.nbytes for e, _ in items))
