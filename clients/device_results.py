"""Wire side of the device paths: Get replies with device locations -> tensors on the GPU;
IPC descriptions of CUDA tensors for ``PutFromDevice`` and ``GetInto``; get_into results.

Lifetimes (see docs/grpc.md): a contiguous entry is a zero-copy view of the daemon's device
pool, valid while its lease lives; a fragmented entry is gathered (one launch on the
current stream) into a tensor the caller owns. Releasing the leases first waits for the
work queued on the device's current stream, so no kernel still reads pages that the daemon
may reuse once they are released. Work on other streams is the caller's to finish.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from embcache.clients._wire import torch_dtype
from embcache.clients.device import DevicePoolCache, DevicePoolHandle, PageGather, plan_gather
from embcache.clients.ipc_events import EVENTS, Recorded
from embcache.clients.results import Decoded
from embcache.proto.constants import SLOT_ALIGN
from embcache.proto.embcache.v1 import embcache_pb2 as pb

log = logging.getLogger(__name__)


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


def decode_device_get(reply: pb.GetResponse, cache: DevicePoolCache) -> Decoded:
    """Tensors for a Get with a GPU uuid; each pool is opened once through ``cache``.
    Contiguous entries are views; the fragmented ones of a pool are gathered together
    (one upload and one launch: :func:`plan_gather`). The page ids of a batch are
    checked and cut into runs with numpy, and each tensor is made with one ``as_strided``,
    so the Python work per entry stays small."""
    pools = {p.pool_id: p for p in reply.pools}
    out = Decoded([], [])
    gathers: dict[str, _Gather] = {}
    opened: dict[str, tuple[torch.Tensor, int]] = {}
    typed: _Typed = {}
    for result in reply.results:
        if not result.found:
            out.tensors.append(None)
            continue
        out.lease_ids.append(result.lease_id)
        loc = result.device
        if result.WhichOneof("location") != "device" or loc.pool_id not in pools:
            raise ValueError(f"reply for {result.key!r} names no device pool this client knows")
        if loc.pool_id not in opened:
            desc = pools[loc.pool_id]
            handle = pool_handle(desc)
            try:
                pool = cache.pool_tensor(handle, desc.device.size)
            except (OSError, RuntimeError) as exc:
                raise PoolOpenError(f"cannot open device pool {loc.pool_id}: {exc}") from exc
            opened[loc.pool_id] = (pool, handle.page_bytes)
        pool, page_bytes = opened[loc.pool_id]
        meta = result.meta
        if loc.WhichOneof("placement") == "offset":
            if loc.offset + meta.nbytes > pool.numel():
                raise ValueError(f"reply for {result.key!r} has a location outside the pool")
            out.tensors.append(_view(pool, loc.offset, meta, typed))
            continue
        g = gathers.get(loc.pool_id)
        if g is None:
            g = gathers[loc.pool_id] = _Gather()
        before = len(g.pages)
        g.pages.extend(loc.pages.page_ids)
        if (len(g.pages) - before) * page_bytes < meta.nbytes:
            raise ValueError(f"reply for {result.key!r} has a location outside the pool")
        g.counts.append(len(g.pages) - before)
        g.items.append((len(out.tensors), result))
        out.tensors.append(None)  # filled below
    planned: list[tuple[_Gather, PageGather]] = []  # ids placed before the wait below
    try:
        for pool_id, g in gathers.items():
            pool, page_bytes = opened[pool_id]
            sizes = [r.meta.nbytes for _, r in g.items]
            try:
                planned.append((g, plan_gather(pool, page_bytes, g.pages, g.counts, sizes)))
            except ValueError:  # a page outside the pool: name the entry
                num_pages = pool.numel() // page_bytes if page_bytes > 0 else 0
                bad = next((r for _, r in g.items if not _pages_inside(r, num_pages)), None)
                if bad is None:
                    raise
                raise ValueError(f"reply for {bad.key!r} has a location outside the pool") from None
        if reply.HasField("event_handle") and opened:
            # The copies may still run: this device's current stream waits for them on the
            # GPU, before the gathers below and whatever the caller queues next.
            device = next(iter(opened.values()))[0].device
            try:
                event = cache.ready_event(reply.event_handle, device)
            except RuntimeError as exc:
                raise EventOpenError(f"cannot open the reply's ready event: {exc}") from exc
            torch.cuda.current_stream(device).wait_event(event)
    except BaseException:
        for _, gather in planned:  # nothing will read their ids
            gather.abandon()
        raise
    for g, gather in planned:
        flat = gather.run()
        for (i, result), at in zip(g.items, gather.offsets, strict=True):
            out.tensors[i] = _view(flat, at, result.meta, typed)
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


# ---------------------------------------------------------------------------- IPC tensors


@dataclass(slots=True)
class Exported:
    """A CUDA tensor described for the daemon; it must live until the call returns, and
    :meth:`returned` says that the call succeeded (its event may then be reused)."""

    message: pb.CudaIpcTensor
    tensor: torch.Tensor
    events: list[Recorded] = field(default_factory=list)

    def returned(self) -> None:
        for rec in self.events:
            rec.done()


def export_cuda(t: torch.Tensor, *, as_bytes: bool = False, event: bool = True) -> Exported | None:
    """The IPC description of a contiguous CUDA tensor, or None when its memory cannot be
    exported (expandable segments, or no legacy IPC): the caller then moves bytes instead.

    With ``event``, an interprocess event recorded on the current stream tells the daemon
    when the work queued so far (writes of the tensor, or reads of a get_into buffer) is
    done (:func:`record_event`; callers that describe several tensors record one event
    after all of them instead)."""
    if t.device.type != "cuda" or not t.is_contiguous():
        raise ValueError("t: must be a contiguous CUDA tensor")
    from embcache.kernels import cuda_ipc, cuda_mem

    try:
        handle, offset, alloc = cuda_ipc.export_tensor(t)
        uuid = cuda_mem.gpu_uuid(t.device.index or 0)
    except (RuntimeError, ValueError) as exc:
        log.info("cannot export a CUDA tensor over IPC (%s); moving bytes instead", exc)
        return None
    if as_bytes:
        dtype, shape = "uint8", [t.numel() * t.element_size()]
    else:
        dtype, shape = str(t.dtype).removeprefix("torch."), list(t.shape)
    msg = pb.CudaIpcTensor(
        gpu_uuid=uuid,
        ipc_handle=handle,
        offset=offset,
        alloc_size=alloc,
        dtype=dtype,
        shape=shape,
    )
    out = Exported(msg, t)
    if event:
        record_event(t.device, [out])
    return out


def record_event(device: torch.device, exported: Sequence[Exported]) -> None:
    """Record one interprocess event on ``device``'s current stream and name it in every
    message of ``exported``; where this process cannot make one, wait for the stream."""
    try:
        rec = EVENTS.record(device)
    except RuntimeError as exc:  # no IPC events here: finish the work before the call
        log.info("interprocess events unavailable (%s); synchronizing instead", exc)
        torch.cuda.current_stream(device).synchronize()
        return
    for e in exported:
        e.message.event_handle = rec.handle
    if exported:
        exported[0].events.append(rec)


# ---------------------------------------------------------------------------- get_into


@dataclass(frozen=True, slots=True)
class IntoResult:
    """One key of ``get_into(keys, buffer)``: found, metadata and the byte offset it was
    copied to. Truthy when found."""

    key: str
    found: bool
    dtype: str = ""
    shape: tuple[int, ...] = ()
    nbytes: int = 0
    offset: int = 0

    def __bool__(self) -> bool:
        return self.found

    def view(self, buffer: torch.Tensor) -> torch.Tensor:
        """The entry as a tensor over the buffer's bytes (no copy)."""
        if not self.found:
            raise ValueError(f"{self.key!r} was not found")
        flat = buffer.reshape(-1).view(torch.uint8)[self.offset : self.offset + self.nbytes]
        return flat.view(torch_dtype(self.dtype)).view(self.shape)


