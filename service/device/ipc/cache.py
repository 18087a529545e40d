"""Client allocations the daemon opened through CUDA IPC, cached and bounded.

``PutFromDevice`` and ``GetInto`` name a client's CUDA tensor by the legacy IPC handle of
the allocation holding it. Opening a handle costs more than a whole cached get (docs/facts.md,
"CUDA IPC between processes on one node") and CUDA maps one handle at most once per process,
so mappings are cached by handle bytes and
shared by every owner (session, or ``anon:<client>``) that used them. A mapping is closed when
the last owner that used it ends (``drop_owner``) or when the cache is over its bound and the
mapping is the least recently used one; never while a copy is using it (``in_use``).

A handle stays unique for the life of its allocation (CUDA hands out a new one when freed
memory is allocated again), so a cached mapping never aliases another allocation. Keeping a
mapping open keeps the client's memory alive after the client frees it, which is why the
cache is bounded and tied to owners.

A client's interprocess events (they say when its writes of a tensor are done) are cached
too, per session and handle: clients reuse their events from call to call, and opening one
costs far more than waiting on one that has fired (docs/grpc.md, "Client events"). They
hold no memory; they go with their owner, or the least recently used beyond
:data:`MAX_EVENTS`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from embcache.errors import DeviceUnavailable, InvalidArgument

log = logging.getLogger(__name__)

MAX_MAPPINGS = 64
MAX_EVENTS = 256
ANON_PREFIX = "anon:"  # owners of calls without a session (transport/session/registry.py)
IPC_HANDLE_BYTES = 64


class Mapping(Protocol):
    """An opened allocation (``kernels.cuda_ipc.ImportedMemory`` on a GPU)."""

    nbytes: int

    def tensor(self, offset: int = 0, nbytes: int | None = None) -> torch.Tensor: ...
    def close(self) -> None: ...


class IpcEvent(Protocol):
    """An opened interprocess event (``torch.cuda.Event`` on a GPU)."""

    def synchronize(self) -> None: ...
    def query(self) -> bool: ...


class IpcBackend(Protocol):
    """How the daemon reaches client memory; the CUDA one below, or a fake in CPU tests."""

    def available(self) -> bool: ...
    def gpu_index(self, gpu_uuid: str) -> int | None: ...
    def open(self, handle: bytes, device: int, alloc_size: int) -> Mapping: ...
    def open_event(self, handle: bytes, device: int) -> IpcEvent: ...


class CudaIpc:
    """Legacy CUDA IPC through ``kernels.cuda_mem`` (imported lazily: CPU daemons never load it)."""

    def __init__(self, cuda_in_use: bool) -> None:
        self._cuda = cuda_in_use

    def available(self) -> bool:
        """Whether this daemon uses CUDA (else the device RPCs are refused)."""
        return self._cuda and torch.cuda.is_available()

    def gpu_index(self, gpu_uuid: str) -> int | None:
        """The CUDA ordinal of the GPU with this uuid here (None: not visible)."""
        from embcache.kernels import cuda_mem

        return cuda_mem.device_by_uuid(gpu_uuid)

    def open(self, handle: bytes, device: int, alloc_size: int) -> Mapping:
        """Map the allocation behind ``handle``, checked to hold ``alloc_size`` bytes.

        Raises DeviceUnavailable when it cannot be opened here, InvalidArgument when the
        allocation is smaller than the client said."""
        from embcache.kernels import cuda_ipc, cuda_mem

        try:
            mem = cuda_ipc.open_legacy(handle, device, alloc_size)
        except (cuda_mem.CudaMemError, ValueError) as exc:
            raise DeviceUnavailable(
                "cannot open the client's CUDA IPC handle in the daemon (another container "
                "without a shared IPC namespace, a stale handle, or not a handle)",
                reason=str(exc),
                device=device,
            ) from None
        try:
            actual = _allocation_bytes(mem.ptr)
        except Exception as exc:  # the check is a safety net: log, trust the client's size
            log.warning("cannot query the size of an opened IPC allocation: %s", exc)
            actual = alloc_size
        if actual < alloc_size:
            mem.close()
            raise InvalidArgument(
                "alloc_size is larger than the allocation the handle exports",
                alloc_size=alloc_size,
                actual=actual,
            )
        mem.nbytes = actual  # the mapping covers the whole allocation
        return mem

    def open_event(self, handle: bytes, device: int) -> IpcEvent:
        """Open a client's interprocess event; InvalidArgument when that fails."""
        try:
            return torch.cuda.Event.from_ipc_handle(torch.device("cuda", device), handle)
        except RuntimeError as exc:
            raise InvalidArgument("cannot open event_handle", reason=str(exc)) from None


