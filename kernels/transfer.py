"""``transfer_ranges``: copy row ranges between host and device memory, any fragmentation.

Entries live in scattered page runs, and no single copy path is fast for every run size, so
one call takes the whole plan and picks the path. Backends (docs/kernels.md has the
measurements behind the dispatch rules):

- ``kernel``: a Triton persistent-grid copy that reads/writes pinned host memory through UVA,
  capped at ``TransferConfig.sm_budget`` programs so co-located work keeps its SMs;
- ``batch``: ``cudaMemcpyBatchAsync`` calls (copy engine; falls back to ``memcpy`` when
  absent);
- ``memcpy``: one ``cudaMemcpyAsync`` per range (falls back to ``torch`` without a runtime);
- ``torch``: a ``copy_`` loop, the CPU path;
- ``auto``: the copy engine where it is near link speed, the kernel for small runs, and both
  at once (split by bytes) in between, a zone that is empty by default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from embcache.kernels import _cudart
from embcache.kernels._env import interpreting
from embcache.kernels._plan import (
    Direction,
    IndexLike,
    TransferPlan,
    as_index_array,
    validate_plan,
)

Backend = Literal["auto", "kernel", "batch", "memcpy", "torch"]
BACKENDS: tuple[str, ...] = ("auto", "kernel", "batch", "memcpy", "torch")
KIB = 1024


@dataclass(frozen=True, slots=True)
class TransferConfig:
    """Settings of :func:`transfer_ranges`; pass one to override the defaults.

    The defaults come from the measurements in docs/kernels.md; every threshold is a field so
    that another GPU or link can be tuned without a code change.
    """

    sm_budget: int = 8
    """Most programs (each on one SM) the copy kernel runs; bounds its cost to other work."""
    num_warps: int = 8
    """Warps per kernel program."""
    tile_bytes: int = 32 * KIB
    """Bytes a kernel program loads at once (a block of runs x bytes): bytes in flight."""
    chunk_bytes: int = 8 * KIB
    """Longest piece of one run in a tile row; longer runs are cut into such chunks."""
    kernel_below_bytes: int = 128 * KIB
    """``auto``: plans whose mean run is shorter go to the kernel alone; below it the batched
    copy engine falls short of link speed while the kernel does not."""
    copy_engine_from_bytes: int = 128 * KIB
    """``auto``: plans whose mean run is at least this long go to the copy engine alone; runs in
    between are split between kernel and copy engine (no such zone by default: the split never
    beat the better of the two where it was measured)."""
    split_kernel_fraction: float = 0.35
    """``auto``, in between: the share of bytes the kernel copies while the copy engine runs."""
    copy_engine_streams: int = 1
    """``batch``: streams the ranges are spread over (several copy engines can run at once)."""
    batch_first_call: int = 16
    """``batch``: ranges in the first ``cudaMemcpyBatchAsync`` call; each next call takes twice
    as many, so the copy engine starts after a short call and later calls are queued while
    it copies (a long call's host time would otherwise all come first). 0: one call for all."""
    vector_device: bool = True
    """Kernel: 16-byte accesses to device memory when the plan is 16-byte aligned."""
    vector_host_loads: bool = True
    """Kernel: 16-byte loads from pinned host memory (host to device) when aligned."""
    vector_host_stores: bool = True
    """Kernel: 16-byte stores to pinned host memory (device to host) when aligned, which speeds
    up small runs. Alignment hints once made such stores slow in another kernel, so it stays
    switchable (docs/facts.md, docs/kernels.md)."""

    def __post_init__(self) -> None:
        for name in ("sm_budget", "num_warps", "tile_bytes", "chunk_bytes", "copy_engine_streams"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.batch_first_call < 0:
            raise ValueError(f"batch_first_call: must be >= 0, got {self.batch_first_call}")
        if self.num_warps & (self.num_warps - 1):
            raise ValueError(f"num_warps: must be a power of two, got {self.num_warps}")
        if not 0.0 <= self.split_kernel_fraction <= 1.0:
            raise ValueError("split_kernel_fraction: must lie in [0, 1]")
        if self.kernel_below_bytes > self.copy_engine_from_bytes:
            raise ValueError("kernel_below_bytes: must not exceed copy_engine_from_bytes")


DEFAULT_CONFIG = TransferConfig()


def choose_backend(
    num_ranges: int, total_bytes: int, config: TransferConfig, *, has_batch: bool
) -> str:
    """The ``auto`` rule for a CUDA plan: which backend copies it.

    Args:
        num_ranges: non-empty ranges in the plan.
        total_bytes: bytes the plan moves.
        config: the thresholds (``kernel_below_bytes``, ``copy_engine_from_bytes``).
        has_batch: whether the runtime has ``cudaMemcpyBatchAsync``.

    Returns:
        ``"memcpy"`` (one range, or large runs without a batch call), ``"batch"``,
        ``"kernel"`` or ``"split"``.
    """
    if num_ranges == 1:
        return "memcpy"  # one contiguous copy: the copy engine at no SM cost
    mean = total_bytes / num_ranges
    if mean >= config.copy_engine_from_bytes:
        return "batch" if has_batch else "memcpy"
    if mean < config.kernel_below_bytes or not has_batch:
        return "kernel"
    return "split"


def transfer_ranges_reference(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_starts: IndexLike,
    dst_starts: IndexLike,
    lengths: IndexLike,
) -> None:
    """The spec: ``dst[d:d+n] = src[s:s+n]`` for every range, in order. Mutates ``dst`` only.

    Args:
        src, dst: tensors indexed by row (dimension 0).
        src_starts, dst_starts, lengths: one entry per range, in rows.
    """
    s = as_index_array("src_starts", src_starts)
    d = as_index_array("dst_starts", dst_starts)
    n = as_index_array("lengths", lengths)
    for si, di, ni in zip(s.tolist(), d.tolist(), n.tolist(), strict=True):
        dst[di : di + ni].copy_(src[si : si + ni])


def _torch_loop(plan: TransferPlan) -> None:
    non_blocking = plan.direction != "cpu"
    with torch.no_grad():
        for s, d, n in zip(
            plan.src_starts.tolist(), plan.dst_starts.tolist(), plan.lengths.tolist(), strict=True
        ):
            plan.dst[d : d + n].copy_(plan.src[s : s + n], non_blocking=non_blocking)


def _host_device_pointer(plan: TransferPlan, rt: _cudart.CudaRuntime | None) -> int:
    """Device address of the host tensor; raises ``ValueError`` if it is not page-locked."""
    host = plan.host
    name = "src" if plan.direction == "h2d" else "dst"
    if rt is None:
        return host.data_ptr()  # UVA: same address
    try:
        with torch.cuda.device(plan.device):
            return rt.host_device_pointer(host.data_ptr())
    except _cudart.CudaRuntimeError:
        if host.is_pinned():
            return host.data_ptr()
        raise ValueError(f"{name}: is not page-locked (cudaHostGetDevicePointer failed)") from None


def _kernel(
    plan: TransferPlan, host_ptr: int, stream: torch.cuda.Stream | None, config: TransferConfig
) -> None:
    from embcache.kernels import _triton_copy

    if plan.direction == "cpu":
        src_ptr, dst_ptr = plan.src.data_ptr(), plan.dst.data_ptr()
    elif plan.direction == "h2d":
        src_ptr, dst_ptr = host_ptr, plan.dst.data_ptr()
    else:
        src_ptr, dst_ptr = plan.src.data_ptr(), host_ptr
    _triton_copy.launch_copy(plan, src_ptr, dst_ptr, stream, config)


def _run_cpu(plan: TransferPlan, backend: str, config: TransferConfig) -> str:
    if backend in ("auto", "torch"):
        _torch_loop(plan)
        return "torch"
    assert backend == "kernel" and interpreting(), backend
    _kernel(plan, 0, None, config)
    return "kernel"


def _run_cuda(
    plan: TransferPlan, backend: str, stream: torch.cuda.Stream, config: TransferConfig
) -> str:
    from embcache.kernels import _copy_engine

    rt = _cudart.runtime()
    has_batch = rt is not None and rt.has_batch
    if backend == "auto":
        backend = choose_backend(plan.num_ranges, plan.total_bytes, config, has_batch=has_batch)
    if backend == "batch" and not has_batch:
        backend = "memcpy"
    if backend == "memcpy" and rt is None:
        backend = "torch"
    # Resolve the host address first: a bad host buffer fails before anything is queued.
    host_ptr = _host_device_pointer(plan, rt) if backend in ("kernel", "split") else 0
    if backend == "torch":
        with torch.cuda.stream(stream):
            _torch_loop(plan)
    elif backend == "memcpy":
        assert rt is not None
        _copy_engine.memcpy_ranges(rt, plan, stream)
    elif backend == "batch":
        assert rt is not None
        _copy_engine.batch_ranges(
            rt, plan, stream, config.copy_engine_streams, config.batch_first_call
        )
    elif backend == "kernel":
        _kernel(plan, host_ptr, stream, config)
    else:
        assert backend == "split" and rt is not None, backend
        _split(rt, plan, host_ptr, stream, config)
    return backend


def _split(
    rt: _cudart.CudaRuntime,
    plan: TransferPlan,
    host_ptr: int,
    stream: torch.cuda.Stream,
    config: TransferConfig,
) -> None:
    """Kernel and copy engine at once: the first ranges (a share of the bytes) go to the kernel
    on ``stream``, the rest to one batch on a side stream joined back with events."""
    from embcache.kernels import _copy_engine

    cum = np.cumsum(plan.lengths)
    k = int(np.searchsorted(cum, config.split_kernel_fraction * cum[-1], side="right"))
    if k == plan.num_ranges:
        _kernel(plan, host_ptr, stream, config)
        return
    # Fork before the kernel is queued, or the side stream would wait for the kernel too.
    side = torch.cuda.Stream(plan.device)
    side.wait_stream(stream)
    if k > 0:
        _kernel(plan.select(slice(0, k)), host_ptr, stream, config)
    _copy_engine.batch_ranges(
        rt,
        plan.select(slice(k, None)),
        side,
        config.copy_engine_streams,
        config.batch_first_call,
    )
    stream.wait_stream(side)


def transfer_ranges(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_starts: IndexLike,
    dst_starts: IndexLike,
    lengths: IndexLike,
    *,
    stream: torch.cuda.Stream | None = None,
    backend: Backend = "auto",
    host_registered: bool = False,
    config: TransferConfig | None = None,
) -> str:
    """Copy ``dst[d:d+n] = src[s:s+n]`` for every range, asynchronously on ``stream``.

    The whole plan is validated before anything is queued, so a bad plan never leaves a
    destination half written. Keep both tensors alive until ``stream`` has run the copy.

    Args:
        src, dst: contiguous 2-D tensors of one dtype and row width: one on a CUDA device and
            the other in page-locked host memory (``pin_memory=True``, or registered with
            :func:`register_host_memory`), or both on the CPU.
        src_starts, dst_starts, lengths: one entry per range, in rows (lists, numpy arrays,
            or int32/int64 tensors). Destination ranges must not overlap.
        stream: the CUDA stream to queue on (default: the device's current stream); None
            for a CPU copy.
        backend: ``"auto"``, or a forced ``"kernel"``, ``"batch"``, ``"memcpy"``, ``"torch"``.
        host_registered: the host tensor is registered memory (``is_pinned()`` is False
            for it).
        config: thresholds and kernel settings (default: ``TransferConfig()``).

    Returns:
        The backend that ran: ``"none"`` for an empty plan, else ``"kernel"``, ``"batch"``,
        ``"memcpy"``, ``"torch"`` or ``"split"``.

    Raises:
        ValueError: naming the first bad argument (shapes, dtypes, devices, pageable host
            memory, bounds, overlapping destinations, a backend that cannot run here).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend: must be one of {BACKENDS}, got {backend!r}")
    if config is None:
        config = DEFAULT_CONFIG
    elif not isinstance(config, TransferConfig):
        raise ValueError(f"config: must be a TransferConfig, got {type(config)}")
    plan = validate_plan(
        src,
        dst,
        src_starts,
        dst_starts,
        lengths,
        host_registered=host_registered,
        stream=stream,
    )
    if plan.direction == "cpu":
        if backend not in ("auto", "torch", "kernel"):
            raise ValueError(f"backend: {backend!r} needs one tensor on a CUDA device")
        if backend == "kernel" and not interpreting():
            raise ValueError("backend: 'kernel' on CPU tensors needs the Triton interpreter")
        if plan.num_ranges == 0:
            return "none"
        return _run_cpu(plan, backend, config)
    if plan.num_ranges == 0:
        return "none"
    if stream is None:
        stream = torch.cuda.current_stream(plan.device)
    return _run_cuda(plan, backend, stream, config)


def transfer_planned(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_starts: np.ndarray,
    dst_starts: np.ndarray,
    lengths: np.ndarray,
    *,
    stream: torch.cuda.Stream | None = None,
    backend: Backend = "auto",
    config: TransferConfig | None = None,
) -> str:
    """:func:`transfer_ranges` without its checks: the same dispatch and backends.

    For a caller whose plan holds by construction. The daemon plans a cold get's copies from
    its allocators' own runs, and the copy starts only once this call is made, so the checks'
    host time would delay every get (docs/kernels.md, "copy_to_host_runs").

    Args:
        src, dst: contiguous 2-D tensors of one dtype and row width, one of them page-locked
            host memory and the other on ``stream``'s device (or both on the CPU).
        src_starts, dst_starts, lengths: int64 arrays, in rows: positive lengths, every range
            inside both tensors, destinations disjoint. Nothing checks this.
        stream, backend, config: as for :func:`transfer_ranges`.

    Returns:
        The backend that ran, as :func:`transfer_ranges` returns it.
    """
    if config is None:
        config = DEFAULT_CONFIG
    on_cpu = (src.device.type == "cpu", dst.device.type == "cpu")
    direction: Direction = "cpu" if all(on_cpu) else "h2d" if on_cpu[0] else "d2h"
    row_bytes = src.shape[1] * src.element_size()
    plan = TransferPlan(src, dst, src_starts, dst_starts, lengths, row_bytes, direction)
    if plan.num_ranges == 0:
        return "none"
    if direction == "cpu":
        return _run_cpu(plan, backend, config)
    if stream is None:
        stream = torch.cuda.current_stream(plan.device)
    return _run_cuda(plan, backend, stream, config)
