"""The daemon's malloc thresholds (service/malloc.py)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from embcache.service import malloc

GLIBC = platform.libc_ver()[0] == "glibc"


CYCLES = """
import ctypes, resource, sys
if sys.argv[1] == "tuned":
    from embcache.service import malloc
    assert malloc.tune_malloc()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
def burst():  # eight 1 MiB buffers written and freed, as chunks of a transfer are
    blocks = [libc.malloc(1 << 20) for _ in range(8)]
    for b in blocks:
        ctypes.memset(b, 1, 1 << 20)
    for b in blocks:
        libc.free(b)
burst()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(16):
    burst()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    cmd = [sys.executable, "-c", CYCLES, mode]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    return int(out.stdout)


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt")
def test_thresholds_keep_megabyte_buffers_on_the_heap() -> None:
    # Without them each burst maps its buffers afresh (16 bursts x 8 MiB: about 32k faults);
    # with them the heap is reused and the pages stay.
    plain, tuned = _faults("plain"), _faults("tuned")
    assert tuned < 256 < plain, (plain, tuned)


def test_an_operators_environment_is_left_in_force(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    assert malloc.tune_malloc() is False
