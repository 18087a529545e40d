"""How a get-to-device fills the device pages it reserved: the copies from the host pool
(or a peer GPU) queued on the pool's stream, and the batch's page table built on the device.
Called by :class:`~embcache.service.device.tier.DeviceTier` under the engine lock."""

from __future__ import annotations

import numpy as np
import torch

from embcache import kernels
from embcache.service.device.copier import Copier
from embcache.service.device.copy_plan import entry_columns, plan_entries
from embcache.service.device.pool import DevicePool
from embcache.service.device.residency import Residency
from embcache.service.device.routing import PeerRates, copy_between_pools
from embcache.service.device.table_updates import upload
from embcache.service.host.entries import Entry

ROW = 16  # bytes per row of the host->device plans (pages are multiples of it)
# A batch of at least twice this many bytes is reserved and queued in two parts: its first
# entries (this many bytes or more), then the rest, whose pages, plan and checks are made on
# the host while the copy engine moves the first part (see load()).
HEAD_BYTES = 16 << 20


def load(
    copier: Copier,
    rates: PeerRates,
    pools: list[DevicePool],
    pool: DevicePool,
    todo: list[Entry],
    loads: list[tuple[Entry, Residency]],
) -> dict[str, int] | None:
    """Reserve device pages for ``todo`` (found entries with no copy in ``pool``, pinned by
    the caller) and queue their copies: from the host with one planned copy per part (two
    parts for a large batch, :func:`_head_and_tail`; ``kernels.transfer_planned``: no checks),
    from a faster peer GPU where one holds the entry. Appends each reserved ``(entry,
    residency)`` to ``loads`` as it is made, so a caller that fails later knows what to
    drop. None: the pool cannot hold the batch (the parts reserved before are in
    ``loads``)."""
    copied = {"h2d": 0, "d2d": 0}
    # Each part's copy is queued as soon as its pages are picked, so the copy engine starts
    # after the head's bookkeeping, not the whole batch's; the tail's pages, plan and checks
    # are made while it copies. The pins keep the head's entries (and so its fresh pages)
    # from the tail's evictions. The table updates (tombstones of this batch's evictions,
    # then one bind launch) are queued behind the copies, by the caller's flush. Stream
    # order keeps that safe: a copy writes pages no reader holds (freed pages, read only by
    # earlier work on this stream), and copies never read the tables. One copy call per
    # part, not one per entry: per-entry calls gained nothing and lost on fragmented
    # device pages (docs/device.md, "Engine API").
    for part in _head_and_tail(todo):
        fresh = pool.reserve_batch(part)
        if fresh is None:
            return None
        reserved = list(zip(part, fresh, strict=True))
        loads.extend(reserved)
        _queue_copies(copier, rates, pools, pool, reserved, copied)
    event = copier.record(pool.stream)  # what the results wait for: the copies only
    for _, res in loads:
        res.event = event
    pool.bind([res for _, res in loads])  # one table launch for the whole batch
    copier.count("h2d", copied["h2d"])
    copier.count("d2d", copied["d2d"])
    return copied


def _head_and_tail(batch: list[Entry]) -> list[list[Entry]]:
    """``batch`` as one part, or as its leading entries that hold ``HEAD_BYTES`` and the
    rest, when both parts would hold at least that much."""
    total = sum(entry.nbytes for entry in batch)
    if HEAD_BYTES <= 0 or total < 2 * HEAD_BYTES:
        return [batch] if batch else []
    head, cut = 0, len(batch)
    for i, entry in enumerate(batch):
        head += entry.nbytes
        if head >= HEAD_BYTES:
            cut = i + 1
            break
    if total - head < HEAD_BYTES:
        return [batch]
    return [batch[:cut], batch[cut:]]


def _queue_copies(
    copier: Copier,
    rates: PeerRates,
    pools: list[DevicePool],
    pool: DevicePool,
    reserved: list[tuple[Entry, Residency]],
    copied: dict[str, int],
) -> None:
    """Queue the copies that fill ``reserved``: one ``transfer_ranges`` call for those from
    the host, one queue per peer GPU for those a faster peer holds; adds their bytes to
    ``copied``."""
    from_host: list[tuple[Entry, Residency]] = []
    from_peers: dict[int, list[tuple[Residency, Residency, int]]] = {}
    for entry, res in reserved:
        src_index = rates.best_source(entry, pool.index, pools)
        if src_index is None:
            if entry.nbytes:
                from_host.append((entry, res))
                copied["h2d"] += entry.nbytes
            continue
        src_res = pools[src_index].peek(entry)
        assert src_res is not None
        from_peers.setdefault(src_index, []).append((src_res, res, entry.nbytes))
        copied["d2d"] += entry.nbytes
    if from_host:
        _copy_from_host(copier, pool, from_host)
    for src_index, items in from_peers.items():  # one queue of copies per source GPU
        copy_between_pools(pools[src_index], pool, items)


def host_columns(entry: Entry, page_bytes: int) -> np.ndarray:
    """``entry``'s host page runs as :func:`~.copy_plan.entry_columns` in ``ROW``-byte rows,
    made once and kept with the entry (its runs never change): at commit when the daemon has
    a device pool (``DeviceTier.prepare``), else at the first copy that needs them."""
    if entry.host_cols is None:
        entry.host_cols = entry_columns(entry.runs, page_bytes, entry.nbytes, ROW)
    return entry.host_cols


def _copy_from_host(copier: Copier, pool: DevicePool, batch: list[tuple[Entry, Residency]]) -> None:
    """One copy of a plan made here (``kernels.transfer_planned``, without
    ``transfer_ranges``' checks): host page runs against the residencies' device page runs,
    each entry padded to 16-byte rows."""
    host = copier.host
    cols = [host_columns(entry, host.page_bytes) for entry, _ in batch]
    so, do, ln = plan_entries(
        cols,
        [r.runs for _, r in batch],
        pool.page_bytes,
        ROW,
        [-(-e.nbytes // ROW) for e, _ in batch],
    )
    copier.transfer(host.rows, pool.rows, so, do, ln, pool.stream, checked=False)


def read_table(pool: DevicePool, found: list[tuple[Entry, Residency]]) -> torch.Tensor:
    """Physical pages per found entry, built on the device by ``build_read_table`` from the
    tables, which are brought up to date first."""
    pool.flush()
    bs = len(found)
    max_pages = max((res.npages for _, res in found), default=0)
    vtable = torch.full((bs, max(max_pages, 1)), -1, dtype=torch.int64)
    for b, (_, res) in enumerate(found):
        vtable[b, : res.npages] = torch.arange(res.vstart, res.vstart + res.npages)
    lengths = torch.tensor([entry.nbytes for entry, _ in found], dtype=torch.int64)
    out = torch.full((bs, max(max_pages, 1)), -1, dtype=torch.int64, device=pool.device)
    with pool.on_stream():
        kernels.build_read_table(
            upload(vtable, pool.device),
            torch.arange(bs, device=pool.device),
            upload(lengths, pool.device),
            pool.v2p,
            out,
            pool.page_bytes,
        )
    if pool.stream is not None:  # the caller reads the table on its own stream
        torch.cuda.current_stream(pool.device).wait_stream(pool.stream)
    return out
