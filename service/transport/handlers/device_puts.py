"""``PutFromDevice`` and ``PutFromDeviceBatch``: the daemon copies clients' CUDA tensors.

Every item is validated before any IPC handle is opened. Then, on the event loop: wait for
the client's event (polled, as a get's copies are: ``poll_until``), map its allocation
(once per allocation: ``IpcCache``), reserve pages and queue the copies
(``engine.device.start_put_many``), wait for them the same way and commit. No worker
thread: the hand-off to one and back cost a small put more than its bookkeeping on the loop
(docs/grpc.md, "Server"). Batches of more than :data:`INLINE_ITEMS` items, whose
bookkeeping would hold up the loop, still run in a worker thread. A batch makes one entry
per item and waits once for all the copies, so an encoder that produces several embeddings
pays for one call and one wait; it is all or nothing: when any item fails, none becomes
visible. A call cancelled while its copies run gives its pages back once they are complete.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from embcache.errors import InvalidArgument
from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.service.config import Settings
from embcache.service.device.ipc.cache import ClientEvent, IpcCache
from embcache.service.engine import CacheEngine
from embcache.service.engine.device_puts import PendingPut
from embcache.service.host import admission
from embcache.service.transport.device_get import in_thread, poll_until, wait_copies
from embcache.service.transport.handlers.ipc_tensors import IpcTensor, check_tensor, require_cuda

log = logging.getLogger("embcache.grpc")

MAX_BATCH_ITEMS = 1024  # items in one PutFromDeviceBatch
INLINE_ITEMS = 64  # larger batches run in a worker thread


@dataclass(slots=True)
class DevicePuts:
    """What the put handlers work with: the engine, its settings, and the IPC cache that
    maps clients' memory."""

    engine: CacheEngine
    settings: Settings
    ipc: IpcCache


def _checked(
    plane: DevicePuts, item: pb.PutFromDeviceRequest, what: str, method: str
) -> tuple[str, IpcTensor, int | None]:
    require_cuda(plane.ipc, method, item.tensor.gpu_uuid)
    key = admission.check_key(item.key, plane.settings)
    t = item.tensor
    meta = admission.check_meta(t.dtype, list(t.shape), None, plane.settings)
    src = check_tensor(plane.ipc, t, meta.dtype, meta.shape, what)
    crc = admission.check_checksum(item.checksum if item.HasField("checksum") else None)
    return key, src, crc


def _events(plane: DevicePuts, owner: str, sources: list[IpcTensor]) -> Iterator[ClientEvent]:
    """The clients' events, each distinct one once (a batch's tensors usually share one,
    recorded after all of them were written)."""
    for handle, device in dict.fromkeys((s.event, s.device) for s in sources if s.event):
        yield plane.ipc.event(owner, handle, device)


def _mapped(
    plane: DevicePuts, stack: contextlib.ExitStack, owner: str, src: IpcTensor
) -> torch.Tensor:
    """The client's tensor, readable in this process until ``stack`` closes. An empty
    tensor is not mapped."""
    if src.nbytes == 0:
        return torch.empty(src.shape, dtype=src.dtype.torch_dtype)
    flat = stack.enter_context(
        plane.ipc.tensor(owner, src.handle, src.device, src.alloc_size, src.offset, src.nbytes)
    )
    return flat.view(src.dtype.torch_dtype).view(src.shape)


async def put_from_device(
    plane: DevicePuts, request: pb.PutFromDeviceRequest, owner: str, quota: str | None = None
) -> pb.PutResponse:
    """One client tensor into the host pool; answers once its bytes are there. ``owner``
    holds the IPC mappings, ``quota`` (default ``owner``) the in-flight bytes."""
    key, src, crc = _checked(plane, request, "tensor", "PutFromDevice")
    [created] = await _put(plane, owner, [(key, src, crc)], quota or owner)
    return pb.PutResponse(created=created, nbytes=src.nbytes)


async def put_from_device_batch(
    plane: DevicePuts, request: pb.PutFromDeviceBatchRequest, owner: str, quota: str | None = None
) -> pb.PutFromDeviceBatchResponse:
    """Several client tensors with one wait, all or nothing (module docstring)."""
    # A daemon without CUDA refuses the call, even empty: the client should stream bytes.
    gpu_uuid = request.items[0].tensor.gpu_uuid if request.items else ""
    require_cuda(plane.ipc, "PutFromDeviceBatch", gpu_uuid)
    if len(request.items) > MAX_BATCH_ITEMS:
        raise InvalidArgument(
            "too many items in one batch", items=len(request.items), most=MAX_BATCH_ITEMS
        )
    checked = [
        _checked(plane, item, f"items[{i}].tensor", "PutFromDeviceBatch")
        for i, item in enumerate(request.items)
    ]
    if len({key for key, _, _ in checked}) != len(checked):
        raise InvalidArgument("a key appears more than once in the batch")
    if not checked:
        return pb.PutFromDeviceBatchResponse()
    created = await _put(plane, owner, checked, quota or owner)
    return pb.PutFromDeviceBatchResponse(
        results=[
            pb.PutResponse(created=c, nbytes=src.nbytes)
            for c, (_, src, _) in zip(created, checked, strict=True)
        ]
    )


async def _put(
    plane: DevicePuts, owner: str, checked: list[tuple[str, IpcTensor, int | None]], quota: str
) -> list[bool]:
    sources = [src for _, src, _ in checked]
    crcs = [crc for _, _, crc in checked]
    if len(checked) > INLINE_ITEMS:

        def run() -> list[bool]:
            for event in _events(plane, owner, sources):
                event.wait()
            with contextlib.ExitStack() as stack:  # every mapping open until all copied
                items = [(key, _mapped(plane, stack, owner, src)) for key, src, _ in checked]
                return plane.engine.device.put_many(
                    items, owner=quota, checksums=crcs, src_ready=True
                )

        return await in_thread(run)
    for event in _events(plane, owner, sources):
        await poll_until(event.fired, event.wait)
    stack = contextlib.ExitStack()  # every mapping open until the copies are complete
    try:
        items = [(key, _mapped(plane, stack, owner, src)) for key, src, _ in checked]
        # src_ready: the client's event has fired (or it synchronized before the call).
        pending = plane.engine.device.start_put_many(
            items, owner=quota, checksums=crcs, src_ready=True
        )
    except BaseException:
        stack.close()
        raise
    try:
        await wait_copies(pending)
    except BaseException:  # cancelled, or the device failed: give the pages back
        _abort_when_copied(pending, stack)
        raise
    with stack:
        return pending.finish()


def _abort_when_copied(pending: PendingPut, stack: contextlib.ExitStack) -> None:
    """Abort ``pending`` and close its mappings once its copies are complete, waiting in a
    worker thread when they are not (freed pages must not still be copied into)."""

    def abort() -> None:
        with stack:
            pending.abort()

    if pending.done():
        abort()
        return

    def report(future: asyncio.Future[None]) -> None:
        if not future.cancelled() and future.exception() is not None:
            log.error("giving back a failed put's pages failed: %s", future.exception())

    asyncio.get_running_loop().run_in_executor(None, abort).add_done_callback(report)
