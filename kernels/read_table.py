"""``build_read_table``: per-request physical page ids for a batch of reads.

For request ``b``: ``out[b, j] = v2p[vpage_table[rows[b], j]]`` for
``j < n_b = min(ceil(lengths[b] / page_size), out.shape[1], vpage_table.shape[1])``; the rest
of ``out`` is untouched. A vpage outside ``v2p`` (e.g. ``-1``) reads as ``-1``; a row outside
``vpage_table`` or a length <= 0 writes nothing. The grid is sized from shapes only and the loop
is bounded by the device-side length, so the launch is CUDA-graph capturable and costs little
for short entries.
"""

from __future__ import annotations

import torch

from embcache.kernels._env import on_tensor_device, use_kernel

_INDEX_DTYPES = (torch.int32, torch.int64)


def build_read_table_reference(
    vpage_table: torch.Tensor,
    rows: torch.Tensor,
    lengths: torch.Tensor,
    v2p: torch.Tensor,
    out: torch.Tensor,
    page_size: int,
) -> None:
    """The spec of :func:`build_read_table` (a plain loop). Mutates ``out[b, :n_b]`` for every
    request ``b``."""
    max_cols = min(out.shape[1], vpage_table.shape[1])
    for b in range(rows.numel()):
        row, length = int(rows[b]), int(lengths[b])
        if not 0 <= row < vpage_table.shape[0] or length <= 0:
            continue
        n = min(-(-length // page_size), max_cols)
        vp = vpage_table[row, :n].to(torch.int64)
        ok = (vp >= 0) & (vp < v2p.numel())
        pages = torch.full_like(vp, -1)
        pages[ok] = v2p[vp[ok]]
        out[b, :n] = pages.to(out.dtype)


def _check(name: str, t: object, dims: int, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dim() != dims or t.dtype not in dtypes:
        names = "/".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name}: must be a {dims}-D {names} tensor")
    if t.stride(-1) != 1:
        raise ValueError(f"{name}: last dimension must be contiguous")
    return t


def build_read_table(
    vpage_table: torch.Tensor,
    rows: torch.Tensor,
    lengths: torch.Tensor,
    v2p: torch.Tensor,
    out: torch.Tensor,
    page_size: int,
    *,
    target_blocks: int = 1024,
    block_cols: int = 128,
) -> None:
    """Fill ``out`` (``[bs, max_pages]``) with the physical pages of each request, one launch.

    Grid ``(bs, min(cdiv(target_blocks, bs), cdiv(max_pages, block_cols)))``: sized from shapes
    only, so a captured graph replays for any lengths (module docstring).

    Args:
        vpage_table: ``[rows, cols]`` int32/int64 virtual pages of each entry row.
        rows: ``[bs]`` int32/int64, the row of ``vpage_table`` each request reads.
        lengths: ``[bs]`` int32/int64, each request's length in the unit of ``page_size``.
        v2p: 1-D int64 virtual-to-physical table.
        out: ``[bs, max_pages]`` int32/int64; mutated where requests have pages.
        page_size: length units per page, an int >= 1.
        target_blocks: about how many programs to launch in all.
        block_cols: page ids per program iteration, a power of two.

    Raises:
        ValueError: a bad shape, dtype, device, layout or size; on CPU tensors also rows out of
            range or negative lengths.
    """
    vpage_table = _check("vpage_table", vpage_table, 2, _INDEX_DTYPES)
    rows = _check("rows", rows, 1, _INDEX_DTYPES)
    lengths = _check("lengths", lengths, 1, _INDEX_DTYPES)
    v2p = _check("v2p", v2p, 1, (torch.int64,))
    out = _check("out", out, 2, _INDEX_DTYPES)
    bs = rows.numel()
    if lengths.numel() != bs:
        raise ValueError(f"lengths: has {lengths.numel()} entries, rows {bs}")
    if out.shape[0] != bs:
        raise ValueError(f"out: has {out.shape[0]} rows, the batch {bs}")
    for name, t in (("rows", rows), ("lengths", lengths), ("v2p", v2p), ("out", out)):
        if t.device != vpage_table.device:
            raise ValueError(f"{name}: is on {t.device}, vpage_table on {vpage_table.device}")
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size: must be an int >= 1, got {page_size!r}")
    if target_blocks < 1 or block_cols < 1 or block_cols & (block_cols - 1):
        raise ValueError("block_cols: must be a power of two and target_blocks >= 1")
    if vpage_table.device.type == "cpu" and bs:  # values are checked where it costs no sync
        if int(rows.min()) < 0 or int(rows.max()) >= vpage_table.shape[0]:
            raise ValueError(f"rows: must lie in [0, {vpage_table.shape[0]})")
        if int(lengths.min()) < 0:
            raise ValueError("lengths: must be >= 0")
    max_cols = min(out.shape[1], vpage_table.shape[1])
    if bs == 0 or max_cols == 0:
        return
    if not use_kernel(vpage_table, rows, lengths, v2p, out):
        build_read_table_reference(vpage_table, rows, lengths, v2p, out, page_size)
        return
    from embcache.kernels import _triton_tables as tt

    col_blocks = min(-(-target_blocks // bs), -(-max_cols // block_cols))
    with on_tensor_device(out):
        tt.read_table_kernel[(bs, col_blocks)](
            vpage_table, vpage_table.stride(0), vpage_table.shape[0], rows, lengths,
            v2p, v2p.numel(), out, out.stride(0), max_cols, page_size, BLOCK_COLS=block_cols,
        )  # fmt: skip
