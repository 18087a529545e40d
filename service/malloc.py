"""glibc malloc thresholds for the daemon's buffers.

The daemon allocates and frees buffers of about 1 MiB per chunk it sends or receives
(GetBytes chunks, put chunks, protobuf messages). glibc serves blocks above its mmap
threshold (128 KiB at first, raised dynamically only after such a block is freed) with a
fresh ``mmap`` and returns them with ``munmap``: every chunk then costs its pages' minor
faults again, about 256 per MiB. Raising the mmap threshold keeps those blocks on the heap,
where they are reused, and raising the trim threshold stops the heap from being handed back
to the kernel after each burst. An operator's own ``MALLOC_MMAP_THRESHOLD_`` or
``MALLOC_TRIM_THRESHOLD_`` (glibc reads them at process start) is left in force.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger("embcache.daemon")

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit)
TRIM_THRESHOLD = 256 << 20  # heap kept after a burst before it is trimmed


def tune_malloc() -> bool:
    """Apply the thresholds (module docstring); False where this is not glibc or the
    operator set them through the environment."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    ok = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
    if ok:
        log.debug("malloc: mmap threshold %d, trim threshold %d", MMAP_THRESHOLD, TRIM_THRESHOLD)
    return ok