def into_results(reply: pb.GetIntoResponse) -> list[IntoResult]:
    return [
        IntoResult(r.key, True, r.meta.dtype, tuple(r.meta.shape), r.meta.nbytes, r.offset)
        if r.found
        else IntoResult(r.key, False)
        for r in reply.results
    ]


def pack_offsets(sizes: Sequence[int | None]) -> list[int]:
    """Back-to-back offsets aligned to 16 bytes (None, a miss, takes no room)."""
    out, pos = [], 0
    for n in sizes:
        if n is None:
            out.append(0)
            continue
        pos = -(-pos // SLOT_ALIGN) * SLOT_ALIGN
        out.append(pos)
        pos += n
    return out


def check_buffer(out: torch.Tensor, keys: Sequence[str], offsets: Sequence[int] | None) -> None:
    if not isinstance(out, torch.Tensor) or not out.is_contiguous():
        raise ValueError("out: must be a contiguous tensor")
    if offsets is not None:
        if len(offsets) != len(keys):
            raise ValueError(f"offsets: one per key ({len(keys)}), got {len(offsets)}")
        if any(not isinstance(o, int) or o < 0 for o in offsets):
            raise ValueError("offsets: must be non-negative integers")


def copy_into_buffer(
    keys: Sequence[str],
    tensors: Sequence[torch.Tensor | None],
    out: torch.Tensor,
    offsets: Sequence[int] | None,
) -> list[IntoResult]:
    """get_into without IPC: copy host tensors into ``out``'s bytes (the fallback)."""
    sizes = [None if t is None else t.numel() * t.element_size() for t in tensors]
    slots = list(offsets) if offsets is not None else pack_offsets(sizes)
    flat = out.reshape(-1).view(torch.uint8)
    spans = sorted((o, o + n) for o, n in zip(slots, sizes, strict=True) if n)
    if any(b[0] < a[1] for a, b in itertools.pairwise(spans)):
        raise ValueError("offsets: destination slots overlap")
    results = []
    for key, t, n, off in zip(keys, tensors, sizes, slots, strict=True):
        if t is None or n is None:
            results.append(IntoResult(key, False))
            continue
        if off + n > flat.numel():
            raise ValueError(f"{key!r} ({n} bytes) does not fit out at offset {off}")
        flat[off : off + n].copy_(t.reshape(-1).view(torch.uint8))
        dtype = str(t.dtype).removeprefix("torch.")
        results.append(IntoResult(key, True, dtype, tuple(t.shape), n, off))
    return results
