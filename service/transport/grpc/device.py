"""The device RPCs of the servicer: ``Get`` with a GPU uuid, ``PutFromDevice``, ``GetInto``.

Every request is validated completely before any IPC handle is opened. Engine calls that
may wait on a copy run in a worker thread (``asyncio.to_thread``) so the event loop keeps
serving; a call cancelled while its thread runs gives back the leases the thread took.
IPC descriptors (pool handles, fd tokens) only reach callers that passed the auth check:
the interceptor runs before any handler.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from embcache.errors import DeviceUnavailable, InvalidArgument, UnknownSession
from embcache.proto.constants import SLOT_ALIGN
from embcache.proto.dtypes import DType, lookup
from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.service.config import Settings
from embcache.service.device.ipc.cache import CudaIpc, IpcCache, check_ipc_handle
from embcache.service.device.pool import DevicePool
from embcache.service.device.puts import PendingPut
from embcache.service.device.tier import PendingGet
from embcache.service.engine import CacheEngine
from embcache.service.host import admission
from embcache.service.host.leases import Lease
from embcache.service.transport.grpc import device_puts as grpc_device_puts
from embcache.service.transport.render import HostShmPool, PoolDesc, describer_for

log = logging.getLogger("embcache.grpc")

T = TypeVar("T")
_UINT63 = 2**63


def meta_of(lease: Lease) -> pb.TensorMeta:
    return pb.TensorMeta(dtype=lease.dtype, shape=lease.shape, nbytes=lease.nbytes)


async def in_thread(fn: Callable[[], T], undo: Callable[[T], object] | None = None) -> T:
    """``fn()`` in a worker thread. If the call is cancelled meanwhile, ``undo(result)`` runs
    when the thread finishes (e.g. to give back leases nobody will receive)."""
    task = asyncio.ensure_future(asyncio.to_thread(fn))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        if undo is not None:

            def done(t: asyncio.Future[T]) -> None:
                if not t.cancelled() and t.exception() is None:
                    undo(t.result())

            task.add_done_callback(done)
        raise


def pool_handle_of(desc: PoolDesc) -> pb.PoolHandle:
    """A pool description (``descriptors.py``) as the wire's ``PoolHandle``."""
    if isinstance(desc, HostShmPool):
        shm = pb.HostShmPool(
            segment_name=desc.segment_name,
            size=desc.size,
            page_bytes=desc.page_bytes,
            boot_id=desc.boot_id,
            st_dev=desc.st_dev,
            st_ino=desc.st_ino,
        )
        return pb.PoolHandle(pool_id=desc.pool_id, host_shm=shm)
    dev = pb.DevicePool(gpu_uuid=desc.gpu_uuid, size=desc.size, page_bytes=desc.page_bytes)
    if desc.ipc_mode == "legacy":
        dev.ipc_handle = desc.ipc_handle or b""
    elif desc.ipc_mode == "fd":
        dev.posix_fd.CopyFrom(
            pb.PosixFdHandle(
                fd_token=desc.fd_token or 0,
                alloc_size=desc.alloc_size or 0,
                fd_socket=desc.fd_socket or "",
            )
        )
    # ipc_mode "none" (a CPU test pool): no handle; nothing outside this process opens it.
    return pb.PoolHandle(pool_id=desc.pool_id, device=dev)


# Copies expected to take longer are waited for in a worker thread. Polling on the loop
# answers sooner (H200, 16 x 4 MiB over gRPC, both runs under cProfile: the wait after
# queuing fell from 0.68 to 0.45 ms against a thread hand-off) and other callbacks still
# run between polls.
SPIN_S = 0.01
SPIN_RATE = 20e9  # bytes/s assumed for that estimate (below a host->device copy's rate)


