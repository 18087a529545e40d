"""Copies of an entry's byte runs out of this process's mapping of the host pool.

:func:`copy_runs_to_cuda` queues the copy into a CUDA tensor from the registered mapping
(``registered.py``) and answers None, queuing nothing, while the chunks it would read are not
registered yet: the caller then asks the daemon. :func:`copy_runs_to_host` is the plain CPU
copy. Neither validates the entry: the caller checks the read table's slot afterwards
(``read_table.ReadTable.unchanged``), once the copy is complete (for a GPU copy: once the
returned event has fired).

A run that crosses a chunk boundary is copied as two pieces, since each chunk is its own
registration. One piece is one ``copy_`` (the copy engine); several go through
``kernels.transfer_planned`` (its dispatch: batched copy engine for large runs, the UVA kernel
for small ones), in rows of the widest power of two up to 16 bytes that divides every piece,
with a last piece's odd tail copied on its own. The kernel addresses every registered chunk
from one base, which holds where the device reads registered memory at its host address
(``DEV_ATTR_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM``, true on x86-64 Linux with UVA); where it
does not, pieces in several chunks go to the copy engine, piece by piece.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from embcache.clients.device.pool_chunks import Piece, PoolChunks
from embcache.clients.device.registered import RegisteredPool
from embcache.clients.device.shm import PoolMapping

if TYPE_CHECKING:
    from embcache.kernels.transfer import Backend

_WIDEST_ROW = 16  # bytes: the kernel's widest access


def copy_runs_to_cuda(
    pool: PoolMapping,
    reg: RegisteredPool,
    runs: Sequence[tuple[int, int]],
    out: torch.Tensor,
    stream: torch.cuda.Stream | None = None,
) -> torch.cuda.Event | None:
    """Queue copies of ``runs`` of the pool, in order, into ``out``'s bytes.

    Args:
        pool: this process's mapping of the pool (``reg`` registers it).
        reg: its registration (:func:`~embcache.clients.device.registered.registered_pool`).
        runs: (byte offset in the segment, byte length) pairs that together fill ``out``.
        out: a contiguous CUDA tensor of exactly ``sum(lengths)`` bytes, any dtype.
        stream: where to queue (default: the current stream of ``out``'s device).

    Returns:
        An event recorded on ``stream`` after the copies (wait for it, then check the slot),
        or None, with nothing queued, when a run leaves the segment or a chunk it reads is not
        registered (yet, or ever): copy another way.

    Raises:
        ValueError: ``out`` is not a contiguous CUDA tensor of that many bytes, ``reg`` is
            not ``pool``'s registration, or ``stream`` is on another device.
    """
    if not isinstance(out, torch.Tensor) or out.device.type != "cuda":
        raise ValueError("out: must be a CUDA tensor")
    if not out.is_contiguous():
        raise ValueError("out: must be contiguous")
    if not reg.is_for(pool):
        raise ValueError(f"reg: registers another mapping than pool {pool.name!r}")
    nbytes = out.numel() * out.element_size()
    total = sum(length for _, length in runs)
    if total != nbytes:
        raise ValueError(f"out: holds {nbytes} bytes, the runs {total}")
    if stream is None:
        stream = torch.cuda.current_stream(out.device)
    elif stream.device != out.device:
        raise ValueError(f"stream: is on {stream.device}, out on {out.device}")
    pieces = reg.chunks.split(runs)
    if pieces is None:
        return None
    dst = out.reshape(-1).view(torch.uint8)
    chunks = sorted({p.chunk for p in pieces})

    def queue() -> torch.cuda.Event:
        with torch.cuda.stream(stream):
            _queue_pieces(pool, reg, pieces, dst, stream)
            event = torch.cuda.Event()
            event.record(stream)
        return event

    event = reg.queue_if_covered(chunks, queue)
    assert event is None or isinstance(event, torch.cuda.Event)
    return event


@dataclass(frozen=True, slots=True)
class PiecePlan:
    """Pieces of several chunks as one row-range plan over the pool from ``base``."""

    base: int  # byte offset in the segment of the source tensor's first row
    top: int  # byte offset in the segment just past its last row
    row: int  # bytes per row
    src_rows: np.ndarray  # int64, rows from ``base``
    dst_rows: np.ndarray  # int64, rows from the destination's start
    lengths: np.ndarray  # int64, rows
    tail: int  # bytes past the last whole row, copied apart into the destination's end
    tail_src: int  # byte offset in the segment of those bytes
    chunks: int  # distinct chunks read


def plan_pieces(chunks: PoolChunks, pieces: Sequence[Piece]) -> PiecePlan:
    """The row-range plan of two or more pieces laid end to end in the destination."""
    assert len(pieces) >= 2, pieces
    offsets = [p.offset for p in pieces]
    lengths = [p.length for p in pieces]
    dst_at = [0, *itertools.accumulate(lengths[:-1])]
    # Table runs start on pages and only an entry's last run ends short of one, so the row
    # is set by every piece but the last, whose odd tail is copied apart.
    row = row_bytes_for(*offsets, *dst_at, *lengths[:-1])
    tail = lengths[-1] % row
    lengths[-1] -= tail
    # The source tensor starts at the first chunk read: the kernel path asks CUDA for the
    # device address of its first byte, which must lie in registered memory.
    used = {p.chunk for p in pieces}
    base = chunks.bounds(min(used))[0]
    top = max(o + n for o, n in zip(offsets, lengths, strict=True))
    so = (np.array(offsets, dtype=np.int64) - base) // row
    do = np.array(dst_at, dtype=np.int64) // row
    ln = np.array(lengths, dtype=np.int64) // row
    if ln[-1] == 0:  # the last piece was shorter than a row: all tail
        so, do, ln = so[:-1], do[:-1], ln[:-1]
    tail_src = offsets[-1] + lengths[-1]
    return PiecePlan(base, top, row, so, do, ln, tail, tail_src, len(used))


def run_piece_plan(
    plan: PiecePlan,
    src: torch.Tensor,
    dst: torch.Tensor,
    stream: torch.cuda.Stream | None,
    backend: Backend = "auto",
) -> None:
    """Queue ``plan`` from ``src`` (the pool's uint8 tensor) into ``dst`` (uint8, exactly the
    plan's bytes): on ``stream`` for a CUDA ``dst``, at once for a CPU one."""
    from embcache.kernels import transfer_planned

    if plan.tail:
        at = plan.tail_src
        dst[dst.numel() - plan.tail :].copy_(src[at : at + plan.tail], non_blocking=True)
    transfer_planned(
        src[plan.base : plan.top].view(-1, plan.row),
        dst[: dst.numel() - plan.tail].view(-1, plan.row),
        plan.src_rows,
        plan.dst_rows,
        plan.lengths,
        stream=stream,
        backend=backend,
    )


def _queue_pieces(
    pool: PoolMapping,
    reg: RegisteredPool,
    pieces: list[Piece],
    dst: torch.Tensor,
    stream: torch.cuda.Stream,
) -> None:
    if not pieces:
        return
    if len(pieces) == 1:
        p = pieces[0]
        dst.copy_(pool.tensor[p.offset : p.offset + p.length], non_blocking=True)
        return
    plan = plan_pieces(reg.chunks, pieces)
    # Without one base address for all chunks, only copy-engine copies (each resolved
    # against its own registration) are right.
    one_base = plan.chunks == 1 or _host_pointer_is_device_pointer(dst.device.index or 0)
    run_piece_plan(plan, pool.tensor, dst, stream, "auto" if one_base else "batch")


def row_bytes_for(*values: int, widest: int = _WIDEST_ROW) -> int:
    """The widest power of two up to ``widest`` dividing every value (as the daemon plans
    its device loads: rows of up to 16 bytes)."""
    w = widest
    for v in values:
        while w > 1 and v % w:
            w //= 2
    return w


@functools.cache
def _host_pointer_is_device_pointer(device: int) -> bool:
    """Whether ``device`` reads registered host memory at its host address, so one base
    address serves every separately registered chunk."""
    from embcache.kernels import _cudart

    rt = _cudart.runtime()
    if rt is None:
        return False
    attr = _cudart.DEV_ATTR_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM
    return rt.device_attribute(attr, device) == 1


def copy_runs_to_host(
    pool: PoolMapping, runs: Sequence[tuple[int, int]], out: torch.Tensor | None = None
) -> torch.Tensor | None:
    """The bytes of ``runs`` of the pool, in order, copied into ``out`` (a contiguous CPU
    tensor of exactly ``sum(lengths)`` bytes, any dtype) or a new uint8 tensor.

    Returns:
        ``out`` (or the new tensor); None, copying nothing, when a run is negative or leaves
        the segment (a table slot read while it changed).

    Raises:
        ValueError: ``out`` is not a contiguous CPU tensor of that many bytes.
    """
    total = 0
    for offset, length in runs:
        if offset < 0 or length < 0 or offset + length > pool.size:
            return None
        total += length
    if out is None:
        out = torch.empty(total, dtype=torch.uint8)
    elif not isinstance(out, torch.Tensor) or out.device.type != "cpu":
        raise ValueError("out: must be a CPU tensor")
    elif not out.is_contiguous():
        raise ValueError("out: must be contiguous")
    elif out.numel() * out.element_size() != total:
        raise ValueError(f"out: holds {out.numel() * out.element_size()} bytes, the runs {total}")
    dst, src, pos = out.reshape(-1).view(torch.uint8), pool.tensor, 0
    for offset, length in runs:
        dst[pos : pos + length].copy_(src[offset : offset + length])
        pos += length
    return out
