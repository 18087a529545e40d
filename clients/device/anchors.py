"""Views of memory the client did not allocate, with a lifetime it can watch.

A tensor sliced from a long-lived base (a device pool mapped once per process) shares the
base's storage, so nothing tells when the last view of one entry is gone. A view made here
has a storage of its own over the same bytes, whose owner is a small :class:`Anchor`: every
tensor derived from the view keeps it alive, and ``weakref.finalize`` on it fires when the
last one is freed (``core/views.py`` then ends the lease), as PyTorch's CUDA IPC reference
counts work. The anchor also keeps the base alive. CUDA memory goes through
``__cuda_array_interface__`` (version 2: no stream to synchronize with), host memory through
numpy's ``__array_interface__``; neither copies.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


class Anchor:
    """Owns no memory: it marks, by its lifetime, when the last tensor over a span is gone."""

    def __init__(self, base: torch.Tensor, interface: dict[str, Any]) -> None:
        self.base = base  # the memory's owner stays alive as long as any view does
        if base.is_cuda:
            self.__cuda_array_interface__ = interface
        else:
            self.__array_interface__ = interface


def anchored_view(base: torch.Tensor, offset: int, nbytes: int) -> tuple[torch.Tensor, Anchor]:
    """Bytes ``[offset, offset + nbytes)`` of the contiguous uint8 tensor ``base``, as a
    uint8 tensor with a storage of its own whose owner is the returned anchor."""
    if base.dtype != torch.uint8 or not base.is_contiguous() or base.dim() != 1:
        raise ValueError("base: a contiguous 1-D uint8 tensor")
    if nbytes <= 0 or offset < 0 or offset + nbytes > base.numel():
        raise ValueError(f"span [{offset}, {offset + nbytes}) outside the base")
    interface = {
        "shape": (nbytes,),
        "typestr": "|u1",
        "data": (base.data_ptr() + offset, False),
        "version": 2,
        "strides": None,
    }
    anchor = Anchor(base, interface)
    if base.is_cuda:
        flat = torch.as_tensor(anchor, device=base.device)
    else:
        flat = torch.from_numpy(np.asarray(anchor))
    return flat, anchor
