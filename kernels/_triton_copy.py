"""Triton copy of row ranges between pinned host memory (through UVA) and device memory.

Imported on first use only: nothing that CPU-only code imports may import triton.

Reads over PCIe are latency bound, so each program keeps many bytes in flight by loading a
2-D block of ``BLOCK_R`` runs x ``BLOCK_C`` elements at once (a run is cut into chunks of at
most ``BLOCK_C`` elements on the host). The grid is persistent and capped by the SM budget,
because the kernel shares the GPU with the decoder's model. Every access is masked.
``tl.multiple_of`` hints are given only when every offset and length on that side is 16-byte
aligned, and each side can be switched off in ``TransferConfig``: such hints once made
device-to-host stores much slower in another kernel (docs/facts.md, "A pitfall of the
device-to-host kernel"; docs/kernels.md has the measurements of this one).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch
import triton
import triton.language as tl

from embcache.kernels._plan import TransferPlan


class TransferConfig(Protocol):
    """The knobs of ``transfer.TransferConfig`` the kernel's launcher reads."""

    @property
    def sm_budget(self) -> int: ...

    @property
    def num_warps(self) -> int: ...

    @property
    def tile_bytes(self) -> int: ...

    @property
    def chunk_bytes(self) -> int: ...

    @property
    def vector_host_loads(self) -> bool: ...

    @property
    def vector_device(self) -> bool: ...

    @property
    def vector_host_stores(self) -> bool: ...


_ELEM_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}
# Registers bound the tile: one 64-bit address per element, 8 warps -> 32 elements a thread.
_MAX_TILE_ELEMS = 8192


class _Pointer:
    """What Triton needs of a pointer argument: an address and an element type."""

    __slots__ = ("_ptr", "dtype")

    def __init__(self, ptr: int, dtype: torch.dtype) -> None:
        self._ptr = ptr
        self.dtype = dtype

    def data_ptr(self) -> int:
        return self._ptr


@triton.jit
def _copy_chunks_kernel(
    src,
    dst,
    desc,
    num_chunks,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    VEC: tl.constexpr,
    HINT_SRC: tl.constexpr,
    HINT_DST: tl.constexpr,
):
    # desc is int64 [3, num_chunks]: source offset, destination offset, length (elements).
    # HINT_*: every offset and length is a multiple of VEC elements (16 bytes), which lets the
    # compiler issue 16-byte accesses on that side (and keeps the mask uniform over a vector).
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    num_tiles = tl.cdiv(num_chunks, BLOCK_R)
    rows = tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_C)
    for tile in range(pid, num_tiles, nprog):
        r = tile * BLOCK_R + rows
        rmask = r < num_chunks
        s = tl.load(desc + r, mask=rmask, other=0)
        d = tl.load(desc + num_chunks + r, mask=rmask, other=0)
        n = tl.load(desc + 2 * num_chunks + r, mask=rmask, other=0)
        if HINT_SRC:
            s = tl.multiple_of(s, VEC)
        if HINT_DST:
            d = tl.multiple_of(d, VEC)
        if HINT_SRC or HINT_DST:
            n = tl.multiple_of(n, VEC)
        mask = cols[None, :] < n[:, None]
        vals = tl.load(src + (s[:, None] + cols[None, :]), mask=mask)
        tl.store(dst + (d[:, None] + cols[None, :]), vals, mask=mask)


def chunk_descriptors(
    src_off: np.ndarray, dst_off: np.ndarray, lengths: np.ndarray, chunk: int
) -> np.ndarray:
    """Cut ranges (in elements) into chunks of at most ``chunk``: int64 [3, num_chunks].

    Rows are source offset, destination offset and length. Bounding every chunk by the
    tile's width is what lets one tile load a block of several runs at once.
    """
    counts = -(-lengths // chunk)
    if int(counts.max(initial=0)) <= 1:  # no range needs cutting (e.g. 8 KiB runs)
        return np.stack([src_off, dst_off, lengths])
    idx = np.repeat(np.arange(len(lengths)), counts)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    within = (np.arange(len(idx), dtype=np.int64) - first) * chunk
    desc = np.empty((3, len(idx)), dtype=np.int64)
    desc[0] = src_off[idx] + within
    desc[1] = dst_off[idx] + within
    desc[2] = np.minimum(lengths[idx] - within, chunk)
    return desc


def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def launch_copy(
    plan: TransferPlan,
    src_ptr: int,
    dst_ptr: int,
    stream: torch.cuda.Stream | None,
    config: TransferConfig,
) -> None:
    """Copy all ranges of ``plan`` with one kernel launch.

    ``src_ptr``/``dst_ptr`` are device-visible addresses of the tensors' first bytes; on the CPU
    (Triton interpreter) they are the tensors' own addresses.
    """
    align = plan.element_bytes(src_ptr, dst_ptr, widest=16)
    w = min(align, 8)
    vec = align // w  # 2 when everything is 16-byte aligned
    elem = _ELEM_DTYPES[w]
    row_elems = plan.row_bytes // w
    lengths = plan.lengths * row_elems
    chunk_cap = max(1, config.chunk_bytes // w)
    block_c = max(min(_next_pow2(int(lengths.max())), _next_pow2(chunk_cap)), vec)
    desc_np = chunk_descriptors(
        plan.src_starts * row_elems, plan.dst_starts * row_elems, lengths, block_c
    )
    num_chunks = desc_np.shape[1]
    tile_elems = min(max(config.tile_bytes // w, block_c), _MAX_TILE_ELEMS)
    block_r = max(1, min(tile_elems // block_c, _next_pow2(num_chunks)))
    num_tiles = -(-num_chunks // block_r)
    grid = (max(1, min(config.sm_budget, num_tiles)),)
    h2d = plan.direction == "h2d"
    hint_src = vec > 1 and (config.vector_host_loads if h2d else config.vector_device)
    hint_dst = vec > 1 and (config.vector_device if h2d else config.vector_host_stores)
    meta = {
        "BLOCK_R": block_r,
        "BLOCK_C": block_c,
        "VEC": vec,
        "HINT_SRC": hint_src,
        "HINT_DST": hint_dst,
        "num_warps": config.num_warps,
    }
    if plan.direction == "cpu":  # Triton interpreter: real CPU tensors
        src = plan.src.view(-1).view(elem)
        dst = plan.dst.view(-1).view(elem)
        _copy_chunks_kernel[grid](src, dst, torch.from_numpy(desc_np), num_chunks, **meta)
        return
    assert stream is not None, "a CUDA launch needs a stream"
    with torch.cuda.device(plan.device), torch.cuda.stream(stream):
        desc = torch.from_numpy(desc_np).pin_memory().to(plan.device, non_blocking=True)
        _copy_chunks_kernel[grid](
            _Pointer(src_ptr, elem), _Pointer(dst_ptr, elem), desc, num_chunks, **meta
        )
