"""This process's mapping of the host pool, registered with CUDA chunk by chunk, in the background.

A GPU copies from registered (page-locked) host memory at link speed and from an unregistered
mapping at a sixth of it: on an H200 a second process that registered its own mapping of the
pool copied 4 MiB in 104 us, against 627 us unregistered (docs/same_node_reads.md, "GPU
destinations"). Registering costs about 0.07 s per GiB in a process whose pages the daemon
already pinned, seconds for a large pool, so it never runs on a caller's path: the first use
starts a daemon thread that registers the pool in chunks (``pool_chunks.CHUNK_BYTES``), those a
caller missed first, and a copy uses the registered path once every chunk it reads is done
(:meth:`RegisteredPool.covers`); until then the caller falls back (asks the daemon).

The mapping is ``PROT_READ``, so chunks are registered read-only
(``cudaHostRegisterReadOnly``): a driver or device that refuses that is recorded, registration
stops, and the pool reports not :attr:`~RegisteredPool.usable`. A pool whose segment is removed
(its daemon closed, or restarted with a new segment) is retired by the thread: it waits for
the copies queued through it, then unregisters everything and lets the mapping go. At process
exit the thread is stopped (after at most one chunk); nothing is unregistered then, since the
process's end releases it and copies may still be in flight.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Protocol

from embcache.clients.device.pool_chunks import CHUNK_BYTES, PoolChunks
from embcache.clients.device.shm import PoolMapping

log = logging.getLogger(__name__)

_PENDING, _REGISTERED, _FAILED = 0, 1, 2
WATCH_S = 2.0  # how often a registered pool checks that its segment still exists
_JOIN_S = 30.0  # longest wait for the thread's current chunk at close or exit


class Waitable(Protocol):
    """What a queued copy hands back (``torch.cuda.Event``)."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


Register = Callable[[int, int], None]  # (host address, bytes): raises when refused
Unregister = Callable[[int], None]  # (host address)


