"""Get replies with device locations turned into tensors on the GPU.

Lifetimes (see docs/grpc.md): by default every entry is copied out of the daemon's device
pool into a tensor the caller owns (one gather of whole pages on the current stream for the
whole reply), so a write never reaches the pool, and an event recorded after the copies says
when the leases may end. With ``owned=False`` (``get(..., zero_copy=True)``) a contiguous
entry is a view of the pool instead, on an anchor of its own (``anchors.py``) whose lifetime
ends its lease; fragmented entries are gathered either way. Before a view's lease ends the
client waits for the work queued on the device (the current stream at the end of a block,
the whole device for views that went later), so no kernel still reads pages that the daemon
may reuse. Work on other streams at the end of a block is the caller's to finish.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch

from embcache.clients.device.anchors import anchored_view
from embcache.clients.device.gathers import PageGather, plan_gather
from embcache.clients.device.host_replies import Decoded
from embcache.clients.device.pools import DevicePoolCache, DevicePoolHandle
from embcache.proto.dtypes import torch_dtype
from embcache.proto.embcache.v1 import embcache_pb2 as pb

log = logging.getLogger(__name__)

CLONE_MAX = 2  # owned contiguous entries of a reply this small are copied one by one


class PoolOpenError(RuntimeError):
    """A device pool named in a reply cannot be opened in this process."""


class EventOpenError(RuntimeError):
    """The ready event of a reply cannot be opened in this process: ask without one."""


def pool_handle(pool: pb.PoolHandle) -> DevicePoolHandle:
    """The client-side description of a ``DevicePool`` from a Get reply."""
    if pool.WhichOneof("kind") != "device":
        raise ValueError(f"pool {pool.pool_id!r} is not a device pool")
    d = pool.device
    kind = d.WhichOneof("handle")
    if kind == "ipc_handle":
        return DevicePoolHandle(pool.pool_id, d.gpu_uuid, d.size, d.page_bytes, d.ipc_handle)
    if kind == "posix_fd":
        fd = d.posix_fd
        if fd.alloc_size < d.size or not fd.fd_socket:
            raise ValueError(f"pool {pool.pool_id!r}: bad posix_fd handle")
        return DevicePoolHandle(
            pool.pool_id,
            d.gpu_uuid,
            fd.alloc_size,
            d.page_bytes,
            fd_socket=fd.fd_socket,
            fd_token=fd.fd_token,
        )
    return DevicePoolHandle(pool.pool_id, d.gpu_uuid, d.size, d.page_bytes)  # no IPC (test pool)


def decode_device_get(
    reply: pb.GetResponse, cache: DevicePoolCache, *, owned: bool = True
) -> Decoded:
    """Tensors for a Get with a GPU uuid; each pool is opened once through ``cache``.
    ``owned``: every entry is copied into memory the caller owns; the fragmented entries of
    a pool (and, owned, the contiguous ones on page boundaries, in replies of more than
    ``CLONE_MAX`` results) are gathered together (one upload and one launch:
    :func:`plan_gather`), the other contiguous ones copied alone, and ``ready`` is an event
    after the copies on a GPU. Otherwise contiguous entries are anchored views
    (``anchors``). The page ids of a batch are checked and cut into runs with numpy, and
    each tensor is made with one ``as_strided``, so the Python work per entry stays small."""
    decode = _DeviceDecode(reply, cache, owned, {p.pool_id: p for p in reply.pools})
    for result in reply.results:
        decode.add(result)
    return decode.finish(decode.plan())


@dataclass(slots=True)
class _DeviceDecode:
    """One reply being decoded: the entries placed so far, and the copies still to run."""

    reply: pb.GetResponse
    cache: DevicePoolCache
    owned: bool
    described: dict[str, pb.PoolHandle]  # the reply's pools, by id
    out: Decoded = field(default_factory=lambda: Decoded([], []))
    gathers: dict[str, _Gather] = field(default_factory=dict)  # by pool id
    opened: dict[str, tuple[torch.Tensor, int]] = field(default_factory=dict)  # pool, page size
    typed: _Typed = field(default_factory=dict)
    # (slot, pool, offset, meta) of contiguous entries copied alone, after the wait
    clones: list[tuple[int, torch.Tensor, int, pb.TensorMeta]] = field(default_factory=list)

    def add(self, result: pb.GetResult) -> None:
        """Place one result: a miss, a view, a copy made alone, or a part of a gather."""
        out = self.out
        if not result.found:
            out.tensors.append(None)
            return
        out.lease_ids.append(result.lease_id)
        out.anchors.append(None)
        pool, page_bytes = self._pool(result)
        contiguous = result.device.WhichOneof("placement") == "offset"
        if contiguous and self._contiguous(result, pool, page_bytes):
            return
        self._gather(result, page_bytes)

    def _pool(self, result: pb.GetResult) -> tuple[torch.Tensor, int]:
        """The pool ``result`` lies in, opened once per reply, and its page size."""
        pool_id = result.device.pool_id
        described = self.described
        if result.WhichOneof("location") != "device" or pool_id not in described:
            raise ValueError(f"reply for {result.key!r} names no device pool this client knows")
        if pool_id not in self.opened:
            desc = described[pool_id]
            handle = pool_handle(desc)
            try:
                pool = self.cache.pool_tensor(handle, desc.device.size)
            except (OSError, RuntimeError) as exc:
                raise PoolOpenError(f"cannot open device pool {pool_id}: {exc}") from exc
            self.opened[pool_id] = (pool, handle.page_bytes)
        return self.opened[pool_id]

    def _contiguous(self, result: pb.GetResult, pool: torch.Tensor, page_bytes: int) -> bool:
        """Place a contiguous entry as a view or a copy made alone; False: it joins the
        gather (owned, on page boundaries, in a reply of more than ``CLONE_MAX``)."""
        out, meta, offset = self.out, result.meta, result.device.offset
        if offset + meta.nbytes > pool.numel() or offset < 0:
            raise ValueError(f"reply for {result.key!r} has a location outside the pool")
        if not meta.nbytes:  # nothing to read: an empty view
            out.tensors.append(_view(pool, offset, meta, self.typed))
        elif not self.owned:  # zero-copy: a view with an anchor of its own
            flat, out.anchors[-1] = anchored_view(pool, offset, meta.nbytes)
            out.tensors.append(_view(flat, 0, meta, self.typed))
        elif page_bytes <= 0 or offset % page_bytes or len(self.reply.results) <= CLONE_MAX:
            # A reply of a few entries copies its contiguous ones alone (one copy call each,
            # no ids to place); more go into the gather, one launch for all.
            self.clones.append((len(out.tensors), pool, offset, meta))
            out.tensors.append(None)  # filled by finish()
        else:
            return False
        return True

    def _gather(self, result: pb.GetResult, page_bytes: int) -> None:
        """Add the pages of ``result`` to its pool's gather."""
        loc, meta = result.device, result.meta
        g = self.gathers.get(loc.pool_id)
        if g is None:
            g = self.gathers[loc.pool_id] = _Gather()
        before = len(g.pages)
        if loc.WhichOneof("placement") != "offset":
            g.pages.extend(loc.pages.page_ids)
        else:  # a contiguous entry, owned: its pages join the gather
            first = loc.offset // page_bytes
            g.pages.extend(range(first, first - (-meta.nbytes // page_bytes)))
        if (len(g.pages) - before) * page_bytes < meta.nbytes:
            raise ValueError(f"reply for {result.key!r} has a location outside the pool")
        g.counts.append(len(g.pages) - before)
        g.items.append((len(self.out.tensors), result))
        self.out.tensors.append(None)  # filled by finish()

    def plan(self) -> list[tuple[_Gather, PageGather]]:
        """Place the page ids of every gather, then have this device's stream wait for the
        daemon's copies (the reply's ready event); nothing is left placed on failure."""
        planned: list[tuple[_Gather, PageGather]] = []  # ids placed before the wait below
        try:
            for pool_id, g in self.gathers.items():
                planned.append((g, self._plan_one(pool_id, g)))
            self._wait_ready()
        except BaseException:
            for _, gather in planned:  # nothing will read their ids
                gather.abandon()
            raise
        return planned

    def _plan_one(self, pool_id: str, g: _Gather) -> PageGather:
        pool, page_bytes = self.opened[pool_id]
        sizes = [r.meta.nbytes for _, r in g.items]
        try:
            return plan_gather(pool, page_bytes, g.pages, g.counts, sizes)
        except ValueError:  # a page outside the pool: name the entry
            num_pages = pool.numel() // page_bytes if page_bytes > 0 else 0
            bad = next((r for _, r in g.items if not _pages_inside(r, num_pages)), None)
            if bad is None:
                raise
            raise ValueError(f"reply for {bad.key!r} has a location outside the pool") from None

    def _wait_ready(self) -> None:
        """The copies may still run: this device's current stream waits for them on the
        GPU, before the gathers and whatever the caller queues next."""
        if not self.reply.HasField("event_handle") or not self.opened:
            return
        device = next(iter(self.opened.values()))[0].device
        try:
            event = self.cache.ready_event(self.reply.event_handle, device)
        except RuntimeError as exc:
            raise EventOpenError(f"cannot open the reply's ready event: {exc}") from exc
        torch.cuda.current_stream(device).wait_event(event)

    def finish(self, planned: list[tuple[_Gather, PageGather]]) -> Decoded:
        """Run the gathers and the copies made alone; owned copies on a GPU get the event
        that says when they are complete."""
        out = self.out
        for g, gather in planned:
            flat = gather.run()
            for (i, result), at in zip(g.items, gather.offsets, strict=True):
                out.tensors[i] = _view(flat, at, result.meta, self.typed)
        for i, pool, offset, meta in self.clones:
            out.tensors[i] = _view(pool, offset, meta, self.typed).clone()
        if not (planned or self.clones) or not self.owned:
            return out
        device = next(iter(self.opened.values()))[0].device
        if device.type == "cuda":
            out.ready = torch.cuda.Event()
            out.ready.record(torch.cuda.current_stream(device))  # after the copies
        return out


def _pages_inside(result: pb.GetResult, num_pages: int) -> bool:
    return all(0 <= p < num_pages for p in result.device.pages.page_ids)


# (id of a base tensor, dtype) -> (that base, the base viewed as dtype), kept for one decode
_Typed = dict[tuple[int, torch.dtype], tuple[torch.Tensor, torch.Tensor]]


@dataclass(slots=True)
class _Gather:
    """The fragmented entries of one pool in a reply, gathered together."""

    pages: list[int] = field(default_factory=list)  # every entry's page ids, concatenated
    counts: list[int] = field(default_factory=list)  # page ids per entry
    items: list[tuple[int, pb.GetResult]] = field(default_factory=list)  # (slot, result)


def _view(
    base: torch.Tensor,
    offset: int,
    meta: pb.TensorMeta,
    typed: _Typed,
) -> torch.Tensor:
    """The entry at byte ``offset`` of the uint8 tensor ``base`` as its dtype and shape,
    with one ``as_strided`` over ``base`` viewed as that dtype (made once per call and
    kept in ``typed``); ``as_strided`` also refuses anything outside the storage."""
    dtype = torch_dtype(meta.dtype)
    shape = tuple(meta.shape)
    item = dtype.itemsize
    if math.prod(shape) * item != meta.nbytes or offset % item:
        raise ValueError(f"reply metadata {meta.dtype}{list(shape)} does not fit its bytes")
    cached = typed.get((id(base), dtype))
    if cached is not None and cached[0] is base:
        view = cached[1]
    else:
        if base.numel() % item or base.storage_offset() % item:  # not a typed array: slice
            return base[offset : offset + meta.nbytes].view(dtype).view(shape)
        view = base.view(dtype)
        typed[(id(base), dtype)] = (base, view)  # the base too: an id may be reused
    strides, step = [], 1
    for dim in reversed(shape):
        strides.append(step)
        step *= dim
    return view.as_strided(shape, strides[::-1], view.storage_offset() + offset // item)


def sync_device(device: torch.device) -> None:
    """Wait for the work queued on the device's current stream (before leases end)."""
    torch.cuda.current_stream(device).synchronize()


def wait_copied(ready: torch.cuda.Event | None, device: torch.device) -> None:
    """Before a device get's leases end at the end of its block: wait for the copies into
    owned memory (``ready``), or, for views, for the device's current stream."""
    if ready is not None:
        ready.synchronize()
    else:
        sync_device(device)


def sync_devices(devices: set[torch.device]) -> None:
    """Wait for all of this process's work on these devices (before the leases of device
    views that went after their block end: whatever stream read them is done)."""
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
