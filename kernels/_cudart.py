"""The few CUDA runtime calls torch does not expose, through ctypes on the loaded libcudart.

The library is the one torch already loaded (found in ``/proc/self/maps``), so streams and
pointers are shared with torch. Every return code is checked. ``cudaMemcpyBatchAsync`` is looked
up at run time: its signature changed between CUDA 12.8 (with a ``failIdx`` out-argument) and
13.0 (without), so the runtime version picks the prototype; when it is absent the batch backend
falls back to per-range copies.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from collections.abc import Sequence

import numpy as np

_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction inferred from the pointers (UVA)
_SRC_ACCESS_ORDER_STREAM = 1  # cudaMemcpySrcAccessOrderStream
_ERROR_NOT_READY = 600  # cudaErrorNotReady: work still queued
_EVENT_DISABLE_TIMING = 0x2  # cudaEventDisableTiming
HOST_REGISTER_PORTABLE = 0x1
HOST_REGISTER_MAPPED = 0x2
# cudaHostRegisterReadOnly: the device only reads the range. Needed for memory mapped without
# write access (the driver pins such pages for reading only); a device that cannot do it
# reports 0 for DEV_ATTR_HOST_REGISTER_READ_ONLY_SUPPORTED and refuses the flag.
HOST_REGISTER_READ_ONLY = 0x8
ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered
# cudaDeviceAttr values read with CudaRuntime.device_attribute
DEV_ATTR_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM = 91  # registered memory: device ptr == host ptr
DEV_ATTR_HOST_REGISTER_READ_ONLY_SUPPORTED = 113


class CudaRuntimeError(RuntimeError):
    """A CUDA runtime call returned an error code."""

    def __init__(self, call: str, code: int, message: str) -> None:
        super().__init__(f"{call} failed: error {code} ({message})")
        self.call = call
        self.code = code


class _MemLocation(ctypes.Structure):
    _fields_ = (("type", ctypes.c_int), ("id", ctypes.c_int))


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = (
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _MemLocation),
        ("dstLocHint", _MemLocation),
        ("flags", ctypes.c_uint),
    )


def find_libcudart_path() -> str | None:
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(" ", 1)[-1].strip()
                if "/libcudart.so" in path:
                    return path
    except OSError:
        return None
    return None


class CudaRuntime:
    """Thin checked wrappers over the loaded CUDA runtime."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        lib.cudaGetErrorString.argtypes = (ctypes.c_int,)
        version = ctypes.c_int(0)
        self.check("cudaRuntimeGetVersion", lib.cudaRuntimeGetVersion(ctypes.byref(version)))
        self.version = version.value
        lib.cudaMemcpyAsync.argtypes = (
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_void_p,
        )
        lib.cudaHostGetDevicePointer.argtypes = (
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.c_void_p,
            ctypes.c_uint,
        )
        lib.cudaStreamQuery.argtypes = (ctypes.c_void_p,)
        lib.cudaStreamSynchronize.argtypes = (ctypes.c_void_p,)
        lib.cudaEventCreateWithFlags.argtypes = (ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint)
        lib.cudaEventRecord.argtypes = (ctypes.c_void_p, ctypes.c_void_p)
        lib.cudaEventQuery.argtypes = (ctypes.c_void_p,)
        lib.cudaEventSynchronize.argtypes = (ctypes.c_void_p,)
        lib.cudaEventDestroy.argtypes = (ctypes.c_void_p,)
        lib.cudaHostRegister.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint)
        lib.cudaHostUnregister.argtypes = (ctypes.c_void_p,)
        lib.cudaDeviceGetAttribute.argtypes = (
            ctypes.POINTER(ctypes.c_int),
            ctypes.c_int,
            ctypes.c_int,
        )
        lib.cudaSetDevice.argtypes = (ctypes.c_int,)
        self._batch = self._bind_batch(lib)

    def _bind_batch(self, lib: ctypes.CDLL) -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
        if self.version < 12080:
            return None
        try:
            fn = lib.cudaMemcpyBatchAsync
        except AttributeError:
            return None
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        if self.version >= 13000:
            fn.argtypes = (vp, vp, vp, sz, vp, vp, sz, vp)
        else:  # 12.8/12.9: ... numAttrs, size_t* failIdx, stream
            fn.argtypes = (vp, vp, vp, sz, vp, vp, sz, vp, vp)
        fn.restype = ctypes.c_int
        return fn

    @property
    def has_batch(self) -> bool:
        return self._batch is not None

    def check(self, call: str, code: int) -> None:
        if code != 0:
            # Reset the thread's last-error state (for non-sticky errors), or torch's next
            # launch check would report this error as its own.
            self.lib.cudaGetLastError()
            message = self.lib.cudaGetErrorString(code).decode(errors="replace")
            raise CudaRuntimeError(call, code, message)

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self.check(
            "cudaMemcpyAsync",
            self.lib.cudaMemcpyAsync(dst, src, nbytes, _MEMCPY_DEFAULT, stream),
        )

    def stream_idle(self, stream: int) -> bool:
        """True when ``stream`` (a ``cudaStream_t``) has no work left."""
        code = self.lib.cudaStreamQuery(stream)
        if code == _ERROR_NOT_READY:
            return False
        self.check("cudaStreamQuery", code)
        return True

    def stream_synchronize(self, stream: int) -> None:
        self.check("cudaStreamSynchronize", self.lib.cudaStreamSynchronize(stream))

    def event_after(self, stream: int) -> StreamEvent:
        """A new event recorded on ``stream`` (a ``cudaStream_t``): it fires once the work
        queued there so far has run. For streams torch has no object for at hand (the
        current stream, by its raw handle: making its Stream object costs more host time
        than the calls here)."""
        handle = ctypes.c_void_p(0)
        self.check(
            "cudaEventCreateWithFlags",
            self.lib.cudaEventCreateWithFlags(ctypes.byref(handle), _EVENT_DISABLE_TIMING),
        )
        event = StreamEvent(self, int(handle.value or 0))
        self.check("cudaEventRecord", self.lib.cudaEventRecord(event.handle, stream))
        return event

    def memcpy_batch_async(
        self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int
    ) -> None:
        """One ``cudaMemcpyBatchAsync`` over uint64 address arrays; stream must not be 0."""
        assert self._batch is not None, "cudaMemcpyBatchAsync is not available"
        assert stream != 0, "cudaMemcpyBatchAsync does not take the legacy default stream"
        count = len(sizes)
        dsts = np.ascontiguousarray(dsts, dtype=np.uint64)
        srcs = np.ascontiguousarray(srcs, dtype=np.uint64)
        sizes = np.ascontiguousarray(sizes, dtype=np.uint64)
        attrs = _MemcpyAttributes(srcAccessOrder=_SRC_ACCESS_ORDER_STREAM)
        attr_idx = ctypes.c_size_t(0)
        args: list[object] = [
            dsts.ctypes.data,
            srcs.ctypes.data,
            sizes.ctypes.data,
            count,
            ctypes.addressof(attrs),
            ctypes.addressof(attr_idx),
            1,
        ]
        fail_idx = ctypes.c_size_t(0)
        if self.version < 13000:
            args.append(ctypes.addressof(fail_idx))
        args.append(stream)
        self.check("cudaMemcpyBatchAsync", self._batch(*args))

    def host_device_pointer(self, host_ptr: int) -> int:
        """Device address of page-locked (allocated or registered) host memory; raises if not."""
        out = ctypes.c_void_p(0)
        self.check(
            "cudaHostGetDevicePointer",
            self.lib.cudaHostGetDevicePointer(ctypes.byref(out), host_ptr, 0),
        )
        return int(out.value or 0)

    def host_register(self, ptr: int, nbytes: int, flags: int) -> None:
        self.check("cudaHostRegister", self.lib.cudaHostRegister(ptr, nbytes, flags))

    def host_unregister(self, ptr: int) -> None:
        self.check("cudaHostUnregister", self.lib.cudaHostUnregister(ptr))

    def device_attribute(self, attr: int, device: int) -> int:
        """``cudaDeviceGetAttribute(attr, device)``: one of the ``DEV_ATTR_*`` values."""
        value = ctypes.c_int(0)
        self.check(
            "cudaDeviceGetAttribute",
            self.lib.cudaDeviceGetAttribute(ctypes.byref(value), attr, device),
        )
        return value.value

    def set_device(self, device: int) -> None:
        """``cudaSetDevice`` for the calling thread (a thread starts on device 0, whose context
        it would create on its first call)."""
        self.check("cudaSetDevice", self.lib.cudaSetDevice(device))


