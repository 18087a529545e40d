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
    """Make CUDA device ``index`` current for a block.

    Nothing is switched when it is current already, the usual case: a switch costs host time
    on every launch, and the copy paths launch on every get.
    """
    if torch.cuda.current_device() == index:
        return contextlib.nullcontext()
    return torch.cuda.device(index)


def on_tensor_device(t: torch.Tensor) -> contextlib.AbstractContextManager[object]:
    """:func:`on_device` for a tensor's GPU (Triton launches on the current device); nothing
    for a CPU tensor."""
    return on_device(t.get_device()) if t.is_cuda else contextlib.nullcontext()


def current_raw_stream(index: int) -> int:
    """The raw ``cudaStream_t`` of CUDA device ``index``'s current stream.

    Read without making a Stream object, which costs several times more host time: callers
    on the put path ask for it on every call.

    Args:
        index: the CUDA device.

    Returns:
        The stream handle as an int (0: the legacy default stream).
    """
    # torch has no public call for the raw handle; fall back to a Stream object without it.
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # noqa: SLF001
    if raw is None:
        return int(torch.cuda.current_stream(index).cuda_stream)
    return int(raw(index))


def current_stream_idle(index: int) -> bool:
    """True when CUDA device ``index``'s current stream has no work left.

    Asks the runtime directly when it can: ``torch.cuda.current_stream(index).query()`` makes
    a Stream object first, which costs more host time than the query itself
    (docs/kernels.md, "Host time").

    Args:
        index: the CUDA device whose current stream is asked about.

    Returns:
        Whether every piece of work queued on that stream so far has run.
    """
    from embcache.kernels import _cudart

    rt = _cudart.runtime()
    if rt is None:
        return bool(torch.cuda.current_stream(index).query())
    return rt.stream_idle(current_raw_stream(index))
