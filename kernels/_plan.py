"""Validation of a row-range copy plan: everything is checked before any byte moves."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

IndexLike = torch.Tensor | np.ndarray | list[int] | tuple[int, ...]
Direction = Literal["h2d", "d2h", "cpu"]


@dataclass(frozen=True, slots=True)
class TransferPlan:
    """A validated plan; the index arrays hold only the non-empty ranges (int64, rows)."""

    src: torch.Tensor
    dst: torch.Tensor
    src_starts: np.ndarray
    dst_starts: np.ndarray
    lengths: np.ndarray
    row_bytes: int
    direction: Direction

    @property
    def num_ranges(self) -> int:
        return len(self.lengths)

    @property
    def total_bytes(self) -> int:
        return int(self.lengths.sum()) * self.row_bytes

    @property
    def device(self) -> torch.device:
        """The CUDA device of the plan (the CPU for CPU-only plans)."""
        return self.dst.device if self.direction == "h2d" else self.src.device

    @property
    def host(self) -> torch.Tensor:
        return self.src if self.direction == "h2d" else self.dst

    def element_bytes(self, *pointers: int, widest: int = 8) -> int:
        """Widest power of two up to ``widest`` dividing the row size and every base pointer."""
        g = math.gcd(self.row_bytes, *pointers)
        w = widest
        while g % w:
            w //= 2
        return w

    def select(self, index: np.ndarray | slice) -> TransferPlan:
        """The sub-plan made of some of the ranges."""
        return TransferPlan(
            self.src,
            self.dst,
            self.src_starts[index],
            self.dst_starts[index],
            self.lengths[index],
            self.row_bytes,
            self.direction,
        )


def as_index_array(name: str, value: object) -> np.ndarray:
    """A 1-D int64 numpy copy of a list, numpy array or integer tensor of row indices."""
    if isinstance(value, torch.Tensor):
        if value.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"{name}: must be an int64 or int32 tensor, got {value.dtype}")
        if value.dim() != 1:
            raise ValueError(f"{name}: must be 1-D, got shape {tuple(value.shape)}")
        return value.detach().cpu().numpy().astype(np.int64)
    if isinstance(value, np.ndarray):
        arr = value
    elif isinstance(value, list | tuple):
        if len(value) == 0:
            return np.zeros(0, dtype=np.int64)
        if any(isinstance(v, bool) for v in value):
            raise ValueError(f"{name}: must hold integers, got a bool")
        try:
            arr = np.asarray(value)
        except (OverflowError, ValueError) as exc:
            raise ValueError(f"{name}: must hold integers ({exc})") from None
    else:
        raise ValueError(f"{name}: must be a list, numpy array or tensor, got {type(value)}")
    if arr.ndim != 1:
        raise ValueError(f"{name}: must be 1-D, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"{name}: must hold integers, got dtype {arr.dtype}")
    if arr.dtype == np.uint64 and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        raise ValueError(f"{name}: value {int(arr.max())} is out of range")
    return arr.astype(np.int64, copy=False)


def _check_tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: must be a torch.Tensor, got {type(t)}")
    if t.dim() != 2:
        raise ValueError(f"{name}: must be 2-D [rows, width], got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: must be contiguous")
    if t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name}: must be on the CPU or a CUDA device, got {t.device}")
    return t


def _direction(
    src: torch.Tensor, dst: torch.Tensor, host_registered: bool, stream: object
) -> Direction:
    kinds = (src.device.type, dst.device.type)
    if kinds == ("cpu", "cpu"):
        if stream is not None:
            raise ValueError("stream: must be None when src and dst are both on the CPU")
        return "cpu"
    if kinds == ("cuda", "cuda"):
        raise ValueError("dst: one of src and dst must be in host memory, both are on CUDA")
    direction: Direction = "h2d" if kinds[0] == "cpu" else "d2h"
    host_name, host = ("src", src) if direction == "h2d" else ("dst", dst)
    if not (host_registered or host.is_pinned()):
        raise ValueError(
            f"{host_name}: is pageable host memory; pin it, or register it and pass "
            "host_registered=True"
        )
    device = dst.device if direction == "h2d" else src.device
    if stream is not None:
        if not isinstance(stream, torch.cuda.Stream):
            raise ValueError(f"stream: must be a torch.cuda.Stream or None, got {type(stream)}")
        if stream.device != device:
            raise ValueError(f"stream: is on {stream.device}, the copy on {device}")
    return direction


def _check_overlap(src: torch.Tensor, dst: torch.Tensor) -> None:
    s0, d0 = src.data_ptr(), dst.data_ptr()
    s1 = s0 + src.numel() * src.element_size()
    d1 = d0 + dst.numel() * dst.element_size()
    if s0 < d1 and d0 < s1:
        raise ValueError("dst: shares memory with src")


def validate_plan(
    src: object,
    dst: object,
    src_starts: object,
    dst_starts: object,
    lengths: object,
    *,
    host_registered: bool = False,
    stream: object = None,
) -> TransferPlan:
    """Check every argument of :func:`transfer_ranges`; ``ValueError`` names the first bad one."""
    src = _check_tensor("src", src)
    dst = _check_tensor("dst", dst)
    if src.dtype != dst.dtype:
        raise ValueError(f"dst: dtype {dst.dtype} differs from src dtype {src.dtype}")
    if src.shape[1] != dst.shape[1]:
        raise ValueError(f"dst: row width {dst.shape[1]} differs from src width {src.shape[1]}")
    direction = _direction(src, dst, host_registered, stream)
    if direction == "cpu":
        _check_overlap(src, dst)
    s = as_index_array("src_starts", src_starts)
    d = as_index_array("dst_starts", dst_starts)
    n = as_index_array("lengths", lengths)
    if not len(s) == len(d) == len(n):
        raise ValueError(
            f"lengths: src_starts, dst_starts and lengths differ in length "
            f"({len(s)}, {len(d)}, {len(n)})"
        )
    if len(n) <= _SMALL:
        s, d, n = _check_ranges_small(s, d, n, src.shape[0], dst.shape[0])
    else:
        s, d, n = _check_ranges(s, d, n, src.shape[0], dst.shape[0])
    row_bytes = src.shape[1] * src.element_size()
    if row_bytes == 0:
        s, d, n = s[:0], d[:0], n[:0]
    return TransferPlan(src, dst, s, d, n, row_bytes, direction)


_SMALL = 64  # plans up to this many ranges are checked in plain Python (no numpy call costs)


def _check_ranges(
    s: np.ndarray, d: np.ndarray, n: np.ndarray, src_rows: int, dst_rows: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Bounds and destination overlap of a plan; returns it without its empty ranges.

    The three columns are checked together (one reduction each for min, max and ends):
    numpy's per-call cost, not the work, is what a plan of a few hundred ranges pays. A
    plan whose destinations come in order (what the engine builds) needs no sort: one
    comparison of each range's end with the next start shows both order and no overlap."""
    if not len(n):
        return s, d, n
    cols = np.stack((s, d, n))
    lo = cols.min(axis=1)
    for name, low in zip(("src_starts", "dst_starts", "lengths"), lo.tolist(), strict=True):
        if low < 0:
            raise ValueError(f"{name}: holds a negative value {low}")
    hi = cols.max(axis=1).tolist()
    sides = (("src_starts", src_rows), ("dst_starts", dst_rows))
    for i, (name, rows) in enumerate(sides):
        # starts <= rows and lengths <= rows first, so the sums below cannot overflow int64
        if hi[i] > rows or hi[2] > rows:
            raise ValueError(f"{name}: a range runs past the {rows} rows")
    ends = cols[:2] + n
    for i, ((name, rows), top) in enumerate(zip(sides, ends.max(axis=1).tolist(), strict=True)):
        if top > rows:
            j = int(np.argmax(ends[i]))
            start, end = int(cols[i, j]), int(ends[i, j])
            raise ValueError(f"{name}: range {j} [{start}, {end}) runs past the {rows} rows")
    de = ends[1]
    if lo[2] == 0:
        keep = n > 0
        s, d, n, de = s[keep], d[keep], n[keep], de[keep]
    if len(d) > 1 and not bool((de[:-1] <= d[1:]).all()):  # out of order, or overlapping
        order = np.argsort(d, kind="stable")
        ds, de = d[order], de[order]
        bad = de[:-1] > ds[1:]
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(
                f"dst_starts: destination ranges overlap: [{int(ds[i])}, {int(de[i])}) and "
                f"[{int(ds[i + 1])}, {int(de[i + 1])})"
            )
    return s, d, n


