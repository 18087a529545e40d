"""Copy-engine backends: per-range ``cudaMemcpyAsync`` and one ``cudaMemcpyBatchAsync``."""

from __future__ import annotations

import numpy as np
import torch

from embcache.kernels import _cudart
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


def queue_byte_ranges(
    dst_ptr: int,
    src_ptr: int,
    dst_offsets: np.ndarray,
    src_offsets: np.ndarray,
    sizes: np.ndarray,
    stream: torch.cuda.Stream,
    first_call: int = 16,
) -> str:
    """``sizes[i]`` bytes from ``src_ptr + src_offsets[i]`` to ``dst_ptr + dst_offsets[i]``
    for every i, queued on the copy engine of ``stream`` (a side stream of its own, not the
    legacy default one): :func:`~embcache.kernels.transfer_ranges`' ``batch`` (or ``memcpy``)
    path without its checks. For a caller whose plan holds by construction: int64 offsets
    and positive sizes, in bounds of both buffers, destinations disjoint, one side
    page-locked host memory (pinned or registered) and the other on ``stream``'s device.
    The daemon plans a get's copies from its allocators' own runs and its first copy waits
    for the whole call, so the checks' host time (about 0.1 ms per call on the H200 host)
    would delay every cold get. Returns ``"batch"`` or ``"memcpy"``. Needs the CUDA runtime."""
    rt = _cudart.runtime()
    assert rt is not None, "queue_byte_ranges needs the CUDA runtime"
    dsts = np.add(dst_offsets, dst_ptr, dtype=np.int64).view(np.uint64)
    srcs = np.add(src_offsets, src_ptr, dtype=np.int64).view(np.uint64)
    sizes = sizes.astype(np.uint64)
    handle = stream.cuda_stream
    with on_device(stream.device.index or 0):
        if len(sizes) == 1 or not rt.has_batch or handle == 0:
            for dst, src, size in zip(dsts.tolist(), srcs.tolist(), sizes.tolist(), strict=True):
                rt.memcpy_async(dst, src, size, handle)
            return "memcpy"
        _batch_calls(rt, dsts, srcs, sizes, handle, first_call)
    return "batch"


def _batch_calls(
    rt: CudaRuntime,
    dsts: np.ndarray,
    srcs: np.ndarray,
    sizes: np.ndarray,
    handle: int,
    first_call: int,
) -> None:
    for part in call_slices(len(sizes), first_call):
        rt.memcpy_batch_async(dsts[part], srcs[part], sizes[part], handle)


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
            _batch_calls(rt, dsts, srcs, sizes, stream.cuda_stream, first_call)
            return
        sides = [torch.cuda.Stream(plan.device) for _ in range(num_streams)]
        for i, side in enumerate(sides):
            side.wait_stream(stream)
            part = slice(i, None, num_streams)
            rt.memcpy_batch_async(dsts[part], srcs[part], sizes[part], side.cuda_stream)
        for side in sides:
            stream.wait_stream(side)
