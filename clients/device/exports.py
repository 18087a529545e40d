"""CUDA tensors of this process described for the daemon, which copies them over IPC.

``PutFromDevice``, ``PutFromDeviceBatch`` and ``GetInto`` name the client's tensor by its
allocation's IPC handle and an offset, and carry an interprocess event recorded after the work
queued on the tensor so far: the daemon waits for it before it copies.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from embcache.clients.device.ipc_events import EVENTS, Recorded
from embcache.proto.embcache.v1 import embcache_pb2 as pb

log = logging.getLogger(__name__)


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