def _check_ranges_small(
    s: np.ndarray, d: np.ndarray, n: np.ndarray, src_rows: int, dst_rows: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`_check_ranges` on Python ints, for short plans (same errors): one pass
    accepts a valid plan whose destinations come in order; anything else is checked
    again step by step, which names the first fault."""
    sl, dl, nl = s.tolist(), d.tolist(), n.tolist()
    end = 0
    for a, b, k in zip(sl, dl, nl, strict=True):
        if a < 0 or b < end or k <= 0 or a + k > src_rows or b + k > dst_rows:
            break
        end = b + k
    else:
        return s, d, n
    for name, vals in (("src_starts", sl), ("dst_starts", dl), ("lengths", nl)):
        if vals and min(vals) < 0:
            raise ValueError(f"{name}: holds a negative value {min(vals)}")
    sides = (("src_starts", sl, src_rows), ("dst_starts", dl, dst_rows))
    for name, starts, rows in sides:  # both sides' bounds first, as the numpy check does
        if starts and (max(starts) > rows or max(nl) > rows):
            raise ValueError(f"{name}: a range runs past the {rows} rows")
    for name, starts, rows in sides:
        ends = [a + k for a, k in zip(starts, nl, strict=True)]
        if ends and max(ends) > rows:
            i = ends.index(max(ends))
            raise ValueError(
                f"{name}: range {i} [{starts[i]}, {ends[i]}) runs past the {rows} rows"
            )
    spans = sorted((a, a + k) for a, k in zip(dl, nl, strict=True) if k > 0)
    for (s0, e0), (s1, e1) in itertools.pairwise(spans):
        if e0 > s1:
            raise ValueError(
                f"dst_starts: destination ranges overlap: [{s0}, {e0}) and [{s1}, {e1})"
            )
    if all(k > 0 for k in nl):
        return s, d, n
    keep = n > 0
    return s[keep], d[keep], n[keep]
