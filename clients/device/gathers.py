"""Entries spread over device pages, gathered into one tensor the caller owns.

A fragmented entry's pages are copied whole, in order, by one ``index_select`` over the pool
seen as rows of pages; the fragmented entries of a reply go together, in one launch. A
contiguous entry needs no gather: it is a view of the pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


def materialize(
    pool_bytes: torch.Tensor,
    *,
    page_bytes: int,
    page_ids: list[int] | tuple[int, ...],
    offset: int | None,
    nbytes: int,
    dtype: torch.dtype,
    shape: tuple[int, ...],
) -> torch.Tensor:
    """The entry as a tensor: a view of the pool when contiguous, else a gathered copy.

    A view is valid only while the lease lives; a gathered copy belongs to the caller.
    """
    if offset is not None:
        flat = pool_bytes[offset : offset + nbytes]
    else:
        flat = gather_pages(pool_bytes, page_bytes, [(page_ids, nbytes)])[0]
    return flat.view(dtype).view(shape)


def gather_pages(
    pool_bytes: torch.Tensor,
    page_bytes: int,
    entries: list[tuple[list[int] | tuple[int, ...], int]],
) -> list[torch.Tensor]:
    """Copies of several fragmented entries (page ids, nbytes) in one gather: one upload of
    the page ids and one ``index_select`` launch for the whole batch. Each entry's region
    starts on a page boundary of the shared buffer (so any dtype can view it)."""
    pages = [p for page_ids, _ in entries for p in page_ids]
    counts = [len(page_ids) for page_ids, _ in entries]
    gather = plan_gather(pool_bytes, page_bytes, pages, counts, [n for _, n in entries])
    flat = gather.run()
    return [flat[at : at + n] for at, (_, n) in zip(gather.offsets, entries, strict=True)]


@dataclass(frozen=True, slots=True)
class PageGather:
    """A planned gather of whole pages (:func:`plan_gather`): :meth:`run` launches it, or
    :meth:`abandon` drops it."""

    rows: torch.Tensor  # the pool as rows of pages (8-byte words when aligned)
    index: torch.Tensor | None  # page ids in gather order, on the pool's device; None: none
    offsets: list[int]  # each entry's byte offset in the result
    ring: Any = None  # uva_ids.UvaIds whose slot ``slot`` holds the index, if any
    slot: int = -1

    def run(self) -> torch.Tensor:
        """The gathered bytes (one flat uint8 tensor the caller owns), queued on the current
        stream."""
        if self.index is None:
            return self.rows.new_empty(0, dtype=torch.uint8)
        out = self.rows.index_select(0, self.index)
        if self.ring is not None:
            self.ring.launched(self.slot, torch.cuda.current_stream(self.rows.device))
        return out.view(torch.uint8).view(-1)

    def abandon(self) -> None:
        if self.ring is not None:
            self.ring.abandon(self.slot)


def plan_gather(
    pool_bytes: torch.Tensor,
    page_bytes: int,
    pages: list[int] | np.ndarray,
    counts: list[int],
    nbytes: list[int],
) -> PageGather:
    """Check a gather of the entries' pages, concatenated (``counts[i]`` ids for entry i,
    holding its ``nbytes[i]``), and put the ids where the GPU reads them. The pages are
    copied whole, in order, by one ``index_select`` over the pool seen as rows of pages.
    On a GPU the ids go to a pinned slot the kernel reads directly (``uva_ids.py``: no copy
    call, whose host time grows while the daemon's copy runs), else they are uploaded. The
    gather is faster than a ``torch.cat`` of the page runs, on the GPU and in host time
    (docs/device.md)."""
    if page_bytes <= 0:
        raise ValueError(f"page_bytes: must be positive, got {page_bytes}")
    offsets, at = [], 0
    for count, n in zip(counts, nbytes, strict=True):
        if count * page_bytes < n:
            raise ValueError("pages: each entry needs pages that hold its bytes")
        offsets.append(at)
        at += count * page_bytes
    ids = np.asarray(pages, dtype=np.int64)
    if sum(counts) != ids.size:
        raise ValueError(f"counts: sum to {sum(counts)}, but there are {ids.size} page ids")
    num_pages = pool_bytes.numel() // page_bytes
    rows = pool_bytes[: num_pages * page_bytes].view(num_pages, page_bytes)
    if page_bytes % 8 == 0 and rows.storage_offset() % 8 == 0:
        rows = rows.view(torch.int64)  # fewer, wider elements: a faster gather
    if ids.size == 0:
        return PageGather(rows, None, offsets)
    if ids.min() < 0 or ids.max() >= num_pages:
        raise ValueError(f"pages: ids must lie in [0, {num_pages})")
    if not rows.is_cuda:
        return PageGather(rows, torch.from_numpy(ids), offsets)
    from embcache.clients.device.uva_ids import ring_for

    ring = ring_for(rows.device)
    got = ring.put(ids) if ring is not None else None
    if got is not None:
        return PageGather(rows, got[0], offsets, ring, got[1])
    # pinned: a copy from pageable memory would wait for the stream's work
    index = torch.from_numpy(ids).pin_memory().to(rows.device, non_blocking=True)
    return PageGather(rows, index, offsets)