class RegisteredPool:
    """One mapping of the host pool and the chunks of it registered with CUDA so far.

    Thread safety: one thread registers, any number call :meth:`covers` and
    :meth:`queue_if_covered`; :meth:`close` may come from any of them.
    """

    def __init__(
        self,
        mapping: PoolMapping,
        register: Register,
        unregister: Unregister,
        *,
        chunk_bytes: int = CHUNK_BYTES,
        device: int | None = None,
        set_device: Callable[[int], None] | None = None,
        watch_s: float = WATCH_S,
    ) -> None:
        self.chunks = PoolChunks(mapping.size, chunk_bytes)
        self.name = mapping.name
        self.base = mapping.tensor.data_ptr()
        # Held while anything is registered: the memory must stay mapped. (Its tensor exports
        # the mmap's buffer, so nothing can close the mmap while this reference lives.)
        self._mapping: PoolMapping | None = mapping
        self._mapping_ref = weakref.ref(mapping)
        self._fd = mapping.fd
        self._register, self._unregister = register, unregister
        self._device, self._set_device = device, set_device
        self._watch_s = watch_s
        self._state = bytearray(self.chunks.num_chunks)  # per chunk: _PENDING/_REGISTERED/_FAILED
        self._asked = bytearray(self.chunks.num_chunks)  # chunks a caller missed (done first)
        self._wanted: collections.deque[int] = collections.deque()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._queued: list[Waitable] = []  # copies queued through this pool, maybe still running
        self._registered = self._failures = 0
        self._seconds = 0.0
        self.error: str | None = None  # why registration stopped, if it failed

    # -- callers -------------------------------------------------------------------------

    def ensure_started(self) -> None:
        """Start the registering thread, once; returns at once. Idempotent."""
        if self._thread is not None or self._closed:
            return
        with self._lock:
            if self._thread is not None or self._closed:
                return
            self._thread = threading.Thread(
                target=self._run, name=f"embcache-register-{self.name}", daemon=True
            )
            atexit.register(self._stop_at_exit)
            self._thread.start()

    def covers(self, start: int, end: int) -> bool:
        """True when every chunk overlapping ``[start, end)`` of the segment is registered
        (and the pool is open); an empty range is covered. A miss moves the chunks it lacks
        to the front of the registering order. False for a range outside the segment."""
        if self._closed or not 0 <= start <= end <= self.chunks.size:
            return False
        return self._covers(self.chunks.chunks_of(start, end))

    def queue_if_covered(
        self, chunks: Iterable[int], queue: Callable[[], Waitable]
    ) -> Waitable | None:
        """Run ``queue`` (which queues copies out of ``chunks`` and returns an event recorded
        after them) if every chunk is registered, so that :meth:`close` cannot unregister them
        in between; :meth:`close` waits for the event. None, queuing nothing, otherwise."""
        with self._lock:
            if self._closed or not self._covers(chunks):
                return None
            event = queue()
            if len(self._queued) >= 16:  # drop those done, so the list stays short
                self._queued = [e for e in self._queued if not e.query()]
            self._queued.append(event)
            return event

    @property
    def usable(self) -> bool:
        """False once the pool is closed, or when registration failed before any chunk was
        registered (e.g. read-only registration refused): callers should stop asking."""
        return not self._closed and not (self._failures and not self._registered)

    @property
    def closed(self) -> bool:
        return self._closed

    def is_for(self, mapping: PoolMapping) -> bool:
        """True when this registration is of ``mapping`` (not of an older one at its address)."""
        return self._mapping_ref() is mapping

    def stats(self) -> dict[str, float | int]:
        """Chunks registered/failed/total, bytes registered, seconds spent registering."""
        return {
            "chunks_total": self.chunks.num_chunks,
            "chunks_registered": self._registered,
            "chunks_failed": self._failures,
            "bytes_registered": sum(
                self.chunks.bounds(i)[1] - self.chunks.bounds(i)[0]
                for i, s in enumerate(self._state)
                if s == _REGISTERED
            ),
            "register_seconds": self._seconds,
            "usable": int(self.usable),
        }

    def wait_registered(self, timeout: float | None = None) -> bool:
        """Block until the thread has tried every chunk (or stopped); True when all are
        registered. For tests and benchmarks: callers never need to wait."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._thread is not None and not self._done():
            if not self._thread.is_alive() or self._closed:
                break
            if deadline is not None and time.monotonic() > deadline:
                break
            time.sleep(0.001)
        return self._registered == self.chunks.num_chunks and not self._closed

    def close(self) -> None:
        """Stop registering, wait for the copies queued through :meth:`queue_if_covered`,
        then unregister every chunk and let the mapping go. Idempotent. Copies queued past
        this pool (by callers who only asked :meth:`covers`) must have finished."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(_JOIN_S)
            if thread.is_alive():
                log.warning("host pool %s: registration did not stop in time", self.name)
        with contextlib.suppress(Exception):
            atexit.unregister(self._stop_at_exit)
        self._shutdown("closed")

    # -- the registering thread ----------------------------------------------------------

    def _covers(self, chunks: Iterable[int]) -> bool:
        state, covered = self._state, True
        for i in chunks:
            if state[i] != _REGISTERED:
                covered = False
                if not self._asked[i]:
                    self._asked[i] = 1
                    self._wanted.append(i)
        return covered

    def _done(self) -> bool:
        return self._stop.is_set() or _PENDING not in self._state or self._failures > 0

    def _next_chunk(self, cursor: int) -> tuple[int | None, int]:
        while self._wanted:  # a caller's misses first
            i = self._wanted.popleft()
            if self._state[i] == _PENDING:
                return i, cursor
        while cursor < len(self._state) and self._state[cursor] != _PENDING:
            cursor += 1
        return (cursor, cursor + 1) if cursor < len(self._state) else (None, cursor)

    def _run(self) -> None:
        try:
            if self._device is not None and self._set_device is not None:
                self._set_device(self._device)  # else the thread's calls would use device 0
            self._register_all()
            while not self._stop.wait(self._watch_s):
                if not self._segment_exists():
                    self._shutdown("its segment was removed")
                    return
        except Exception:  # a thread's exception would be lost: say it, and stop
            log.exception("host pool %s: registration stopped", self.name)
            self._shutdown("registration stopped")

    def _register_all(self) -> None:
        cursor = 0
        while not self._stop.is_set():
            chunk, cursor = self._next_chunk(cursor)
            if chunk is None:
                return
            if not self._segment_exists():
                self._shutdown("its segment was removed")
                return
            start, end = self.chunks.bounds(chunk)
            began = time.perf_counter()
            try:
                self._register(self.base + start, end - start)
            except Exception as exc:
                self._state[chunk] = _FAILED
                self._failures += 1
                self.error = str(exc)
                log.warning(
                    "host pool %s: registering bytes [%d, %d) failed (%s); copies to GPUs "
                    "from the chunks not registered go through the daemon",
                    self.name,
                    start,
                    end,
                    exc,
                )
                return  # the driver refuses: the rest would fail alike
            finally:
                self._seconds += time.perf_counter() - began
            with self._lock:
                if not self._closed:  # a single byte store: covers() sees it whole
                    self._state[chunk] = _REGISTERED
                    self._registered += 1
                    continue
            # Closed meanwhile (close() gave up waiting for this chunk): undo it.
            self._unregister(self.base + start)
            return

    def _segment_exists(self) -> bool:
        """False once the segment's file is gone from ``/dev/shm``: its daemon closed (or
        restarted with a new segment), and the pages stay only because this process maps
        and pins them."""
        try:
            return os.fstat(self._fd).st_nlink > 0
        except OSError:
            return False

    def _shutdown(self, reason: str) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True  # from here covers() answers False
            chunks = [i for i, s in enumerate(self._state) if s == _REGISTERED]
            for i in chunks:
                self._state[i] = _PENDING
            queued, self._queued = self._queued, []
        self._stop.set()
        for event in queued:
            try:
                event.synchronize()
            except Exception as exc:  # a failed copy: its memory is released all the same
                log.warning("host pool %s: a queued copy failed (%s)", self.name, exc)
        for i in chunks:
            try:
                self._unregister(self.base + self.chunks.bounds(i)[0])
            except Exception as exc:
                log.warning("host pool %s: unregistering chunk %d failed (%s)", self.name, i, exc)
        self._registered = 0
        self._mapping = None
        if chunks:
            log.info("host pool %s: unregistered (%s)", self.name, reason)

    def _stop_at_exit(self) -> None:
        """At interpreter exit: let the thread finish its chunk and stop, so it is not inside
        a CUDA call while the runtime is torn down."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(_JOIN_S)


class RegisteredPools:
    """This process's registrations, one per pool mapping (``shm.PoolMaps`` maps each
    segment once per process, so one per segment)."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES) -> None:
        self._chunk_bytes = chunk_bytes
        self._lock = threading.Lock()
        self._by_mapping: dict[int, RegisteredPool] = {}  # id(mapping) -> its registration

    def get(self, mapping: PoolMapping) -> RegisteredPool | None:
        """The registration of ``mapping``, started on first use; None without CUDA."""
        from embcache.kernels import _cudart

        rt = _cudart.runtime()
        if rt is None:
            return None
        with self._lock:
            reg = self._by_mapping.get(id(mapping))
            if reg is None or not reg.is_for(mapping):
                for key in [k for k, r in self._by_mapping.items() if r.closed]:
                    del self._by_mapping[key]  # retired: their segments are gone
                import torch

                flags = (
                    _cudart.HOST_REGISTER_PORTABLE
                    | _cudart.HOST_REGISTER_MAPPED
                    | _cudart.HOST_REGISTER_READ_ONLY
                )
                device = torch.cuda.current_device()

                def register(ptr: int, nbytes: int) -> None:
                    try:
                        rt.host_register(ptr, nbytes, flags)
                    except _cudart.CudaRuntimeError as exc:
                        attr = _cudart.DEV_ATTR_HOST_REGISTER_READ_ONLY_SUPPORTED
                        supported = rt.device_attribute(attr, device)
                        raise _cudart.CudaRuntimeError(
                            f"read-only cudaHostRegister (device {device} reports read-only "
                            f"registration supported={supported})",
                            exc.code,
                            str(exc),
                        ) from exc

                reg = RegisteredPool(
                    mapping,
                    register,
                    rt.host_unregister,
                    chunk_bytes=self._chunk_bytes,
                    device=device,
                    set_device=rt.set_device,
                )
                self._by_mapping[id(mapping)] = reg
        reg.ensure_started()
        return reg


_process_registrations = RegisteredPools()


def registered_pool(mapping: PoolMapping) -> RegisteredPool | None:
    """This process's registration of ``mapping`` (registering in the background from the
    first call on), or None on a machine without CUDA."""
    return _process_registrations.get(mapping)
