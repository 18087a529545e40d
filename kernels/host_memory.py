"""Page-locking host memory that torch did not allocate (e.g. a POSIX shared-memory pool).

The daemon's host pool is shared memory that CPU clients map, and GPUs must copy from it at
link speed, which needs page-locked memory: registering the segment gives both.
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
    """A host address range registered (Portable | Mapped) with the CUDA driver.

    Portable: every device may copy from it; Mapped: kernels may read and write it through
    UVA. Use it as a context manager, or call :meth:`unregister`, once copies are done.
    """

    ptr: int
    nbytes: int
    _registered: bool = field(default=True, repr=False)

    @property
    def registered(self) -> bool:
        """True until :meth:`unregister` ran."""
        return self._registered

    def contains(self, tensor: torch.Tensor) -> bool:
        """True when all bytes of ``tensor`` lie inside this (still registered) range."""
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        return self._registered and self.ptr <= start and end <= self.ptr + self.nbytes

    def unregister(self) -> None:
        """Unregister the range (idempotent). Copies that use it must have finished.

        Raises:
            CudaRuntimeError: ``cudaHostUnregister`` failed.
        """
        if self._registered:
            rt = _cudart.runtime()
            assert rt is not None, "CUDA runtime vanished while memory was registered"
            rt.host_unregister(self.ptr)
            self._registered = False

    def __enter__(self) -> HostRegistration:
        return self

    def __exit__(self, *exc: object) -> None:
        self.unregister()


def register_host_memory(tensor: torch.Tensor, *, read_only: bool = False) -> HostRegistration:
    """Page-lock and map the bytes of a contiguous CPU tensor for every device.

    Registering is slow, in proportion to the size (docs/facts.md, "One shared-memory segment
    as the pinned host pool"): register large pools once, at start-up.

    Args:
        tensor: a contiguous, non-empty CPU tensor; its memory must outlive the registration.
        read_only: register for device reads only (``cudaHostRegisterReadOnly``), as memory
            mapped without write access (``PROT_READ``) must be; see :func:`register_host_range`.

    Returns:
        The registration; keep it, and unregister it before the memory goes.

    Raises:
        ValueError: ``tensor`` is not a contiguous, non-empty CPU tensor.
        RuntimeError: there is no CUDA device.
        CudaRuntimeError: ``cudaHostRegister`` failed.
    """
    if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
        raise ValueError("tensor: must be a CPU tensor")
    if not tensor.is_contiguous():
        raise ValueError("tensor: must be contiguous")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        raise ValueError("tensor: is empty")
    return register_host_range(tensor.data_ptr(), nbytes, read_only=read_only)


def register_host_range(ptr: int, nbytes: int, *, read_only: bool = False) -> HostRegistration:
    """Page-lock and map ``nbytes`` of host memory at ``ptr`` (Portable | Mapped) for every
    device: a slice of a larger mapping, for callers that register it piece by piece.

    Pieces registered separately are separate registrations: a copy-engine copy must not span
    two of them (one ``cudaMemcpyAsync`` resolves its source against one registration).

    Args:
        ptr, nbytes: the range, inside memory that outlives the registration; not overlapping
            a range registered before (CUDA refuses that with error 712).
        read_only: add ``cudaHostRegisterReadOnly`` (devices only read the range). Memory
            mapped ``PROT_READ`` can only be registered so: without the flag the driver pins
            the pages for writing, which such a mapping refuses.

    Raises:
        ValueError: ``ptr`` or ``nbytes`` is not positive.
        RuntimeError: there is no CUDA device.
        CudaRuntimeError: ``cudaHostRegister`` failed (e.g. read-only registration is not
            supported by the device or driver: ``DEV_ATTR_HOST_REGISTER_READ_ONLY_SUPPORTED``).
    """
    if ptr <= 0:
        raise ValueError(f"ptr: must be a host address, got {ptr}")
    if nbytes <= 0:
        raise ValueError(f"nbytes: must be positive, got {nbytes}")
    rt = _cudart.runtime()
    if rt is None:
        raise RuntimeError("cudaHostRegister needs a CUDA device")
    flags = _cudart.HOST_REGISTER_PORTABLE | _cudart.HOST_REGISTER_MAPPED
    if read_only:
        flags |= _cudart.HOST_REGISTER_READ_ONLY
    rt.host_register(ptr, nbytes, flags)
    return HostRegistration(ptr, nbytes)
