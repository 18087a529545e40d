"""Copy-engine backends: per-range ``cudaMemcpyAsync`` and one ``cudaMemcpyBatchAsync``."""

from __future__ import annotations

import numpy as np
import torch

from embcache.kernels._cudart import CudaRuntime
from embcache.kernels._env import on_device
from embcache.kernels._plan import TransferPlan


def _addresses(plan: TransferPlan) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Destination and source addresses and byte counts, uint64. Computed in int64 (user
    addresses and validated offsets stay far below 2**63) and viewed as uint64, no copy."""
    rb = plan.row_bytes
    srcs = plan.src_starts * rb
    srcs += plan.src.data_ptr()
    dsts = plan.dst_starts * rb
    dsts += plan.dst.data_ptr()
    sizes = plan.lengths * rb
    return dsts.view(np.uint64), srcs.view(np.uint64), sizes.view(np.uint64)


def memcpy_ranges(rt: CudaRuntime, plan: TransferPlan, stream: torch.cuda.Stream) -> None:
    """One ``cudaMemcpyAsync`` per range on ``stream``."""
    dsts, srcs, sizes = _addresses(plan)
    handle = stream.cuda_stream
    with on_device(plan.device.index or 0):
        for dst, src, size in zip(dsts.tolist(), srcs.tolist(), sizes.tolist(), strict=True):
            rt.memcpy_async(dst, src, size, handle)


def call_slices(count: int, first: int) -> list[slice]:
    """Ranges per ``cudaMemcpyBatchAsync`` call: ``first``, then twice as many each time
    (``first`` 0: one call)."""
    if first <= 0 or count <= first:
        return [slice(0, count)]
    out, start, size = [], 0, first
    while start < count:
        out.append(slice(start, min(count, start + size)))
        start += size
        size *= 2
    return out


def batch_ranges(
    rt: CudaRuntime,
    plan: TransferPlan,
    stream: torch.cuda.Stream,
    num_streams: int = 1,
    first_call: int = 0,
) -> None:
    """The ranges in ``cudaMemcpyBatchAsync`` calls: on ``stream`` (in calls of growing size,
    see :func:`call_slices`), or one on each of ``num_streams`` side streams (ranges dealt
    round-robin), joined back with events.

    The call refuses the legacy default stream, so there it always runs on a side stream;
    ordering on ``stream`` is as if the copy were issued there.
    """
    dsts, srcs, sizes = _addresses(plan)
    num_streams = max(1, min(num_streams, plan.num_ranges))
    with on_device(plan.device.index or 0):
        if num_streams == 1 and stream.cuda_stream != 0:
            for part in call_slices(len(sizes), first_call):
                rt.memcpy_batch_async(dsts[part], srcs[part], sizes[part], stream.cuda_stream)
            return
        sides = [torch.cuda.Stream(plan.device) for _ in range(num_streams)]
        for i, side in enumerate(sides):
            side.wait_stream(stream)
            part = slice(i, None, num_streams)
            rt.memcpy_batch_async(dsts[part], srcs[part], sizes[part], side.cuda_stream)
        for side in sides:
            stream.wait_stream(side)
