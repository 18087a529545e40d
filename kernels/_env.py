"""Where a kernel can run: CUDA tensors, or CPU tensors under the Triton interpreter."""

from __future__ import annotations

import contextlib
import os

import torch


def interpreting() -> bool:
    """True when Triton kernels run in the interpreter (``TRITON_INTERPRET=1``) on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_kernel(*tensors: torch.Tensor) -> bool:
    """Run the Triton kernel (CUDA tensors, or CPU ones when interpreting), else the reference."""
    if all(t.device.type == "cuda" for t in tensors):
        return True
    return all(t.device.type == "cpu" for t in tensors) and interpreting()


def on_device(index: int) -> contextlib.AbstractContextManager[object]:
    """Make CUDA device ``index`` current for a block; no switch (and no cost) when it is
    current already, the usual case: a switch costs microseconds on every launch."""
    if torch.cuda.current_device() == index:
        return contextlib.nullcontext()
    return torch.cuda.device(index)


def on_tensor_device(t: torch.Tensor) -> contextlib.AbstractContextManager[object]:
    """:func:`on_device` for a tensor's GPU (Triton launches on the current device); nothing
    for a CPU tensor."""
    return on_device(t.get_device()) if t.is_cuda else contextlib.nullcontext()


def current_raw_stream(index: int) -> int:
    """The ``cudaStream_t`` of CUDA device ``index``'s current stream (0: the legacy default
    stream), without making a Stream object (that costs several times more host time)."""
    # torch has no public call for the raw handle; fall back to a Stream object without it.
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # noqa: SLF001
    if raw is None:
        return int(torch.cuda.current_stream(index).cuda_stream)
    return int(raw(index))


def current_stream_idle(index: int) -> bool:
    """True when CUDA device ``index``'s current stream has no work left. Asks the runtime
    directly when it can: ``torch.cuda.current_stream(index).query()`` makes a Stream object
    first, about three times the host time of the query itself on the H200 host."""
    from embcache.kernels import _cudart

    rt = _cudart.runtime()
    if rt is None:
        return bool(torch.cuda.current_stream(index).query())
    return rt.stream_idle(current_raw_stream(index))
