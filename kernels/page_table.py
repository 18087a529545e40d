"""Fused page-table updates over ``v2p`` / ``p2v`` (int64, ``-1`` = tombstone), one launch each.

Every residency change of a device pool touches both tables; one launch per batch of
changes, with no host sync, keeps that off the GPU's and the host's critical path.
``v2p[vpage]`` is the physical page bound to a virtual page and ``p2v[page]`` the reverse.
Ids in one call must be unique. On CUDA the ops never sync with the host (capturable in a CUDA
graph); ids outside a table are skipped by the kernel. On CPU tensors the Triton kernel runs
under the interpreter when ``TRITON_INTERPRET=1``, else the reference; there, ids are checked.
"""

from __future__ import annotations

import torch

from embcache.kernels._env import on_tensor_device, use_kernel

_BLOCK = 1024


def _check_table(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or t.dim() != 1:
        raise ValueError(f"{name}: must be a 1-D int64 tensor")
    if not t.is_contiguous():
        raise ValueError(f"{name}: must be contiguous")
    return t


def _check_ids(name: str, ids: object, table: torch.Tensor, table_name: str) -> torch.Tensor:
    ids = _check_table(name, ids)
    if ids.device != table.device:
        raise ValueError(f"{name}: is on {ids.device}, {table_name} on {table.device}")
    if ids.device.type == "cpu" and ids.numel():  # values are checked where it costs no sync
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= table.numel():
            raise ValueError(f"{name}: ids must lie in [0, {table.numel()}), got [{lo}, {hi}]")
        if torch.unique(ids).numel() != ids.numel():
            raise ValueError(f"{name}: ids must be unique")
    return ids


def _check_tables(v2p: object, p2v: object) -> tuple[torch.Tensor, torch.Tensor]:
    v2p = _check_table("v2p", v2p)
    p2v = _check_table("p2v", p2v)
    if v2p.device != p2v.device:
        raise ValueError(f"p2v: is on {p2v.device}, v2p on {v2p.device}")
    return v2p, p2v


def _grid(n: int) -> tuple[int]:
    return (-(-n // _BLOCK),)


def alloc_bind_inplace_reference(
    vpages: torch.Tensor, first_page: int | torch.Tensor, v2p: torch.Tensor, p2v: torch.Tensor
) -> None:
    """The spec of :func:`alloc_bind_inplace`: bind ``vpages[i]`` to page ``first_page + i``.

    Mutates ``v2p[vpages]`` and ``p2v[first_page : first_page + len(vpages)]``.
    """
    base = int(first_page)
    pages = torch.arange(base, base + vpages.numel(), dtype=torch.int64, device=vpages.device)
    v2p[vpages] = pages
    p2v[pages] = vpages


def bind_inplace_reference(
    vpages: torch.Tensor, pages: torch.Tensor, v2p: torch.Tensor, p2v: torch.Tensor
) -> None:
    """The spec of :func:`bind_inplace`: bind ``vpages[i]`` to ``pages[i]``.

    Mutates ``v2p[vpages]`` and ``p2v[pages]``.
    """
    v2p[vpages] = pages
    p2v[pages] = vpages


def free_unbind_inplace_reference(
    vpages: torch.Tensor, v2p: torch.Tensor, p2v: torch.Tensor
) -> torch.Tensor:
    """The spec of :func:`free_unbind_inplace`: tombstone both tables, return the freed pages.

    Mutates ``v2p[vpages] = -1`` and ``p2v[page] = -1`` for every bound page.

    Returns:
        ``v2p[vpages]`` as it was: the freed pages, ``-1`` where a vpage was unbound.
    """
    pages = v2p[vpages].clone()
    v2p.index_fill_(0, vpages, -1)
    p2v.index_fill_(0, pages[pages >= 0], -1)
    return pages


def alloc_bind_inplace(
    vpages: torch.Tensor, first_page: int | torch.Tensor, v2p: torch.Tensor, p2v: torch.Tensor
) -> None:
    """Bind ``vpages[i]`` to the consecutive physical page ``first_page + i``, one launch.

    The common case of a device get: its pages come from the allocator as one run.

    Args:
        vpages: 1-D int64 ids of virtual pages, unique, on the tables' device.
        first_page: an int, or a one-element int64 tensor on the tables' device (read by
            the kernel, so the host never waits for it).
        v2p, p2v: the tables, 1-D contiguous int64 on one device; mutated.

    Raises:
        ValueError: a bad table or id tensor, or pages past ``p2v`` when ``first_page`` is
            known on the host; on CPU tensors also ids out of range or repeated.
    """
    v2p, p2v = _check_tables(v2p, p2v)
    vpages = _check_ids("vpages", vpages, v2p, "v2p")
    n = vpages.numel()
    if isinstance(first_page, torch.Tensor):
        if first_page.dtype != torch.int64 or first_page.numel() != 1:
            raise ValueError("first_page: must be an int or a one-element int64 tensor")
        if first_page.device != v2p.device:
            raise ValueError(f"first_page: is on {first_page.device}, v2p on {v2p.device}")
        from_ptr = True
        first_int = 0
        if first_page.device.type == "cpu":
            first_int = int(first_page)
    elif isinstance(first_page, int) and not isinstance(first_page, bool):
        from_ptr = False
        first_int = first_page
    else:
        raise ValueError(f"first_page: must be an int or a tensor, got {type(first_page)}")
    host_known = not isinstance(first_page, torch.Tensor) or first_page.device.type == "cpu"
    if host_known and not (first_int >= 0 and first_int + n <= p2v.numel()):
        raise ValueError(
            f"first_page: pages [{first_int}, {first_int + n}) exceed the {p2v.numel()} pages"
        )
    if n == 0:
        return
    if not use_kernel(vpages, v2p, p2v):
        alloc_bind_inplace_reference(vpages, first_page, v2p, p2v)
        return
    from embcache.kernels import _triton_tables as tt

    ptr = first_page if from_ptr else v2p  # unused pointer when the int is passed
    with on_tensor_device(v2p):
        tt.alloc_bind_kernel[_grid(n)](
            vpages, ptr, first_int, v2p, p2v, n, v2p.numel(), p2v.numel(),
            FIRST_FROM_PTR=from_ptr, BLOCK=_BLOCK,
        )  # fmt: skip


def bind_inplace(
    vpages: torch.Tensor, pages: torch.Tensor, v2p: torch.Tensor, p2v: torch.Tensor
) -> None:
    """Bind ``vpages[i]`` to ``pages[i]`` in one launch.

    Args:
        vpages: 1-D int64 ids of virtual pages, unique, on the tables' device.
        pages: 1-D int64 physical page ids, unique, as many as ``vpages``.
        v2p, p2v: the tables, 1-D contiguous int64 on one device; mutated.

    Raises:
        ValueError: a bad table or id tensor, or a length mismatch; on CPU tensors also ids
            out of range or repeated.
    """
    v2p, p2v = _check_tables(v2p, p2v)
    vpages = _check_ids("vpages", vpages, v2p, "v2p")
    pages = _check_ids("pages", pages, p2v, "p2v")
    if pages.numel() != vpages.numel():
        raise ValueError(f"pages: has {pages.numel()} ids, vpages {vpages.numel()}")
    n = vpages.numel()
    if n == 0:
        return
    if not use_kernel(vpages, pages, v2p, p2v):
        bind_inplace_reference(vpages, pages, v2p, p2v)
        return
    from embcache.kernels import _triton_tables as tt

    with on_tensor_device(v2p):
        tt.bind_kernel[_grid(n)](vpages, pages, v2p, p2v, n, v2p.numel(), p2v.numel(), BLOCK=_BLOCK)


def free_unbind_inplace(
    vpages: torch.Tensor, v2p: torch.Tensor, p2v: torch.Tensor, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Tombstone ``vpages`` and their pages in both tables; return the freed page ids.

    One launch, no host sync, so an eviction can be queued behind the copies that still
    read the pages.

    Args:
        vpages: 1-D int64 ids of virtual pages, unique, on the tables' device.
        v2p, p2v: the tables, 1-D contiguous int64 on one device; mutated.
        out: optional 1-D int64 tensor, as long as ``vpages``, to receive the ids.

    Returns:
        The freed physical page of each vpage (``-1`` where it was unbound): ``out`` when
        given, else a new tensor.

    Raises:
        ValueError: a bad table, id or ``out`` tensor; on CPU tensors also ids out of range
            or repeated.
    """
    v2p, p2v = _check_tables(v2p, p2v)
    vpages = _check_ids("vpages", vpages, v2p, "v2p")
    n = vpages.numel()
    if out is None:
        out = torch.empty(n, dtype=torch.int64, device=v2p.device)
    else:
        out = _check_table("out", out)
        if out.numel() != n or out.device != v2p.device:
            raise ValueError(f"out: must hold {n} ids on {v2p.device}")
    if n == 0:
        return out
    if not use_kernel(vpages, v2p, p2v, out):
        out.copy_(free_unbind_inplace_reference(vpages, v2p, p2v))
        return out
    from embcache.kernels import _triton_tables as tt

    with on_tensor_device(v2p):
        tt.free_unbind_kernel[_grid(n)](
            vpages, v2p, p2v, out, n, v2p.numel(), p2v.numel(), BLOCK=_BLOCK
        )
    return out