class StreamEvent:
    """A CUDA event from :meth:`CudaRuntime.event_after`, with the two calls a waiter needs
    (the same as ``torch.cuda.Event``'s); destroyed with the object (CUDA releases it once
    it has fired)."""

    __slots__ = ("_rt", "handle")

    def __init__(self, rt: CudaRuntime, handle: int) -> None:
        self._rt = rt
        self.handle = handle

    def query(self) -> bool:
        code = self._rt.lib.cudaEventQuery(self.handle)
        if code == _ERROR_NOT_READY:
            return False
        self._rt.check("cudaEventQuery", code)
        return True

    def synchronize(self) -> None:
        self._rt.check("cudaEventSynchronize", self._rt.lib.cudaEventSynchronize(self.handle))

    def __del__(self) -> None:
        if self.handle:
            with contextlib.suppress(Exception):  # at interpreter exit the library may be gone
                self._rt.lib.cudaEventDestroy(self.handle)
            self.handle = 0


@functools.cache
def _load() -> CudaRuntime | None:
    import torch

    if not torch.cuda.is_available():
        return None
    torch.cuda.init()  # loads libcudart into the process
    candidates: Sequence[str | None] = (
        find_libcudart_path(),
        "libcudart.so.13",
        "libcudart.so.12",
        "libcudart.so",
    )
    for name in candidates:
        if name is None:
            continue
        try:
            return CudaRuntime(ctypes.CDLL(name))
        except (OSError, AttributeError):
            continue
    return None


def runtime() -> CudaRuntime | None:
    """The process's CUDA runtime, or ``None`` on a machine without CUDA."""
    return _load()
