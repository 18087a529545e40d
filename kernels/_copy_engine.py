"""Copy-engine backends: per-range ``cudaMemcpyAsync`` and one ``cudaMemcpyBatchAsync``."""

from __future__ import annotations

import numpy as np
import torch
from embcache.kernels._cudart import CudaRuntime
from embcache.kernels._plan import TransferPlan


def _addresses(plan: TransferPlan) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rb = plan.row_bytes
    srcs = plan.src.data_ptr() + plan.src_starts * rb
    dsts = plan.dst.data_ptr() + plan.dst_starts * rb
    return dsts.astype(np.uint64), srcs.astype(np.uint64), (plan.lengths * rb).astype(np.uint64)


def memcpy_ranges(rt: CudaRuntime, plan: TransferPlan, stream: torch.cuda.Stream) -> None:
    """One ``cudaMemcpyAsync`` per range on ``stream``."""
    dsts, srcs, sizes = _addresses(plan)
    handle = stream.cuda_stream
    with torch.cuda.device(plan.device):
        for dst, src, size in zip(dsts.tolist(), srcs.tolist(), sizes.tolist(), strict=True):
            rt.memcpy_async(dst, src, size, handle)


def batch_ranges(rt: CudaRuntime, plan: TransferPlan, stream: torch.cuda.Stream) -> None:
    """All ranges in one ``cudaMemcpyBatchAsync`` on ``stream``.

    The call refuses the legacy default stream, so on it the batch runs on a side stream joined
    back with events: ordering on ``stream`` is as if the copy were issued there.
    """
    dsts, srcs, sizes = _addresses(plan)
    with torch.cuda.device(plan.device):
        if stream.cuda_stream != 0:
            rt.memcpy_batch_async(dsts, srcs, sizes, stream.cuda_stream)
            return
        side = torch.cuda.Stream(plan.device)
        side.wait_stream(stream)
        rt.memcpy_batch_async(dsts, srcs, sizes, side.cuda_stream)
        stream.wait_stream(side)