async def wait_copies(pending: PendingGet | PendingPut) -> None:
    """Wait for a get's (or a put's) copies without blocking the loop (:func:`poll_until`);
    copies expected to take longer than ``SPIN_S`` go straight to a worker thread."""
    spin = SPIN_S if pending.loaded_bytes / SPIN_RATE < SPIN_S else 0.0
    await poll_until(pending.done, pending.wait, spin)


async def poll_until(
    done: Callable[[], bool], wait: Callable[[], object], spin_s: float | None = None
) -> None:
    """Until ``done()``: polled between the loop's other callbacks for up to ``spin_s``
    (default ``SPIN_S``; a short wait, the common case, answers sooner than a thread
    hand-off), then ``wait()`` in a worker thread."""
    if done():
        return
    give_up = time.perf_counter() + (SPIN_S if spin_s is None else spin_s)
    while time.perf_counter() < give_up:
        await asyncio.sleep(0)
        if done():
            return
    await asyncio.to_thread(wait)


def observe_later(pending: PendingGet, period_s: float = 0.001, limit_s: float = 10.0) -> None:
    """Poll a get's copies from loop timers until they are done, so its copy time reaches
    the metrics even though nobody waits for it (a reply sent with a ready event)."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + limit_s

    def poll() -> None:
        try:
            done = pending.done()
        except RuntimeError as exc:  # a device error: the pool's next call takes it out
            log.warning("a device get's copy failed after its reply: %s", exc)
            return
        if not done and loop.time() < give_up:
            loop.call_later(period_s, poll)

    loop.call_later(period_s, poll)


@dataclass(frozen=True, slots=True)
class IpcTensor:
    """A validated ``CudaIpcTensor``: contiguous bytes in a client allocation."""

    handle: bytes
    device: int
    dtype: DType
    shape: tuple[int, ...]
    nbytes: int
    offset: int
    alloc_size: int
    event: bytes | None


class DevicePlane:
    def __init__(self, engine: CacheEngine, settings: Settings, ipc: IpcCache | None = None):
        self.engine = engine
        self.settings = settings
        self.ipc = ipc if ipc is not None else IpcCache(CudaIpc(engine.host_pool.registered))
        self._handles: dict[str, pb.PoolHandle] = {}
        self._settling: set[int] = set()  # pools with a settle() callback scheduled

    # -- Get with a GPU uuid -------------------------------------------------------------
    async def get(
        self, request: pb.GetRequest, owner: str, alive: Callable[[str], bool]
    ) -> pb.GetResponse:
        index, pool = self.engine.device_tier.pool_for(request.gpu_uuid)
        keys = list(request.keys)
        ttl = request.ttl_s if request.HasField("ttl_s") else None
        e = self.engine
        if e.miss_fetcher is not None:  # the shared tier may block on the network
            await asyncio.to_thread(e.fill_misses, keys)
        # Bookkeeping and queuing the copy take the engine lock briefly, like a host Get,
        # so they run here; only the copy is waited for off the critical path.
        pending = e.start_get_to_device(
            keys, owner, ttl_s=ttl, device=index, fill_misses=False, defer_tables=True
        )
        try:
            # The reply says where the bytes will be, so it is built while they are copied.
            # It leaves once the copy is complete, or at once with an event that fires then
            # when the client waits on the GPU (ready_event).
            reply = self._get_reply(keys, pending.results, pool)
            event = e.ready_event(pending, index) if request.ready_event else None
            if event is not None:
                reply.event_handle = event
                observe_later(pending)
            else:
                await wait_copies(pending)
            if not alive(owner):  # the session ended meanwhile: its leases would outlive it
                raise UnknownSession("session ended during the call", session=owner)
            return reply
        except BaseException:
            e.release(d.lease.lease_id for d in pending.results if d is not None)
            raise
        finally:
            self._settle_later(index)

    def _settle_later(self, index: int) -> None:
        """Once the reply is on its way (a callback runs after this task's current step, in
        which gRPC serialises and sends it): refill pool ``index``'s free reserve and launch
        its page-table updates when they are due (``DeviceTier.settle``). A flush costs a
        few launches whatever it holds, 0.4-0.9 ms of the loop's time on the H200 host;
        nothing on this path reads the tables (a reader flushes first)."""
        if index in self._settling:
            return
        self._settling.add(index)

        def settle() -> None:
            self._settling.discard(index)
            self.engine.settle_device(index)

        asyncio.get_running_loop().call_soon(settle)

    def _get_reply(self, keys: Sequence[str], found: Sequence[Any], pool: DevicePool) -> Any:
        """The reply, built in place (no per-key temporaries copied into it)."""
        reply = pb.GetResponse()
        results = reply.results
        for key, dl in zip(keys, found, strict=True):
            result = results.add(key=key)
            if dl is None:
                continue
            lease = dl.lease
            result.found = True
            result.lease_id = lease.lease_id
            meta = result.meta
            meta.dtype, meta.nbytes = lease.dtype, lease.nbytes
            meta.shape.extend(lease.shape)
            loc = result.device
            loc.pool_id, loc.gpu_uuid = dl.pool_id, dl.gpu_uuid
            if dl.offset is not None:
                loc.offset = dl.offset
            else:
                loc.pages.page_ids.extend(dl.page_ids)
        if any(dl is not None for dl in found):
            reply.pools.append(self.pool_handle(pool))
        return reply

    def pool_handle(self, pool: DevicePool) -> pb.PoolHandle:
        """How a client opens ``pool``: the engine's one description (the same pool id over
        REST), encoded once per pool."""
        handle = self._handles.get(pool.pool_id)
        if handle is None:
            handle = pool_handle_of(describer_for(self.engine, self.settings).device_pool(pool))
            self._handles[pool.pool_id] = handle
        return handle

    # -- PutFromDevice (grpc_device_puts.py) ---------------------------------------------
    async def put_from_device(self, request: pb.PutFromDeviceRequest, owner: str) -> pb.PutResponse:
        return await grpc_device_puts.put_from_device(self, request, owner)

    async def put_from_device_batch(
        self, request: pb.PutFromDeviceBatchRequest, owner: str
    ) -> pb.PutFromDeviceBatchResponse:
        return await grpc_device_puts.put_from_device_batch(self, request, owner)

    # -- GetInto -------------------------------------------------------------------------
    async def get_into(self, request: pb.GetIntoRequest, owner: str) -> pb.GetIntoResponse:
        buf = request.destination.buffer
        self._require_cuda("GetInto", buf.gpu_uuid)
        if not request.HasField("destination"):
            raise InvalidArgument("GetInto needs a destination buffer")
        dtype = lookup(buf.dtype)
        if dtype is None:
            raise InvalidArgument("unsupported destination dtype", dtype=buf.dtype)
        shape = _shape(buf.shape, "destination.shape")
        dest = self._check_tensor(buf, dtype, shape, "destination")
        keys = list(request.keys)
        for key in keys:
            admission.check_key(key, self.settings)
        offsets = list(request.offsets)
        if offsets and len(offsets) != len(keys):
            raise InvalidArgument("one offset per key", keys=len(keys), offsets=len(offsets))
        if any(off > dest.nbytes for off in offsets):
            raise InvalidArgument("offset outside the destination", destination=dest.nbytes)
        pool_index = self.engine.device_tier.index_of(buf.gpu_uuid)

        def run() -> list[tuple[Lease | None, int]]:
            slots = offsets or self._pack(keys)
            if dest.event is not None:
                self.ipc.wait_event(owner, dest.event, dest.device)
            if dest.nbytes == 0:
                flat = torch.empty(0, dtype=torch.uint8)
                return list(zip(self.engine.get_into(keys, owner, flat, slots), slots, strict=True))
            with self.ipc.tensor(
                owner, dest.handle, dest.device, dest.alloc_size, dest.offset, dest.nbytes
            ) as flat:
                leases = self.engine.get_into(keys, owner, flat, slots, device=pool_index)
            return list(zip(leases, slots, strict=True))

        done = await in_thread(run)
        reply = pb.GetIntoResponse()
        for key, (lease, off) in zip(keys, done, strict=True):
            if lease is None:
                reply.results.append(pb.GetIntoResult(key=key, found=False))
            else:
                reply.results.append(
                    pb.GetIntoResult(key=key, found=True, meta=meta_of(lease), offset=off)
                )
        return reply

    def _pack(self, keys: Sequence[str]) -> list[int]:
        """Back-to-back 16-byte-aligned slots for the entries present now (misses: 0).

        An entry that changes between this and the copy cannot corrupt anything: the engine
        checks every slot against the destination and the others before copying."""
        slots, pos = [], 0
        for key in keys:
            info = self.engine.entry_info(key)
            if info is None:
                slots.append(0)
                continue
            pos = -(-pos // SLOT_ALIGN) * SLOT_ALIGN
            slots.append(pos)
            pos += info.nbytes
        return slots

    # -- validation ----------------------------------------------------------------------
    def _require_cuda(self, what: str, gpu_uuid: str) -> None:
        if not self.ipc.backend.available():
            raise DeviceUnavailable(
                f"{what} reads or writes client GPU memory and needs CUDA, which this daemon "
                "does not use; stream the bytes instead (Put / Get)",
                gpu_uuid=gpu_uuid,
            )

    def _check_tensor(
        self, t: pb.CudaIpcTensor, dtype: DType, shape: tuple[int, ...], what: str
    ) -> IpcTensor:
        kind = t.WhichOneof("handle")
        if kind != "ipc_handle":
            raise InvalidArgument(
                f"{what} needs ipc_handle (a cudaIpcMemHandle); posix_fd is not accepted "
                "for client memory",
                handle=kind,
            )
        handle = check_ipc_handle(t.ipc_handle, f"{what}.ipc_handle")
        nbytes = dtype.itemsize
        for d in shape:
            nbytes *= d
        if nbytes >= _UINT63:
            raise InvalidArgument(f"{what} is too large", shape=list(shape))
        if list(t.strides) and list(t.strides) != _contiguous_strides(shape, list(t.strides)):
            raise InvalidArgument(
                f"{what} must be contiguous", shape=list(shape), strides=list(t.strides)
            )
        if nbytes and t.offset + nbytes > t.alloc_size:
            raise InvalidArgument(
                f"{what} lies outside its allocation",
                offset=t.offset,
                nbytes=nbytes,
                alloc_size=t.alloc_size,
            )
        event = t.event_handle if t.HasField("event_handle") else None
        if event is not None:
            check_ipc_handle(event, f"{what}.event_handle")
        device = self.ipc.backend.gpu_index(t.gpu_uuid)
        if device is None:
            raise DeviceUnavailable("the daemon does not see this GPU", gpu_uuid=t.gpu_uuid)
        return IpcTensor(handle, device, dtype, shape, nbytes, t.offset, t.alloc_size, event)


def _shape(dims: Sequence[int], what: str) -> tuple[int, ...]:
    if len(dims) > admission.MAX_NDIM or any(d < 0 for d in dims):
        raise InvalidArgument(f"{what} must be at most 8 dims >= 0", shape=list(dims))
    return tuple(dims)


def _contiguous_strides(shape: Sequence[int], given: list[int]) -> list[int]:
    """``given`` where torch would call the layout contiguous, else the row-major strides.

    Dims of size 1 may carry any stride, and a tensor with no elements is contiguous."""
    if len(given) != len(shape):
        return []
    if any(d == 0 for d in shape):
        return given
    out, expected = [0] * len(shape), 1
    for i in range(len(shape) - 1, -1, -1):
        out[i] = given[i] if shape[i] == 1 else expected
        expected *= shape[i]
    return out
