"""Copy one contiguous buffer into byte runs of a page-locked host buffer.

This is the shape of every put from a device: a client's tensor (one contiguous span of
device memory) lands in the host pages reserved for it, which the allocator hands out as a
few runs. :func:`~embcache.kernels.transfer_ranges` copies any row-range plan, but for this
shape its general checks and planning cost a sizeable share of a 4 MiB copy's time, and a
put waits for all of it (docs/kernels.md, "copy_to_host_runs"). Here only what this shape
needs is checked, and the copy engine is called directly: one ``cudaMemcpyAsync`` per run,
or one ``cudaMemcpyBatchAsync`` for many runs.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch

from embcache.kernels import _cudart
from embcache.kernels._env import on_device

MEMCPY_MAX_RUNS = 4  # up to this many runs: one cudaMemcpyAsync each (cheaper than a batch)


def copy_to_host_runs(
    src: torch.Tensor,
    host: torch.Tensor,
    runs: Sequence[tuple[int, int]],
    *,
    stream: torch.cuda.Stream | None = None,
    host_registered: bool = False,
) -> str:
    """Copy the bytes of ``src`` into byte runs of ``host``, filled in order.

    Everything is checked before any byte moves, so a refused call leaves ``host`` as it was.

    Args:
        src: a contiguous tensor on a CUDA device (the copy is queued on ``stream`` and is
            asynchronous) or on the CPU (copied at once).
        host: a contiguous CPU tensor; for a CUDA ``src``, page-locked memory.
        runs: ``(byte offset, byte count)`` pairs into ``host``, filled in order from
            ``src``'s first byte; they must not overlap, and the counts add up to ``src``'s
            size.
        stream: for a CUDA ``src``, a stream on its device (default: the current stream);
            None for a CPU ``src``.
        host_registered: ``host`` is registered memory (``is_pinned()`` is False for it).

    Returns:
        The way it copied: ``"none"`` (no bytes), ``"memcpy"``, ``"batch"`` or ``"torch"``.

    Raises:
        ValueError: naming the first bad argument.
    """
    pairs = _check(src, host, runs, stream, host_registered)
    if not pairs:
        return "none"
    if src.is_cpu:
        _torch_copies(src, host, pairs)
        return "torch"
    index = src.get_device()
    if stream is None:
        stream = torch.cuda.current_stream(index)
    rt = _cudart.runtime()
    if rt is None:
        with torch.cuda.stream(stream):
            _torch_copies(src, host, pairs)
        return "torch"
    with on_device(index):
        return _copy_engine(rt, src.data_ptr(), host.data_ptr(), pairs, stream.cuda_stream)


def queue_to_host_runs(
    src: torch.Tensor,
    host_ptr: int,
    runs: Sequence[tuple[int, int]],
    stream: torch.cuda.Stream | int,
) -> str:
    """:func:`copy_to_host_runs` without the checks, for arguments that hold by construction.

    The daemon's puts from a device make their runs from the host pool's own allocator and
    wait for the copy, so the checks' host time would delay every put (docs/kernels.md,
    "copy_to_host_runs"). Needs the CUDA runtime.

    Args:
        src: contiguous, on ``stream``'s CUDA device.
        host_ptr: the address of page-locked host memory.
        runs: ``(byte offset, byte count)`` pairs from ``host_ptr``: non-empty, in bounds,
            not overlapping, adding up to ``src``'s size. Nothing checks this.
        stream: a Stream, or a raw ``cudaStream_t``; the legacy default stream (0) takes
            one ``cudaMemcpyAsync`` per run, since the batch call refuses it.

    Returns:
        ``"memcpy"`` or ``"batch"``.
    """
    rt = _cudart.runtime()
    assert rt is not None, "queue_to_host_runs needs the CUDA runtime"
    handle = stream if isinstance(stream, int) else stream.cuda_stream
    with on_device(src.get_device()):
        return _copy_engine(rt, src.data_ptr(), host_ptr, list(runs), handle)


def _copy_engine(
    rt: _cudart.CudaRuntime, src_ptr: int, host_ptr: int, pairs: list[tuple[int, int]], handle: int
) -> str:
    if len(pairs) <= MEMCPY_MAX_RUNS or not rt.has_batch or handle == 0:
        done = 0
        for offset, count in pairs:
            rt.memcpy_async(host_ptr + offset, src_ptr + done, count, handle)
            done += count
        return "memcpy"
    table = np.array(pairs, dtype=np.uint64)
    sizes = table[:, 1]
    srcs = np.cumsum(sizes) - sizes + np.uint64(src_ptr)
    rt.memcpy_batch_async(table[:, 0] + np.uint64(host_ptr), srcs, sizes, handle)
    return "batch"


def _torch_copies(src: torch.Tensor, host: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
    flat = src.reshape(-1).view(torch.uint8)
    out = host.reshape(-1).view(torch.uint8)
    done = 0
    with torch.no_grad():
        for offset, count in pairs:
            out[offset : offset + count].copy_(flat[done : done + count], non_blocking=src.is_cuda)
            done += count


def _check(
    src: object,
    host: object,
    runs: object,
    stream: object,
    host_registered: bool,
) -> list[tuple[int, int]]:
    """The non-empty runs, after every check."""
    if not isinstance(src, torch.Tensor) or not isinstance(host, torch.Tensor):
        raise ValueError("src, host: must be torch.Tensors")
    if not src.is_contiguous() or not host.is_contiguous():
        raise ValueError("src, host: must be contiguous")
    if not host.is_cpu:
        raise ValueError(f"host: must be in host memory, got {host.device}")
    if src.is_cuda:  # (is_cuda and get_device: the cheap checks; a put waits for them all)
        if not (host_registered or host.is_pinned()):
            raise ValueError(
                "host: is pageable memory; pin it, or register it and pass host_registered=True"
            )
        if stream is not None and (
            not isinstance(stream, torch.cuda.Stream) or stream.device_index != src.get_device()
        ):
            raise ValueError(f"stream: must be a torch.cuda.Stream on {src.device}")
    elif src.is_cpu:
        if stream is not None:
            raise ValueError("stream: must be None for a CPU src")
    else:
        raise ValueError(f"src: must be on the CPU or a CUDA device, got {src.device}")
    pairs = _pairs(runs, host.numel() * host.element_size())
    total = sum(count for _, count in pairs)
    size = src.numel() * src.element_size()
    if total != size:
        raise ValueError(f"runs: hold {total} bytes, src has {size}")
    if src.is_cpu and pairs:
        s0, h0 = src.data_ptr(), host.data_ptr()
        if s0 < h0 + host.numel() * host.element_size() and h0 < s0 + size:
            raise ValueError("src: shares memory with host")
    return pairs


def _pairs(runs: object, host_bytes: int) -> list[tuple[int, int]]:
    if not isinstance(runs, list | tuple):
        raise ValueError(f"runs: must be a list or tuple of (offset, nbytes), got {type(runs)}")
    pairs = []
    for run in runs:
        if not isinstance(run, list | tuple) or len(run) != 2:
            raise ValueError(f"runs: each run is an (offset, nbytes) pair, got {run!r}")
        offset, count = run
        for value in run:
            if isinstance(value, bool) or not isinstance(value, int | np.integer):
                raise ValueError(f"runs: offsets and counts are integers, got {value!r}")
        offset, count = int(offset), int(count)
        if offset < 0 or count < 0:
            raise ValueError(f"runs: negative offset or count in {run!r}")
        if offset + count > host_bytes:
            raise ValueError(f"runs: ({offset}, {count}) ends past host's {host_bytes} bytes")
        if count:
            pairs.append((offset, count))
    ordered = sorted(pairs)
    for (o1, n1), (o2, _) in itertools.pairwise(ordered):
        if o2 < o1 + n1:
            raise ValueError(f"runs: ({o1}, {n1}) and ({o2}, ...) overlap")
    return pairs
