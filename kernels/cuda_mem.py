"""Device memory the daemon owns, and CUDA IPC between processes on one node.

Decoders read the daemon's device pool in place, so the pool must be shareable with other
processes. Two ways to share a device allocation (docs/facts.md, "CUDA IPC between processes
on one node", has their costs):

- ``legacy``: a plain ``cudaMalloc`` slab exported with ``cudaIpcGetMemHandle`` (64 bytes) and
  opened with ``cudaIpcOpenMemHandle``. Containers must share IPC and PID namespaces.
- ``fd``: a VMM allocation (``cuMemCreate`` with POSIX-fd handles) whose file descriptor travels
  over a Unix socket with ``SCM_RIGHTS``; the importer maps it into its own address space.
  Containers only need to share the socket's directory.

Never export torch caching-allocator memory as a pool: the daemon allocates its slab itself.
The importing side (opening another process's memory, exporting a tensor) is ``cuda_ipc.py``.
Everything here is ctypes over the runtime torch loaded and the driver (``libcuda.so.1``), with
every return code checked. Nothing here runs on a machine without CUDA.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from collections.abc import Iterator, Sequence

import torch

from embcache.kernels import _cudart

IPC_HANDLE_BYTES = 64
IPC_LAZY_ENABLE_PEER_ACCESS = 1
_CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_HANDLE_TYPE_POSIX_FD = 1
_CU_MEM_LOCATION_TYPE_DEVICE = 1
_CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1


class CudaMemError(RuntimeError):
    """A CUDA runtime or driver call failed."""


class IpcMemHandle(ctypes.Structure):
    # c_ubyte, not c_char: a c_char array reads back cut at its first NUL byte.
    _fields_ = (("reserved", ctypes.c_ubyte * IPC_HANDLE_BYTES),)


class _MemLocation(ctypes.Structure):
    _fields_ = (("type", ctypes.c_int), ("id", ctypes.c_int))


class _AllocFlags(ctypes.Structure):
    _fields_ = (
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    )


class _AllocationProp(ctypes.Structure):
    _fields_ = (
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _MemLocation),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _AllocFlags),
    )


class _AccessDesc(ctypes.Structure):
    _fields_ = (("location", _MemLocation), ("flags", ctypes.c_int))


@functools.cache
def libs() -> tuple[ctypes.CDLL, ctypes.CDLL]:
    if not torch.cuda.is_available():
        raise CudaMemError("CUDA is not available")
    torch.cuda.init()
    path = _cudart.find_libcudart_path()
    names = [p for p in (path, "libcudart.so.13", "libcudart.so.12", "libcudart.so") if p]
    for name in names:
        try:
            rt = ctypes.CDLL(name)
            break
        except OSError:
            continue
    else:
        raise CudaMemError("libcudart not found")
    rt.cudaGetErrorString.restype = ctypes.c_char_p
    drv = ctypes.CDLL("libcuda.so.1")
    drv.cuGetErrorString.argtypes = (ctypes.c_int, ctypes.POINTER(ctypes.c_char_p))
    return rt, drv


def rt_check(call: str, code: int) -> None:
    if code != 0:
        rt, _ = libs()
        rt.cudaGetLastError()
        raise CudaMemError(f"{call} failed: error {code} ({rt.cudaGetErrorString(code).decode()})")


def drv_check(call: str, code: int) -> None:
    if code != 0:
        _, drv = libs()
        msg = ctypes.c_char_p()
        drv.cuGetErrorString(code, ctypes.byref(msg))
        raise CudaMemError(f"{call} failed: error {code} ({(msg.value or b'?').decode()})")


@contextlib.contextmanager
def with_primary_context(device: int) -> Iterator[None]:
    """Bind the device's primary context to this thread (driver calls need one), and give
    the thread its previous current device back afterwards: a multi-GPU caller's current
    device is not ours to change."""
    rt, _ = libs()
    prev = ctypes.c_int(-1)
    rt_check("cudaGetDevice", rt.cudaGetDevice(ctypes.byref(prev)))
    rt_check("cudaSetDevice", rt.cudaSetDevice(ctypes.c_int(device)))
    try:
        rt_check("cudaFree(0)", rt.cudaFree(ctypes.c_void_p(0)))
        yield
    finally:
        if prev.value != device:
            rt.cudaSetDevice(prev)


@functools.cache
def gpu_uuid(device: int) -> str:
    """The uuid nvidia-smi prints for a device, ``GPU-xxxxxxxx-...``.

    Asked on every device get and put, and a process's GPUs never change: computed once per
    device.

    Args:
        device: a visible CUDA device index.

    Returns:
        The uuid string, the name clients and the daemon use for a GPU on the wire.
    """
    return "GPU-" + str(torch.cuda.get_device_properties(device).uuid)


@functools.cache
def _indexes() -> dict[str, int]:
    return {gpu_uuid(i): i for i in range(torch.cuda.device_count())}


def device_by_uuid(uuid: str) -> int | None:
    """The index of the visible GPU named ``uuid``.

    Args:
        uuid: a name as :func:`gpu_uuid` makes it.

    Returns:
        The device index, or None when no visible GPU has that uuid.
    """
    return _indexes().get(uuid)


class _CudaArray:
    """Exposes raw device bytes through ``__cuda_array_interface__`` so torch can wrap them."""

    def __init__(self, ptr: int, nbytes: int, owner: object) -> None:
        self._owner = owner  # kept alive as long as any tensor over these bytes
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
        }


def wrap_device_bytes(ptr: int, nbytes: int, device: int, owner: object) -> torch.Tensor:
    """A uint8 tensor over raw device memory, without a copy.

    Args:
        ptr: the device address of the first byte.
        nbytes: how many bytes the tensor covers.
        device: the CUDA device index the memory is on.
        owner: kept alive as long as the tensor (or any view of it) lives: the object that
            frees the memory.

    Returns:
        A 1-D uint8 CUDA tensor over exactly those bytes.
    """
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8, device=f"cuda:{device}")
    with torch.cuda.device(device):
        t = torch.as_tensor(_CudaArray(ptr, nbytes, owner), device=f"cuda:{device}")
    assert t.data_ptr() == ptr, "torch copied instead of wrapping the device memory"
    return t


# ---------------------------------------------------------------------------- slabs


class DeviceSlab:
    """One device allocation owned by this process: ``cudaMalloc`` or VMM (``cuMemCreate``).

    The daemon's device pool lives in one; allocating it here, not through torch, is what
    makes it exportable to other processes.
    """

    def __init__(self, device: int, nbytes: int, mode: str, peers: Sequence[int] = ()) -> None:
        """Allocate the slab on ``device``.

        Args:
            device: the CUDA device index.
            nbytes: the size; a VMM slab rounds it up to the allocation granularity.
            mode: ``"legacy"`` (``cudaMalloc``) or ``"fd"`` (VMM with POSIX-fd handles).
            peers: other GPUs that copy from or into the slab. A VMM slab grants them
                access itself (peer access enabled on a context does not cover VMM memory);
                a ``cudaMalloc`` slab is reached once the peer's context enables access, as
                torch does on its first cross-device copy.

        Raises:
            ValueError: an unknown ``mode``.
            CudaMemError: a CUDA call failed (no CUDA, out of memory, ...).
        """
        if mode not in ("legacy", "fd"):
            raise ValueError(f"mode: must be 'legacy' or 'fd', got {mode!r}")
        self.device = device
        self.mode = mode
        self._handle = ctypes.c_ulonglong(0)
        self._closed = False
        with with_primary_context(device):
            self._allocate(nbytes, peers)
        self.tensor = wrap_device_bytes(self.ptr, self.nbytes, device, self)

    def _allocate(self, nbytes: int, peers: Sequence[int]) -> None:
        rt, drv = libs()
        if self.mode == "legacy":
            self.nbytes = nbytes
            ptr = ctypes.c_void_p(0)
            rt_check("cudaMalloc", rt.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(nbytes)))
            self.ptr = int(ptr.value or 0)
            return
        prop = self.allocation_prop(self.device)
        gran = ctypes.c_size_t(0)
        drv_check(
            "cuMemGetAllocationGranularity",
            drv.cuMemGetAllocationGranularity(
                ctypes.byref(gran), ctypes.byref(prop), CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
            ),
        )
        g = gran.value
        self.nbytes = -(-nbytes // g) * g
        drv_check(
            "cuMemCreate",
            drv.cuMemCreate(
                ctypes.byref(self._handle),
                ctypes.c_size_t(self.nbytes),
                ctypes.byref(prop),
                ctypes.c_ulonglong(0),
            ),
        )
        readers = [p for p in peers if p != self.device and _can_access(p, self.device)]
        try:
            self.ptr = map_vmm(self._handle, self.nbytes, self.device, g, readers)
        except CudaMemError:
            drv.cuMemRelease(self._handle)
            raise

    @staticmethod
    def allocation_prop(device: int) -> _AllocationProp:
        prop = _AllocationProp()
        prop.type = _CU_MEM_ALLOCATION_TYPE_PINNED
        prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FD
        prop.location = _MemLocation(_CU_MEM_LOCATION_TYPE_DEVICE, device)
        return prop

    def export_legacy(self) -> bytes:
        """The 64-byte ``cudaIpcMemHandle_t`` of the slab, for another process to open.

        Raises:
            CudaMemError: the slab is not a legacy one, or the export failed.
        """
        if self.mode != "legacy":
            raise CudaMemError("legacy IPC handles need a cudaMalloc slab (ipc mode 'legacy')")
        rt, _ = libs()
        handle = IpcMemHandle()
        rt_check(
            "cudaIpcGetMemHandle",
            rt.cudaIpcGetMemHandle(ctypes.byref(handle), ctypes.c_void_p(self.ptr)),
        )
        return bytes(handle.reserved)

    def export_fd(self) -> int:
        """A new POSIX file descriptor for the allocation, to send to another process.

        Returns:
            The fd; the caller closes it.

        Raises:
            CudaMemError: the slab is not an fd one, or the export failed.
        """
        if self.mode != "fd":
            raise CudaMemError("POSIX-fd handles need a VMM slab (ipc mode 'fd')")
        _, drv = libs()
        fd = ctypes.c_int(-1)
        drv_check(
            "cuMemExportToShareableHandle",
            drv.cuMemExportToShareableHandle(
                ctypes.byref(fd), self._handle, CU_MEM_HANDLE_TYPE_POSIX_FD, ctypes.c_ulonglong(0)
            ),
        )
        return fd.value

    def close(self) -> None:
        """Free the slab (idempotent).

        Every copy that touches it must have finished, in every process; this process's
        work on the device is waited for first.

        Raises:
            CudaMemError: freeing failed.
        """
        if self._closed:
            return
        self._closed = True
        torch.cuda.synchronize(self.device)
        rt, drv = libs()
        if self.mode == "legacy":
            rt_check("cudaFree", rt.cudaFree(ctypes.c_void_p(self.ptr)))
        else:
            unmap_vmm(self.ptr, self.nbytes)
            drv_check("cuMemRelease", drv.cuMemRelease(self._handle))


def _can_access(peer: int, device: int) -> bool:
    """Whether GPU ``peer`` can read and write GPU ``device``'s memory directly."""
    return bool(torch.cuda.can_device_access_peer(peer, device))


