"""The importing side of CUDA IPC: opening device memory another process exported.

Clients open the daemon's device pools (``open_legacy``, ``import_fd``), and the daemon
opens clients' tensors for puts from a device and gets into a client's buffer; a client
exports its tensor's allocation with ``export_tensor``. The daemon's own exported memory is
:class:`~embcache.kernels.cuda_mem.DeviceSlab`. ctypes over the runtime torch loaded and the
driver, every return code checked; CUDA machines only.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import torch

from embcache.kernels.cuda_mem import (
    CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
    CU_MEM_HANDLE_TYPE_POSIX_FD,
    IPC_HANDLE_BYTES,
    IPC_LAZY_ENABLE_PEER_ACCESS,
    CudaMemError,
    DeviceSlab,
    IpcMemHandle,
    drv_check,
    libs,
    map_vmm,
    rt_check,
    unmap_vmm,
    with_primary_context,
    wrap_device_bytes,
)


@dataclass(eq=False)
class ImportedMemory:
    """Another process's device allocation mapped into this one. ``close()`` unmaps it.

    Opening costs far more than using, so callers keep one per allocation and cache it.
    """

    device: int
    ptr: int
    nbytes: int
    kind: str  # "legacy" | "fd"
    _handle: int = 0
    _closed: bool = False
    _whole: torch.Tensor | None = None  # made once: wrapping costs far more than a slice

    def tensor(self, offset: int = 0, nbytes: int | None = None) -> torch.Tensor:
        """A uint8 view of part of the mapping, valid while it stays open.

        Args:
            offset: the first byte, from the start of the allocation.
            nbytes: how many bytes (default: to the end).

        Returns:
            A 1-D uint8 CUDA tensor over those bytes; no copy.

        Raises:
            ValueError: the range lies outside the allocation, or the mapping is closed.
        """
        n = self.nbytes - offset if nbytes is None else nbytes
        if offset < 0 or n < 0 or offset + n > self.nbytes:
            raise ValueError(f"offset/nbytes: [{offset}, {offset + n}) outside {self.nbytes}")
        if self._closed:
            raise ValueError("the mapping is closed")
        if self._whole is None or self._whole.numel() != self.nbytes:
            self._whole = wrap_device_bytes(self.ptr, self.nbytes, self.device, self)
        return self._whole[offset : offset + n]

    def close(self) -> None:
        """Unmap the allocation (idempotent); its tensors must no longer be used."""
        if self._closed:
            return
        self._closed = True
        self._whole = None
        rt, drv = libs()
        if self.kind == "legacy":
            rt_check("cudaIpcCloseMemHandle", rt.cudaIpcCloseMemHandle(ctypes.c_void_p(self.ptr)))
        else:
            unmap_vmm(self.ptr, self.nbytes)
            drv_check("cuMemRelease", drv.cuMemRelease(ctypes.c_ulonglong(self._handle)))


def open_legacy(handle: bytes, device: int, nbytes: int) -> ImportedMemory:
    """Open a ``cudaIpcMemHandle_t`` exported by another process (not by this one).

    CUDA maps a handle at most once per process, which is another reason to cache the
    result.

    Args:
        handle: the 64 handle bytes.
        device: the local CUDA device index the memory is on.
        nbytes: the size of the exported allocation.

    Returns:
        The mapping.

    Raises:
        ValueError: ``handle`` is not 64 bytes.
        CudaMemError: the open failed (another IPC namespace, a stale handle, ...).
    """
    if len(handle) != IPC_HANDLE_BYTES:
        raise ValueError(f"handle: must be {IPC_HANDLE_BYTES} bytes, got {len(handle)}")
    with with_primary_context(device):
        rt, _ = libs()
        h = IpcMemHandle.from_buffer_copy(handle)
        ptr = ctypes.c_void_p(0)
        rt.cudaIpcOpenMemHandle.argtypes = (
            ctypes.POINTER(ctypes.c_void_p),
            IpcMemHandle,
            ctypes.c_uint,
        )
        rt_check(
            "cudaIpcOpenMemHandle",
            rt.cudaIpcOpenMemHandle(ctypes.byref(ptr), h, IPC_LAZY_ENABLE_PEER_ACCESS),
        )
        return ImportedMemory(device, int(ptr.value or 0), nbytes, "legacy")


def import_fd(fd: int, device: int, nbytes: int) -> ImportedMemory:
    """Map a VMM allocation received as a POSIX fd.

    Args:
        fd: the file descriptor, received over a Unix socket; closed here once the import
            was tried.
        device: the local CUDA device index to map it for.
        nbytes: the allocation's size (a multiple of its granularity).

    Returns:
        The mapping.

    Raises:
        CudaMemError: importing or mapping failed.
    """
    with with_primary_context(device):
        _, drv = libs()
        handle = ctypes.c_ulonglong(0)
        try:
            drv_check(
                "cuMemImportFromShareableHandle",
                drv.cuMemImportFromShareableHandle(
                    ctypes.byref(handle), ctypes.c_void_p(fd), CU_MEM_HANDLE_TYPE_POSIX_FD
                ),
            )
        finally:
            os.close(fd)
        prop = DeviceSlab.allocation_prop(device)
        gran = ctypes.c_size_t(0)
        drv_check(
            "cuMemGetAllocationGranularity",
            drv.cuMemGetAllocationGranularity(
                ctypes.byref(gran), ctypes.byref(prop), CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
            ),
        )
        try:
            ptr = map_vmm(handle, nbytes, device, gran.value)
        except CudaMemError:
            drv.cuMemRelease(handle)
            raise
        return ImportedMemory(device, ptr, nbytes, "fd", handle.value)


def allocation_range(ptr: int) -> tuple[int, int]:
    """The device allocation that contains ``ptr``.

    Args:
        ptr: a device address.

    Returns:
        ``(base, size)`` of that allocation.

    Raises:
        CudaMemError: ``ptr`` is not in a device allocation.
    """
    _, drv = libs()
    base = ctypes.c_ulonglong(0)
    size = ctypes.c_size_t(0)
    drv_check(
        "cuMemGetAddressRange",
        drv.cuMemGetAddressRange_v2(
            ctypes.byref(base), ctypes.byref(size), ctypes.c_ulonglong(ptr)
        ),
    )
    return int(base.value), int(size.value)


def allocation_bytes(ptr: int) -> int:
    """Bytes from ``ptr`` to the end of its allocation.

    Raises:
        CudaMemError: ``ptr`` is not in a device allocation.
    """
    base, size = allocation_range(ptr)
    return base + size - ptr


def export_tensor(t: torch.Tensor) -> tuple[bytes, int, int]:
    """Export the allocation holding ``t`` so that another process can open it.

    Works for torch caching-allocator tensors (each cudaMalloc block is its own allocation);
    fails cleanly for expandable segments, whose memory cannot take legacy handles.

    Args:
        t: a CUDA tensor.

    Returns:
        ``(legacy IPC handle, byte offset of t in the allocation, allocation size)``.

    Raises:
        ValueError: ``t`` is not a CUDA tensor.
        CudaMemError: the export failed (e.g. expandable segments).
    """
    if t.device.type != "cuda":
        raise ValueError("t: must be a CUDA tensor")
    with with_primary_context(t.device.index):
        rt, _ = libs()
        base, size = allocation_range(t.data_ptr())
        handle = IpcMemHandle()
        rt_check(
            "cudaIpcGetMemHandle",
            rt.cudaIpcGetMemHandle(ctypes.byref(handle), ctypes.c_void_p(base)),
        )
        return bytes(handle.reserved), t.data_ptr() - base, size
