"""Client CUDA tensors named in requests (``CudaIpcTensor``), checked before any is opened.

A put from a device and a get-into name a client's memory by a ``cudaIpcMemHandle``, a
device, a dtype and a shape. Every field is checked here, against the others and against
the allocation it claims to lie in, before the daemon maps anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from embcache.errors import DeviceUnavailable, InvalidArgument
from embcache.proto.dtypes import DType
from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.service.device.ipc.cache import IpcCache, check_ipc_handle
from embcache.service.host import admission

_UINT63 = 2**63


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


def require_cuda(ipc: IpcCache, what: str, gpu_uuid: str) -> None:
    """DeviceUnavailable unless this daemon can open client GPU memory."""
    if not ipc.backend.available():
        raise DeviceUnavailable(
            f"{what} reads or writes client GPU memory and needs CUDA, which this daemon "
            "does not use; stream the bytes instead (Put / Get)",
            gpu_uuid=gpu_uuid,
        )


def check_tensor(
    ipc: IpcCache, t: pb.CudaIpcTensor, dtype: DType, shape: tuple[int, ...], what: str
) -> IpcTensor:
    """``t`` validated: a legacy IPC handle, contiguous, inside its allocation, on a GPU
    this daemon sees."""
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
    if list(t.strides) and list(t.strides) != contiguous_strides(shape, list(t.strides)):
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
    device = ipc.backend.gpu_index(t.gpu_uuid)
    if device is None:
        raise DeviceUnavailable("the daemon does not see this GPU", gpu_uuid=t.gpu_uuid)
    return IpcTensor(handle, device, dtype, shape, nbytes, t.offset, t.alloc_size, event)


def shape_of(dims: Sequence[int], what: str) -> tuple[int, ...]:
    """A wire shape, checked: at most ``MAX_NDIM`` dims, none negative."""
    if len(dims) > admission.MAX_NDIM or any(d < 0 for d in dims):
        raise InvalidArgument(f"{what} must be at most 8 dims >= 0", shape=list(dims))
    return tuple(dims)


def contiguous_strides(shape: Sequence[int], given: list[int]) -> list[int]:
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
