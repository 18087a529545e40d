"""``PutFromDevice`` and ``PutFromDeviceBatch``: the daemon copies clients' CUDA tensors.

Every item is validated before any IPC handle is opened. The copies run in a worker thread
(they wait for the client's event and map its allocation, once per allocation: ``IpcCache``).
A batch makes one entry per item and waits once for all the copies, so an encoder that
produces several embeddings pays for one call and one wait; it is all or nothing (the
engine's ``put_from_device_many``): when any item fails, none becomes visible.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

from ...proto.embcache.v1 import embcache_pb2 as pb
from .. import admission
from ..errors import InvalidArgument

if TYPE_CHECKING:
    from .grpc_device import DevicePlane, IpcTensor

MAX_BATCH_ITEMS = 1024  # items in one PutFromDeviceBatch


def _checked(
    plane: DevicePlane, item: pb.PutFromDeviceRequest, what: str, method: str
) -> tuple[str, IpcTensor, int | None]:
    plane._require_cuda(method, item.tensor.gpu_uuid)
    key = admission.check_key(item.key, plane.settings)
    t = item.tensor
    meta = admission.check_meta(t.dtype, list(t.shape), None, plane.settings)
    src = plane._check_tensor(t, meta.dtype, meta.shape, what)
    crc = admission.check_checksum(item.checksum if item.HasField("checksum") else None)
    return key, src, crc


def _wait_events(plane: DevicePlane, owner: str, sources: list[IpcTensor]) -> None:
    """Wait (worker thread) for the clients' events, each distinct one once: a batch's
    tensors usually share one event, recorded after all of them were written."""
    for event, device in dict.fromkeys((s.event, s.device) for s in sources if s.event):
        plane.ipc.wait_event(owner, event, device)


def _mapped(
    plane: DevicePlane, stack: contextlib.ExitStack, owner: str, src: IpcTensor
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
    plane: DevicePlane, request: pb.PutFromDeviceRequest, owner: str
) -> pb.PutResponse:
    from .grpc_device import in_thread

    key, src, crc = _checked(plane, request, "tensor", "PutFromDevice")

    def run() -> bool:
        _wait_events(plane, owner, [src])
        with contextlib.ExitStack() as stack:
            tensor = _mapped(plane, stack, owner, src)
            return plane.engine.put_from_device(key, tensor, owner=owner, checksum=crc)

    created = await in_thread(run)
    return pb.PutResponse(created=created, nbytes=src.nbytes)


async def put_from_device_batch(
    plane: DevicePlane, request: pb.PutFromDeviceBatchRequest, owner: str
) -> pb.PutFromDeviceBatchResponse:
    from .grpc_device import in_thread

    # A daemon without CUDA refuses the call, even empty: the client should stream bytes.
    plane._require_cuda(
        "PutFromDeviceBatch", request.items[0].tensor.gpu_uuid if request.items else ""
    )
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

    def run() -> list[bool]:
        _wait_events(plane, owner, [src for _, src, _ in checked])
        with contextlib.ExitStack() as stack:  # every mapping stays open until all copied
            items = [(key, _mapped(plane, stack, owner, src)) for key, src, _ in checked]
            crcs = [crc for _, _, crc in checked]
            return plane.engine.put_from_device_many(items, owner=owner, checksums=crcs)

    created = await in_thread(run)
    return pb.PutFromDeviceBatchResponse(
        results=[
            pb.PutResponse(created=c, nbytes=src.nbytes)
            for c, (_, src, _) in zip(created, checked, strict=True)
        ]
    )
