"""A writable mapping of the daemon's host pool, for puts written into stashes here.

A same-node put is one copy: the daemon holds a stash of free pages for this process
(``stash_refill``), this process copies the tensor's bytes straight into some of them, and
the commit makes the entry visible (docs/same_node_reads.md, "Writes with no reservation per
put"). The daemon serves those calls only to a peer with its own uid, which could open the
segment for writing anyway; this module opens ``/dev/shm/<name>`` read-write itself, after
the same identity checks as the read-only mapping (``shm.py``: boot id, device and inode),
so it never writes a segment that merely shares the name. Nothing but
:meth:`WritablePool.write_runs` writes through it, and only into pages of this process's
stashes; the mapping is never handed out.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from embcache.clients.device.prefault import Done, Prefaulter
from embcache.clients.device.shm import SHM_DIR, open_segment
from embcache.proto.checksum import crc32
from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.proto.locations import boot_id

log = logging.getLogger(__name__)
PIECE_BYTES = 256 << 10  # copied, then checksummed, while in the CPU's cache
# Linux 5.14+: fault a range in with one system call. This process's first write to a page
# of the segment is a page fault; a scratch run on the CI machine copied 4 MiB into pages
# this mapping had not touched in 2.6 ms, 1.3 ms after this madvise, 0.58 ms once mapped
# (where the madvise itself still costs 0.14-0.29 ms: so only pages not written yet get it).
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


@dataclass(frozen=True, slots=True)
class WritablePool:
    """The whole segment mapped shared and writable (one per segment and process)."""

    size: int
    array: np.ndarray  # uint8 over the mapping
    _mmap: mmap.mmap
    page_bytes: int
    written: bytearray  # per pool page: 1 once this mapping wrote it (faulted in)
    populate: list[bool]  # [False] once the kernel refused MADV_POPULATE_WRITE
    prefaulter: Prefaulter  # faults a new stash's pages in, off the caller's thread

    def prefault(self, runs: Sequence[tuple[int, int]]) -> None:
        """Have the pages of ``runs`` (byte offsets and lengths) that this mapping has not
        written yet faulted in by the background thread (``prefault.py``); returns at once.
        """
        todo = [
            (off, n) for off, n in runs if n > 0 and self.written.find(0, *self._span(off, n)) >= 0
        ]
        if todo:
            self.prefaulter.submit(todo)

    def write_runs(self, runs: Any, data: memoryview, *, checksum: bool = False) -> int | None:
        """Copy ``data`` into ``runs`` (``ByteRun``s, in order) of the segment: they must
        cover exactly ``data``'s bytes and lie inside the segment (ValueError otherwise,
        before anything is written). With ``checksum``, returns the CRC32 of the bytes,
        computed piece by piece right after each piece is copied (while it is in cache:
        one pass over memory fewer than a CRC before the copy)."""
        src = np.frombuffer(data, dtype=np.uint8) if data.nbytes else np.empty(0, np.uint8)
        spans = [(int(r.offset), int(r.length)) for r in runs]
        if sum(n for _, n in spans) != src.size:
            raise ValueError(f"runs cover {sum(n for _, n in spans)} bytes, not {src.size}")
        if any(off < 0 or off + n > self.size for off, n in spans):
            raise ValueError("a reserved run lies outside the segment")
        crc, pos = 0, 0
        for off, n in spans:
            self._populate(off, n)
            for at in range(0, n, PIECE_BYTES):
                end = min(at + PIECE_BYTES, n)
                self.array[off + at : off + end] = src[pos + at : pos + end]
                if checksum:
                    crc = crc32(src[pos + at : pos + end].data, crc)
            pos += n
        return crc if checksum else None

    def _span(self, offset: int, length: int) -> tuple[int, int]:
        """The pool pages ``[first, last)`` that bytes ``[offset, offset + length)`` touch."""
        return _page_span(offset, length, self.page_bytes)

    def _populate(self, offset: int, length: int) -> None:
        """Fault the pages of a run in before they are first written (a hint)."""
        if not length:
            return
        first, last = self._span(offset, length)
        if self.written.find(0, first, last) < 0:
            return  # every page of it is mapped here already
        self.written[first:last] = b"\x01" * (last - first)
        if not self.populate[0]:
            return
        start = offset - offset % mmap.PAGESIZE
        try:
            self._mmap.madvise(MADV_POPULATE_WRITE, start, offset + length - start)
        except OSError:  # an older kernel: plain page faults
            self.populate[0] = False


class WritableMaps:
    """pool_id -> writable mapping, or None where the segment cannot be opened for writing
    here (another machine or ``/dev/shm``, another uid)."""

    def __init__(self, shm_dir: Path = SHM_DIR) -> None:
        self._shm_dir = shm_dir
        self._lock = threading.Lock()
        self._by_pool_id: dict[str, WritablePool | None] = {}
        self._by_name: dict[str, str] = {}  # segment name -> its latest pool id

    def get(self, handle: pb.PoolHandle) -> WritablePool | None:
        with self._lock:
            if handle.pool_id not in self._by_pool_id:
                # A new pool under a known name: its daemon restarted. Let go of the old
                # mapping (unmapped once no write uses it) so its memory can go too.
                old = self._by_name.pop(handle.host_shm.segment_name, None)
                if old is not None:
                    self._by_pool_id.pop(old, None)
                self._by_pool_id[handle.pool_id] = self._open(handle)
                self._by_name[handle.host_shm.segment_name] = handle.pool_id
            return self._by_pool_id[handle.pool_id]

    def _open(self, handle: pb.PoolHandle) -> WritablePool | None:
        if handle.WhichOneof("kind") != "host_shm":
            return None
        desc = handle.host_shm
        if desc.boot_id and desc.boot_id != boot_id():
            return None
        fd = open_segment(self._shm_dir, desc, os.O_RDWR)
        if fd is None:
            return None
        try:
            prot = mmap.PROT_READ | mmap.PROT_WRITE
            mm = mmap.mmap(fd, desc.size, flags=mmap.MAP_SHARED, prot=prot)
        except OSError as exc:
            log.info("cannot map the host pool for writing (%s)", exc)
            return None
        finally:
            os.close(fd)  # the mapping keeps the memory
        page = max(int(desc.page_bytes), mmap.PAGESIZE)
        written = bytearray(-(-desc.size // page))
        array = np.frombuffer(mm, dtype=np.uint8)
        prefaulter = Prefaulter(array.ctypes.data, desc.size, array, _marker(written, page))
        return WritablePool(desc.size, array, mm, page, written, [True], prefaulter)


def _marker(written: bytearray, page: int) -> Done:
    """Marks the pool pages of a run faulted in (``WritablePool.written``)."""

    def done(offset: int, length: int) -> None:
        first, last = _page_span(offset, length, page)
        written[first:last] = b"\x01" * (last - first)

    return done


def _page_span(offset: int, length: int, page: int) -> tuple[int, int]:
    return offset // page, (offset + length - 1) // page + 1


_process_maps = WritableMaps()


def process_writable_maps() -> WritableMaps:
    """The per-process cache of writable mappings (kept for the life of the process)."""
    return _process_maps
