"""Triton kernels for the page tables and the read table. Imported on first use only.

Every id is bounds-masked in the kernel, so a bad id can never write outside a table (on the
GPU the launchers cannot check values without a host sync).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["first_page"])
def alloc_bind_kernel(
    vpages,
    first_page_ptr,
    first_page,
    v2p,
    p2v,
    n,
    num_vpages,
    num_pages,
    FIRST_FROM_PTR: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    vp = tl.load(vpages + offs, mask=mask, other=-1)
    base = tl.load(first_page_ptr) if FIRST_FROM_PTR else first_page.to(tl.int64)
    page = base + offs.to(tl.int64)
    ok = mask & (vp >= 0) & (vp < num_vpages) & (page >= 0) & (page < num_pages)
    tl.store(v2p + vp, page, mask=ok)
    tl.store(p2v + page, vp, mask=ok)


@triton.jit
def bind_kernel(vpages, pages, v2p, p2v, n, num_vpages, num_pages, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    vp = tl.load(vpages + offs, mask=mask, other=-1)
    page = tl.load(pages + offs, mask=mask, other=-1)
    ok = mask & (vp >= 0) & (vp < num_vpages) & (page >= 0) & (page < num_pages)
    tl.store(v2p + vp, page, mask=ok)
    tl.store(p2v + page, vp, mask=ok)


@triton.jit
def free_unbind_kernel(vpages, v2p, p2v, out, n, num_vpages, num_pages, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    vp = tl.load(vpages + offs, mask=mask, other=-1)
    okv = mask & (vp >= 0) & (vp < num_vpages)
    page = tl.load(v2p + vp, mask=okv, other=-1)
    tl.store(v2p + vp, tl.full(vp.shape, -1, tl.int64), mask=okv)
    okp = okv & (page >= 0) & (page < num_pages)
    tl.store(p2v + page, tl.full(page.shape, -1, tl.int64), mask=okp)
    tl.store(out + offs, page, mask=mask)


@triton.jit(do_not_specialize=["page_size"])
def read_table_kernel(
    vpage_table,
    stride_vt,
    num_rows,
    rows,
    lengths,
    v2p,
    num_vpages,
    out,
    stride_out,
    max_cols,
    page_size,
    BLOCK_COLS: tl.constexpr,
):
    b = tl.program_id(0)
    col_block = tl.program_id(1)
    num_col_blocks = tl.num_programs(1)
    row = tl.load(rows + b).to(tl.int64)
    length = tl.load(lengths + b).to(tl.int64)
    n_pages = tl.minimum((length + page_size - 1) // page_size, max_cols)
    n_pages = tl.where((row >= 0) & (row < num_rows) & (length > 0), n_pages, 0).to(tl.int32)
    cols = tl.arange(0, BLOCK_COLS)
    # The bound is device-side, so one graph replays for any lengths; short entries exit early.
    for j0 in range(col_block * BLOCK_COLS, n_pages, num_col_blocks * BLOCK_COLS):
        j = j0 + cols
        m = j < n_pages
        vp = tl.load(vpage_table + row * stride_vt + j, mask=m, other=-1).to(tl.int64)
        ok = m & (vp >= 0) & (vp < num_vpages)
        page = tl.load(v2p + vp, mask=ok, other=-1)
        tl.store(out + b.to(tl.int64) * stride_out + j, page.to(out.dtype.element_ty), mask=m)
