"""Fault pages of a pool mapping in ahead of their first write, on a thread of its own.

This process's first write to a page of the shared segment is a page fault, which costs
about as much as the copy itself (a 4 MiB put into pages this mapping never wrote took
twice as long as one into pages it had). A stash is written by the next puts, so when one
arrives its runs are handed to :class:`Prefaulter`: a daemon thread faults them in with
``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14+), called through libc so that the GIL is
released while the kernel works, and the caller goes on at once. A put that reaches pages
not faulted in yet faults them itself (``shm_write.py``); nothing waits for this thread.

The thread belongs to the process that started it: after a fork, the child starts its own
on its first request. It ends once it has had nothing to do for ``IDLE_S``, so it never keeps
a mapping alive that the client let go of (a daemon that restarted has a new segment, and
the old one's memory goes once no process maps it); the next request starts another. Where
the kernel or libc refuse the advice, the thread stops asking.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import queue
import threading
from collections.abc import Callable, Sequence

log = logging.getLogger(__name__)
MADV_POPULATE_WRITE = 23  # linux/mman.h
CHUNK_BYTES = 4 << 20  # one system call's worth: a long run is done in pieces, in order
IDLE_S = 1.0  # the thread ends after this long without a request
Done = Callable[[int, int], None]  # (offset, length): faulted in


def _libc_madvise() -> Callable[[int, int, int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


class Prefaulter:
    """Faults runs of one mapping in, in the background (module docstring).

    ``base`` is the mapping's address and ``size`` its length; ``keep`` is any object that
    keeps the mapping alive while requests for it wait (the thread holds it meanwhile);
    ``done`` is told of each run once it is faulted in."""

    def __init__(self, base: int, size: int, keep: object, done: Done) -> None:
        self._base = base
        self._size = size
        self._keep = keep
        self._done = done
        self._madvise = _libc_madvise()
        self._jobs: queue.SimpleQueue[tuple[int, int]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pid = 0  # the process whose thread serves the queue
        self._thread: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        return self._madvise is not None

    def submit(self, runs: Sequence[tuple[int, int]]) -> None:
        """Fault ``(offset, length)`` runs in soon; returns at once."""
        if self._madvise is None:
            return
        with self._lock:
            if self._pid != os.getpid():  # first use, or a forked child: a thread of ours
                self._jobs = queue.SimpleQueue()
                self._pid = os.getpid()
                self._thread = threading.Thread(target=self._serve, args=(self._jobs,),
                                                daemon=True, name="embcache-prefault")  # fmt: skip
                self._thread.start()
            for offset, length in runs:
                if offset >= 0 and length > 0 and offset + length <= self._size:
                    self._jobs.put((offset, length))

    def join(self, timeout: float) -> bool:
        """Wait until the thread has ended (idle for ``IDLE_S``); True if it has."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
        return thread is None or not thread.is_alive()

    def _next(self, jobs: queue.SimpleQueue[tuple[int, int]]) -> tuple[int, int] | None:
        """The next request; None once none came for ``IDLE_S`` (the thread then ends, and
        the next ``submit`` starts another)."""
        while True:
            try:
                return jobs.get(timeout=IDLE_S)
            except queue.Empty:
                with self._lock:
                    if jobs.empty():
                        self._pid = 0
                        return None

    def _serve(self, jobs: queue.SimpleQueue[tuple[int, int]]) -> None:
        # Runs as a bound method: ``self._keep`` holds the mapping while the thread lives.
        while (job := self._next(jobs)) is not None and self._madvise is not None:
            offset, length = job
            for at in range(offset, offset + length, CHUNK_BYTES):
                n = min(CHUNK_BYTES, offset + length - at)
                if self._madvise(self._base + at, n, MADV_POPULATE_WRITE) != 0:
                    err = ctypes.get_errno()
                    log.debug("prefaulting stopped: madvise failed (%s)", os.strerror(err))
                    self._madvise = None  # an older kernel: plain page faults from now on
                    return
            self._done(offset, length)
