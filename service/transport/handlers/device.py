"""The device calls of the servicer: ``Get`` with a GPU uuid, ``PutFromDevice``, ``GetInto``.

Every request is validated completely before any IPC handle is opened. A device Get goes
through the one device-get flow (``device_get.py``), the puts through ``device_puts.py``;
both wait for their copies without blocking the event loop. ``GetInto`` queues its
copies on the loop when nothing can block (the destination mapped already, the client's
event fired), and otherwise runs its engine call in a worker thread; either way its leases
end once the copies are complete. IPC descriptors (pool handles, fd tokens) only reach
callers that passed the auth check: the interceptor runs before any handler.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from embcache.errors import DeviceUnavailable, InvalidArgument, ReplyTooLarge
from embcache.proto.constants import MAX_MESSAGE_BYTES, SLOT_ALIGN
from embcache.proto.dtypes import lookup
from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.proto.locations import HostShmPool, PoolDesc
from embcache.proto.records import fill_message
from embcache.service.config import Settings
from embcache.service.device.ipc.cache import CudaIpc, IpcCache
from embcache.service.device.pool import DevicePool
from embcache.service.engine import CacheEngine
from embcache.service.host import admission
from embcache.service.host.leases import Lease
from embcache.service.transport import device_get
from embcache.service.transport.device_get import Housekeeping, in_thread, poll_until
from embcache.service.transport.handlers import device_puts as grpc_device_puts
from embcache.service.transport.handlers.ipc_tensors import (
    IpcTensor,
    check_tensor,
    require_cuda,
    shape_of,
)
from embcache.service.transport.render import LocationRenderer

log = logging.getLogger("embcache.grpc")

_UINT63 = 2**63
# A Get reply inside a Session message (call id, field tags) must still fit one message.
REPLY_LIMIT = MAX_MESSAGE_BYTES - 64


def meta_of(lease: Lease) -> pb.TensorMeta:
    """A leased entry's dtype, shape and size, as the wire's ``TensorMeta``."""
    return pb.TensorMeta(dtype=lease.dtype, shape=lease.shape, nbytes=lease.nbytes)


def check_reply_size(reply: pb.GetResponse) -> None:
    """ReplyTooLarge, naming the limit, when ``reply`` would not fit one message (as a
    unary reply or a session call's result); the caller gives its leases back."""
    size = reply.ByteSize()
    if size > REPLY_LIMIT:
        found = sum(1 for r in reply.results if r.found)
        raise ReplyTooLarge(
            "reply exceeds the message limit: ask for fewer keys per call",
            size=size, limit=REPLY_LIMIT, keys=len(reply.results), found=found,
        )  # fmt: skip


def lease_ids_of(reply: pb.GetResponse) -> list[int]:
    """The lease ids a Get reply hands out."""
    return [r.lease_id for r in reply.results if r.found]


def pool_handle_of(desc: PoolDesc) -> pb.PoolHandle:
    """A pool description (``render.py``) as the wire's ``PoolHandle``: its fields by name,
    the pool id on the handle and the fd fields in ``posix_fd``."""
    if isinstance(desc, HostShmPool):
        return pb.PoolHandle(pool_id=desc.pool_id, host_shm=fill_message(pb.HostShmPool(), desc))
    dev = fill_message(pb.DevicePool(), desc, skip=("ipc_handle",))
    if desc.ipc_mode == "legacy":
        dev.ipc_handle = desc.ipc_handle or b""
    elif desc.ipc_mode == "fd":
        fill_message(dev.posix_fd, desc).SetInParent()
    # ipc_mode "none" (a CPU test pool): no handle; nothing outside this process opens it.
    return pb.PoolHandle(pool_id=desc.pool_id, device=dev)


class DevicePlane:
    """The device calls for one engine, with the IPC cache of the client memory they open
    (module docstring)."""

    def __init__(self, engine: CacheEngine, settings: Settings, ipc: IpcCache | None = None):
        self.engine = engine
        self.settings = settings
        registered = engine.host_segment().registered
        ipc = ipc if ipc is not None else IpcCache(CudaIpc(registered))
        self.puts = grpc_device_puts.DevicePuts(engine, settings, ipc)
        self._handles: dict[str, pb.PoolHandle] = {}
        self.housekeeping = Housekeeping(engine)
        self.renderer = LocationRenderer(engine, settings)

    @property
    def ipc(self) -> IpcCache:
        """The client allocations and events this daemon opened (shared with the puts)."""
        return self.puts.ipc

    @ipc.setter
    def ipc(self, cache: IpcCache) -> None:
        self.puts.ipc = cache

    # -- Get with a GPU uuid -------------------------------------------------------------
    async def get(
        self, request: pb.GetRequest, owner: str, alive: Callable[[str], bool]
    ) -> pb.GetResponse:
        """A Get with a GPU uuid, through the one device-get flow (``device_get.py``)."""
        engine = self.engine
        index = engine.device.index_for(request.gpu_uuid)
        pool = engine.device.pool(index)
        keys = list(request.keys)
        reply, event = await device_get.get_to_device(
            engine,
            keys,
            owner,
            index,
            ttl_s=request.ttl_s if request.HasField("ttl_s") else None,
            render=lambda found: self._get_reply(keys, found, pool),
            housekeeping=self.housekeeping,
            ready_event=request.ready_event,
            alive=alive,
        )
        if event is not None:
            reply.event_handle = event
        return reply

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
        check_reply_size(reply)  # raised inside the device-get flow: its leases go back
        return reply

    def pool_handle(self, pool: DevicePool) -> pb.PoolHandle:
        """How a client opens ``pool``: the engine's one description (the same pool id over
        REST), encoded once per pool."""
        handle = self._handles.get(pool.pool_id)
        if handle is None:
            handle = pool_handle_of(self.renderer.device_pool(pool))
            self._handles[pool.pool_id] = handle
        return handle

    def offered_pools(self) -> list[pb.PoolHandle]:
        """Every device pool by index, as the read table's slots name them: its handle, or
        an empty one for a pool clients cannot open (out of service, or a CPU test pool
        with nothing to export)."""
        out = []
        for pool in self.engine.device.pools:
            handle = pb.PoolHandle()
            if not pool.failed and pool.ipc_mode != "none":
                try:
                    handle = self.pool_handle(pool)
                except Exception as exc:  # a failed export: table reads of it stay host reads
                    log.warning("device pool %d not offered to table reads: %s", pool.index, exc)
            out.append(handle)
        return out

    # -- PutFromDevice (handlers/device_puts.py) -----------------------------------------
    async def put_from_device(
        self, request: pb.PutFromDeviceRequest, owner: str, quota: str | None = None
    ) -> pb.PutResponse:
        """``owner``: whose IPC mappings; ``quota``: whose in-flight quota (``owner``'s)."""
        return await grpc_device_puts.put_from_device(self.puts, request, owner, quota)

    async def put_from_device_batch(
        self, request: pb.PutFromDeviceBatchRequest, owner: str, quota: str | None = None
    ) -> pb.PutFromDeviceBatchResponse:
        return await grpc_device_puts.put_from_device_batch(self.puts, request, owner, quota)

    # -- GetInto -------------------------------------------------------------------------
    async def get_into(self, request: pb.GetIntoRequest, owner: str) -> pb.GetIntoResponse:
        """Validate the destination and keys, then copy the entries into its buffer: on the
        loop when nothing blocks, else in a worker thread (docs/grpc.md, ``GetInto``)."""
        buf = request.destination.buffer
        require_cuda(self.ipc, "GetInto", buf.gpu_uuid)
        if not request.HasField("destination"):
            raise InvalidArgument("GetInto needs a destination buffer")
        dtype = lookup(buf.dtype)
        if dtype is None:
            raise InvalidArgument("unsupported destination dtype", dtype=buf.dtype)
        shape = shape_of(buf.shape, "destination.shape")
        dest = check_tensor(self.ipc, buf, dtype, shape, "destination")
        keys = list(request.keys)
        for key in keys:
            admission.check_key(key, self.settings)
        offsets = list(request.offsets)
        if offsets and len(offsets) != len(keys):
            raise InvalidArgument("one offset per key", keys=len(keys), offsets=len(offsets))
        if any(off > dest.nbytes for off in offsets):
            raise InvalidArgument("offset outside the destination", destination=dest.nbytes)
        pool_index = self._pool_index(buf.gpu_uuid)
        slots = offsets or self._pack(keys)
        leases = None
        if self._into_on_loop(owner, dest):
            leases = await self._into_now(keys, owner, dest, slots, pool_index)
        if leases is None:
            leases = await in_thread(
                lambda: self._into_waiting(keys, owner, dest, slots, pool_index)
            )
        reply = pb.GetIntoResponse()
        for key, lease, off in zip(keys, leases, slots, strict=True):
            if lease is None:
                reply.results.append(pb.GetIntoResult(key=key, found=False))
            else:
                reply.results.append(
                    pb.GetIntoResult(key=key, found=True, meta=meta_of(lease), offset=off)
                )
        return reply

    def _into_on_loop(self, owner: str, dest: IpcTensor) -> bool:
        """Whether a GetInto can run on the event loop: nothing to fetch from the shared
        tier, the destination is mapped already and the client's event (if any) is open.
        Otherwise something may block (opening a handle or an event, the network), and the
        call runs in a worker thread."""
        if self.engine.fetches_misses or dest.nbytes == 0:
            return False
        if not self.ipc.mapped(dest.handle, dest.device):
            return False
        return (
            dest.event is None or self.ipc.opened_event(owner, dest.event, dest.device) is not None
        )

    async def _into_now(
        self,
        keys: list[str],
        owner: str,
        dest: IpcTensor,
        slots: list[int],
        pool_index: int | None,
    ) -> list[Lease | None] | None:
        """GetInto on the loop: wait for the client's event (polled, as a put's is), queue
        the copies, then wait for them without blocking the loop (``wait_copies``), with no
        thread hand-off before the copies start. The leases end once the copies are
        complete. None when the destination's mapping closed while the event was awaited
        (mapping it again may block: the caller goes to a thread)."""
        if dest.event is not None:
            event = self.ipc.opened_event(owner, dest.event, dest.device)
            if event is None:  # forgotten meanwhile (it failed, or the session ended)
                return None
            await poll_until(event.fired, event.wait)
            if not self.ipc.mapped(dest.handle, dest.device):
                return None
        with self._destination(owner, dest) as flat:
            # dest_ready: the client's event has fired; nothing here writes its buffer.
            pending = self.engine.device.start_into(
                keys, owner, flat, slots, device=pool_index, fill_misses=False, dest_ready=True
            )
            try:
                await device_get.wait_copies(pending)
            except BaseException:
                pending.wait()  # cancelled or failed: the copies still use the mapping
                raise
            finally:
                pending.finish()
        return pending.leases

    def _into_waiting(
        self,
        keys: list[str],
        owner: str,
        dest: IpcTensor,
        slots: list[int],
        pool_index: int | None,
    ) -> list[Lease | None]:
        """GetInto in a worker thread: wait for the client's event, map the destination,
        copy and wait for the copies."""
        if dest.event is not None:
            self.ipc.wait_event(owner, dest.event, dest.device)
        with self._destination(owner, dest) as flat:
            device = pool_index if dest.nbytes else None  # an empty buffer: nothing to copy
            return self.engine.device.get_into(
                keys, owner, flat, slots, device=device, dest_ready=True
            )

    @contextlib.contextmanager
    def _destination(self, owner: str, dest: IpcTensor) -> Iterator[torch.Tensor]:
        """A GetInto's destination as flat bytes, mapped until the block ends (an empty
        one maps nothing)."""
        if dest.nbytes == 0:
            yield torch.empty(0, dtype=torch.uint8)
            return
        with self.ipc.tensor(
            owner, dest.handle, dest.device, dest.alloc_size, dest.offset, dest.nbytes
        ) as flat:
            yield flat

    def _pool_index(self, gpu_uuid: str) -> int | None:
        """The device pool on that GPU, if the daemon has one (else copies come from the
        host pool)."""
        try:
            return self.engine.device.index_for(gpu_uuid)
        except DeviceUnavailable:
            return None

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
