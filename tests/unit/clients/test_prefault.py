"""Pages of a new stash are faulted in by a background thread (clients/device/prefault.py)."""

from __future__ import annotations

import mmap
import os
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from embcache.clients.device.prefault import Prefaulter

MiB = 1 << 20


@pytest.fixture
def mapping() -> Iterator[np.ndarray]:
    fd = os.memfd_create("embcache-prefault-test")
    try:
        os.ftruncate(fd, 8 * MiB)
        mm = mmap.mmap(fd, 8 * MiB, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)
    yield np.frombuffer(mm, dtype=np.uint8)


def resident_pages(array: np.ndarray) -> int:
    """Pages of ``array`` mapped in this process (mincore through the page map)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    vec = (ctypes.c_ubyte * (array.nbytes // page))()
    assert libc.mincore(ctypes.c_void_p(array.ctypes.data), ctypes.c_size_t(array.nbytes), vec) == 0
    return sum(b & 1 for b in vec)


def test_runs_are_faulted_in_off_the_callers_thread(mapping: np.ndarray) -> None:
    seen: list[tuple[int, int, str]] = []
    done = threading.Event()

    def on_done(offset: int, length: int) -> None:
        seen.append((offset, length, threading.current_thread().name))
        if len(seen) == 2:
            done.set()

    faulter = Prefaulter(mapping.ctypes.data, mapping.nbytes, mapping, on_done)
    if not faulter.enabled:
        pytest.skip("no madvise in libc")
    before = resident_pages(mapping)
    # a run past the end and an empty one are ignored; the others are done in order
    faulter.submit([(0, 2 * MiB), (7 * MiB, 2 * MiB), (3 * MiB, 0), (4 * MiB, MiB)])
    if not done.wait(10) and not faulter.enabled:
        pytest.skip("the kernel refuses MADV_POPULATE_WRITE (before Linux 5.14)")
    time.sleep(0.05)  # nothing more comes
    assert [(o, n) for o, n, _ in seen] == [(0, 2 * MiB), (4 * MiB, MiB)]
    assert {name for _, _, name in seen} == {"embcache-prefault"}
    if seen and before == 0:  # the kernel took the advice: the pages are mapped now
        assert resident_pages(mapping) >= (3 * MiB) // mmap.PAGESIZE


def test_a_pool_prefaults_only_pages_it_has_not_written(mapping: np.ndarray) -> None:
    from embcache.clients.device.shm_write import WritablePool, _marker

    page = 256 * 1024
    written = bytearray(mapping.nbytes // page)
    asked: list[list[tuple[int, int]]] = []

    class Recorder(Prefaulter):
        def submit(self, runs):  # type: ignore[no-untyped-def]
            asked.append(list(runs))
            for offset, length in runs:
                self._done(offset, length)

    faulter = Recorder(mapping.ctypes.data, mapping.nbytes, mapping, _marker(written, page))
    pool = WritablePool(mapping.nbytes, mapping, None, page, written, [True], faulter)  # type: ignore[arg-type]
    pool.prefault([(0, 2 * page), (4 * page, page)])
    assert asked == [[(0, 2 * page), (4 * page, page)]]
    assert written[:6] == bytearray([1, 1, 0, 0, 1, 0])
    pool.prefault([(page, 2 * page), (4 * page, page)])  # page 2 is new; 1 and 4 are done
    assert asked[-1] == [(page, 2 * page)]
    pool.prefault([(0, page)])
    assert len(asked) == 2  # nothing left to do: no request


def test_the_thread_ends_when_idle_and_lets_the_mapping_go(
    mapping: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gc
    import weakref

    from embcache.clients.device import prefault

    monkeypatch.setattr(prefault, "IDLE_S", 0.05)
    done = threading.Event()

    class Kept:  # stands for the mapping: nothing may hold it once the thread is idle
        pass

    kept = Kept()
    faulter = Prefaulter(mapping.ctypes.data, mapping.nbytes, kept, lambda o, n: done.set())
    if not faulter.enabled:
        pytest.skip("no madvise in libc")
    faulter.submit([(0, MiB)])
    if not done.wait(10) and not faulter.enabled:
        pytest.skip("the kernel refuses MADV_POPULATE_WRITE (before Linux 5.14)")
    assert faulter.join(10)
    # a later request starts another thread
    done.clear()
    faulter.submit([(MiB, MiB)])
    assert done.wait(10)
    # once idle, dropping the owner (the pool) drops the mapping too
    assert faulter.join(10)
    ref = weakref.ref(kept)
    del faulter, kept
    gc.collect()
    assert ref() is None