def _allocation_bytes(ptr: int) -> int:
    """Bytes from ``ptr`` to the end of its allocation (driver ``cuMemGetAddressRange``)."""
    from embcache.kernels import cuda_ipc

    return cuda_ipc.allocation_bytes(ptr)


@dataclass(frozen=True, slots=True)
class IpcStats:
    """What the daemon holds of its clients' GPU memory (for metrics)."""

    mappings: int  # client allocations open now
    mapped_bytes: int  # their sizes: client memory kept alive while mapped
    opens: int  # allocations opened since start
    closes: int
    events: int  # session events kept open now
    event_opens: int  # events opened since start


@dataclass(eq=False)
class _Opened:
    handle: bytes
    mapping: Mapping
    device: int
    size: int
    owners: set[str] = field(default_factory=set)
    in_use: int = 0
    doomed: bool = False  # close once the last copy using it finishes


class IpcCache:
    """The open client allocations and events (module docstring); thread-safe."""

    def __init__(self, backend: IpcBackend, max_mappings: int = MAX_MAPPINGS) -> None:
        if max_mappings < 1:
            raise ValueError(f"max_mappings: must be >= 1, got {max_mappings}")
        self.backend = backend
        self.max_mappings = max_mappings
        self._lock = threading.Lock()
        self._open: OrderedDict[bytes, _Opened] = OrderedDict()
        self._events: OrderedDict[tuple[str, bytes, int], IpcEvent] = OrderedDict()
        self.opens = 0
        self.closes = 0
        self.event_opens = 0

    def __len__(self) -> int:
        return len(self._open)

    def stats(self) -> IpcStats:
        """What is open now and the opens so far (the metrics read it)."""
        with self._lock:
            return IpcStats(
                mappings=len(self._open),
                mapped_bytes=sum(o.size for o in self._open.values()),
                opens=self.opens,
                closes=self.closes,
                events=len(self._events),
                event_opens=self.event_opens,
            )

    @contextlib.contextmanager
    def tensor(
        self, owner: str, handle: bytes, device: int, alloc_size: int, offset: int, nbytes: int
    ) -> Iterator[torch.Tensor]:
        """A uint8 tensor over ``[offset, offset + nbytes)`` of the client's allocation.

        The mapping is not closed before the ``with`` block ends (the caller's copies must be
        complete by then)."""
        opened = self._acquire(owner, bytes(handle), device, alloc_size)
        try:
            if offset + nbytes > opened.size:
                raise InvalidArgument(
                    "tensor lies outside the allocation",
                    offset=offset,
                    nbytes=nbytes,
                    alloc_size=opened.size,
                )
            yield opened.mapping.tensor(offset, nbytes)
        finally:
            self._release(opened)

    def _acquire(self, owner: str, handle: bytes, device: int, alloc_size: int) -> _Opened:
        with self._lock:
            opened = self._open.get(handle)
            if opened is not None and not opened.doomed:
                if opened.device != device:
                    raise InvalidArgument(
                        "this handle was opened on another GPU", device=device, was=opened.device
                    )
                self._open.move_to_end(handle)
            else:
                if opened is not None:  # doomed but still copying: CUDA maps a handle once
                    raise DeviceUnavailable("the allocation is being closed; retry", device=device)
                mapping = self.backend.open(handle, device, alloc_size)
                opened = _Opened(handle, mapping, device, mapping.nbytes)
                self._open[handle] = opened
                self.opens += 1
                self._trim()
            opened.owners.add(owner)
            opened.in_use += 1
            return opened

    def _release(self, opened: _Opened) -> None:
        with self._lock:
            opened.in_use -= 1
            if opened.doomed and opened.in_use == 0:
                self._close(opened)

    def _trim(self) -> None:
        for opened in list(self._open.values()):
            if len(self._open) <= self.max_mappings:
                return
            if opened.in_use == 0 and not opened.doomed:
                self._doom(opened)

    def _doom(self, opened: _Opened) -> None:
        # One in use stays in the table (so its handle is not opened twice) until released.
        opened.doomed = True
        if opened.in_use == 0:
            self._close(opened)

    def _close(self, opened: _Opened) -> None:
        if self._open.get(opened.handle) is opened:
            del self._open[opened.handle]
        try:
            opened.mapping.close()
        except Exception:
            log.exception("closing an IPC mapping failed")
        self.closes += 1

    def mapped(self, handle: bytes, device: int) -> bool:
        """Whether the allocation behind ``handle`` is open on GPU ``device`` already (and
        not being closed), so :meth:`tensor` maps nothing new."""
        with self._lock:
            opened = self._open.get(bytes(handle))
            return opened is not None and not opened.doomed and opened.device == device

    def opened_event(self, owner: str, handle: bytes, device: int) -> ClientEvent | None:
        """``owner``'s event ``handle`` if it is open already (never opens anything, so never
        blocks: None means the caller should open it in a worker thread)."""
        key = (owner, bytes(handle), device)
        with self._lock:
            event = self._events.get(key)
        return None if event is None else ClientEvent(self, key, event)

    def wait_event(self, owner: str, handle: bytes, device: int) -> None:
        """Block until the client's event ``handle`` (on GPU ``device``) has fired.
        InvalidArgument when it cannot be opened or waited on."""
        self.event(owner, handle, device).wait()

    def event(self, owner: str, handle: bytes, device: int) -> ClientEvent:
        """The client's event ``handle`` on GPU ``device``, to poll or wait on.

        A session's events are opened once and kept until the session ends. A caller without
        a session (``anon:<client>``, which many processes may share) gets its event opened
        each time: nothing would tell the daemon that the process behind a cached event died
        and another one now sends the same handle bytes."""
        key = (owner, bytes(handle), device)
        keep = not owner.startswith(ANON_PREFIX)
        with self._lock:
            event = self._events.get(key) if keep else None
            if event is not None:
                self._events.move_to_end(key)
        if event is None:
            event = self.backend.open_event(key[1], device)  # outside the lock: it is slow
            with self._lock:
                self.event_opens += 1
                if keep:
                    event = self._events.setdefault(key, event)
                    while len(self._events) > MAX_EVENTS:
                        self._events.popitem(last=False)
        return ClientEvent(self, key, event)

    def forget_event(self, key: tuple[str, bytes, int]) -> None:
        """Drop a cached event that failed, so the next call opens it again."""
        with self._lock:
            self._events.pop(key, None)

    def drop_owner(self, owner: str) -> int:
        """``owner`` ended: close the mappings no other owner used and forget its events.
        Returns how many mappings closed."""
        with self._lock:
            for key in [k for k in self._events if k[0] == owner]:
                del self._events[key]
            before = self.closes
            for opened in list(self._open.values()):
                opened.owners.discard(owner)
                if not opened.owners and not opened.doomed:
                    self._doom(opened)
            return self.closes - before

    def close(self) -> None:
        """Close every mapping not in use; those in use close when their copy ends."""
        with self._lock:
            for opened in list(self._open.values()):
                if not opened.doomed:
                    self._doom(opened)


@dataclass(frozen=True, slots=True)
class ClientEvent:
    """An opened client event (:meth:`IpcCache.event`). An event that fails is forgotten by
    the cache, and the failure raises InvalidArgument."""

    cache: IpcCache
    key: tuple[str, bytes, int]
    event: IpcEvent

    def fired(self) -> bool:
        """Whether it has fired (never blocks)."""
        return bool(self._use(self.event.query))

    def wait(self) -> None:
        """Block until it has fired."""
        self._use(self.event.synchronize)

    def _use(self, fn: Callable[[], object]) -> object:
        try:
            return fn()
        except RuntimeError as exc:
            self.cache.forget_event(self.key)
            raise InvalidArgument("cannot wait on event_handle", reason=str(exc)) from None


def check_ipc_handle(handle: Any, what: str) -> bytes:
    """``handle`` if it is a legacy IPC handle's size; InvalidArgument naming ``what``."""
    if not isinstance(handle, bytes) or len(handle) != IPC_HANDLE_BYTES:
        size = len(handle) if isinstance(handle, bytes) else None
        raise InvalidArgument(f"{what} must be {IPC_HANDLE_BYTES} bytes", got=size)
    return handle