def map_vmm(
    handle: ctypes.c_ulonglong, nbytes: int, device: int, align: int, peers: Sequence[int] = ()
) -> int:
    """Reserve, map and open a VMM allocation to ``device`` (and to ``peers``)."""
    _, drv = libs()
    ptr = ctypes.c_ulonglong(0)
    drv_check(
        "cuMemAddressReserve",
        drv.cuMemAddressReserve(
            ctypes.byref(ptr),
            ctypes.c_size_t(nbytes),
            ctypes.c_size_t(align),
            ctypes.c_ulonglong(0),
            ctypes.c_ulonglong(0),
        ),
    )
    try:
        drv_check(
            "cuMemMap",
            drv.cuMemMap(
                ptr, ctypes.c_size_t(nbytes), ctypes.c_size_t(0), handle, ctypes.c_ulonglong(0)
            ),
        )
        gpus = [device, *peers]
        access = (_AccessDesc * len(gpus))(
            *(
                _AccessDesc(
                    _MemLocation(_CU_MEM_LOCATION_TYPE_DEVICE, d),
                    _CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
                )
                for d in gpus
            )
        )
        drv_check(
            "cuMemSetAccess",
            drv.cuMemSetAccess(ptr, ctypes.c_size_t(nbytes), access, ctypes.c_size_t(len(gpus))),
        )
    except CudaMemError:
        drv.cuMemUnmap(ptr, ctypes.c_size_t(nbytes))
        drv.cuMemAddressFree(ptr, ctypes.c_size_t(nbytes))
        raise
    return ptr.value


def unmap_vmm(ptr: int, nbytes: int) -> None:
    _, drv = libs()
    drv_check("cuMemUnmap", drv.cuMemUnmap(ctypes.c_ulonglong(ptr), ctypes.c_size_t(nbytes)))
    drv_check(
        "cuMemAddressFree", drv.cuMemAddressFree(ctypes.c_ulonglong(ptr), ctypes.c_size_t(nbytes))
    )
