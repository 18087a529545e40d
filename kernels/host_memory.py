"""Page-locking host memory that torch did not allocate (e.g. a POSIX shared-memory pool).

``torch.Tensor.is_pinned()`` is False for memory registered with ``cudaHostRegister``, so the
owner keeps the :class:`HostRegistration` and tells :func:`transfer_ranges` about it with
``host_registered=True``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from embcache.kernels import _cudart


@dataclass(slots=True)
class HostRegistration:
    """A host address range registered (Portable | Mapped) with the CUDA driver."""

    ptr: int
    nbytes: int
    _registered: bool = field(default=True, repr=False)

    @property
    def registered(self) -> bool:
        return self._registered

    def contains(self, tensor: torch.Tensor) -> bool:
        """True when all bytes of ``tensor`` lie inside this range."""
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        return self._registered and self.ptr <= start and end <= self.ptr + self.nbytes

    def unregister(self) -> None:
        """Unregister the range (idempotent). Copies that use it must have finished."""
        if self._registered:
            rt = _cudart.runtime()
            assert rt is not None, "CUDA runtime vanished while memory was registered"
            rt.host_unregister(self.ptr)
            self._registered = False

    def __enter__(self) -> HostRegistration:
        return self

    def __exit__(self, *exc: object) -> None:
        self.unregister()


def register_host_memory(tensor: torch.Tensor) -> HostRegistration:
    """Page-lock and map the bytes of a contiguous CPU tensor for every device.

    Costs about 0.75 s per GiB (FACTS.md): register large pools at start-up, maybe in slices.
    """
    if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
        raise ValueError("tensor: must be a CPU tensor")
    if not tensor.is_contiguous():
        raise ValueError("tensor: must be contiguous")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        raise ValueError("tensor: is empty")
    rt = _cudart.runtime()
    if rt is None:
        raise RuntimeError("cudaHostRegister needs a CUDA device")
    ptr = tensor.data_ptr()
    rt.host_register(ptr, nbytes, _cudart.HOST_REGISTER_PORTABLE | _cudart.HOST_REGISTER_MAPPED)
    return HostRegistration(ptr, nbytes)
