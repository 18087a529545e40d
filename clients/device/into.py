"""``get_into``: entries copied into the caller's memory, and what each copy reports.

With one buffer the entries go to byte offsets in it (given, or packed back to back at
aligned offsets); with a list of tensors, one entry into each. On a CUDA buffer the daemon
copies (``GetInto``); otherwise, or where it cannot, the tensors of a host ``get`` are copied
here.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from embcache.proto.constants import SLOT_ALIGN
from embcache.proto.dtypes import torch_dtype
from embcache.proto.embcache.v1 import embcache_pb2 as pb


@dataclass(frozen=True, slots=True)
class IntoResult:
    """One key of ``get_into(keys, buffer)``: found, metadata and the byte offset it was
    copied to. Truthy when found."""

    key: str
    found: bool
    dtype: str = ""
    shape: tuple[int, ...] = ()
    nbytes: int = 0
    offset: int = 0

    def __bool__(self) -> bool:
        return self.found

    def view(self, buffer: torch.Tensor) -> torch.Tensor:
        """The entry as a tensor over the buffer's bytes (no copy)."""
        if not self.found:
            raise ValueError(f"{self.key!r} was not found")
        flat = buffer.reshape(-1).view(torch.uint8)[self.offset : self.offset + self.nbytes]
        return flat.view(torch_dtype(self.dtype)).view(self.shape)


def into_results(reply: pb.GetIntoResponse) -> list[IntoResult]:
    return [
        IntoResult(r.key, True, r.meta.dtype, tuple(r.meta.shape), r.meta.nbytes, r.offset)
        if r.found
        else IntoResult(r.key, False)
        for r in reply.results
    ]


def pack_offsets(sizes: Sequence[int | None]) -> list[int]:
    """Back-to-back offsets aligned to 16 bytes (None, a miss, takes no room)."""
    out, pos = [], 0
    for n in sizes:
        if n is None:
            out.append(0)
            continue
        pos = -(-pos // SLOT_ALIGN) * SLOT_ALIGN
        out.append(pos)
        pos += n
    return out


def check_buffer(out: torch.Tensor, keys: Sequence[str], offsets: Sequence[int] | None) -> None:
    if not isinstance(out, torch.Tensor) or not out.is_contiguous():
        raise ValueError("out: must be a contiguous tensor")
    if offsets is not None:
        if len(offsets) != len(keys):
            raise ValueError(f"offsets: one per key ({len(keys)}), got {len(offsets)}")
        if any(not isinstance(o, int) or o < 0 for o in offsets):
            raise ValueError("offsets: must be non-negative integers")


def copy_into_buffer(
    keys: Sequence[str],
    tensors: Sequence[torch.Tensor | None],
    out: torch.Tensor,
    offsets: Sequence[int] | None,
) -> list[IntoResult]:
    """get_into without IPC: copy host tensors into ``out``'s bytes (the fallback)."""
    sizes = [None if t is None else t.numel() * t.element_size() for t in tensors]
    slots = list(offsets) if offsets is not None else pack_offsets(sizes)
    flat = out.reshape(-1).view(torch.uint8)
    spans = sorted((o, o + n) for o, n in zip(slots, sizes, strict=True) if n)
    if any(b[0] < a[1] for a, b in itertools.pairwise(spans)):
        raise ValueError("offsets: destination slots overlap")
    results = []
    for key, t, n, off in zip(keys, tensors, sizes, slots, strict=True):
        if t is None or n is None:
            results.append(IntoResult(key, False))
            continue
        if off + n > flat.numel():
            raise ValueError(f"{key!r} ({n} bytes) does not fit out at offset {off}")
        flat[off : off + n].copy_(t.reshape(-1).view(torch.uint8))
        dtype = str(t.dtype).removeprefix("torch.")
        results.append(IntoResult(key, True, dtype, tuple(t.shape), n, off))
    return results


def copy_into(tensors: Sequence[torch.Tensor | None], out: Sequence[torch.Tensor]) -> list[bool]:
    """``get_into`` on the host: copy each hit into its destination (same dtype and size)."""
    if len(out) != len(tensors):
        raise ValueError(f"get_into needs one destination per key ({len(tensors)}), got {len(out)}")
    found = []
    for i, (src, dst) in enumerate(zip(tensors, out, strict=True)):
        if src is None:
            found.append(False)
            continue
        if dst.dtype != src.dtype or dst.numel() != src.numel():
            raise ValueError(
                f"out[{i}] is {dst.dtype} x {dst.numel()}, the entry is {src.dtype} x {src.numel()}"
            )
        dst.copy_(src.view(dst.shape))
        found.append(True)
    return found
