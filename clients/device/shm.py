"""Mappings of the daemon's host pool: the whole segment once per process, and each view
that ``get`` hands out in a private copy-on-write mapping of its own.

The pool is a POSIX shared-memory segment. It is mapped straight from ``/dev/shm/<name>``
with ``mmap``, never through ``multiprocessing.shared_memory``: on Python 3.11/3.12 that
registers the segment with the resource tracker, which unlinks the daemon's segment when
this process exits. The whole segment is mapped shared and read-only, once: it is only read
by this module (gathered copies of entries in several runs), never handed out.

A view of an entry is a mapping of its pages alone, ``MAP_PRIVATE`` with read and write
access over the read-only file descriptor (and ``MAP_NORESERVE``, so nothing is charged as
committed memory): it reads the cache's pages until the caller writes, and a write copies
only the pages it touches into memory of this process. So an in-place op on a returned
tensor never faults and never changes the cache, for other readers or for another view of
the same entry in this process, and each view's mapping is its anchor: it is unmapped, and
its lease can end, when the last tensor over it is gone (``core/views.py``). A fresh mapping
costs a system call and its page faults on first read (docs/grpc.md, "What a caller holds").

Before mapping, the segment's identity (kernel boot id, device and inode of the file) is
compared with what the daemon reported, so a client on another machine, or in a container
with its own ``/dev/shm``, never reads a different segment that happens to share the name;
it gets ``None`` and falls back to streaming the bytes.
"""

from __future__ import annotations

import logging
import mmap
import os
import sys
import threading
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.proto.locations import boot_id

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
# Not in Python's mmap module before 3.13; Linux's value (elsewhere: no such flag).
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform == "linux" else 0)


@dataclass(frozen=True, slots=True, weakref_slot=True)
class PoolMapping:
    name: str
    size: int
    tensor: torch.Tensor  # uint8 view of the whole segment (read-only memory; never handed out)
    _mmap: mmap.mmap
    fd: int  # the segment, opened read-only: views are mapped from it

    def private_view(self, offset: int, length: int) -> tuple[torch.Tensor, mmap.mmap] | None:
        """``length`` bytes at ``offset`` of the segment in a private copy-on-write mapping
        of their own (module docstring), as a writable uint8 tensor, and the mapping: the
        anchor every tensor over it keeps alive. None when no mapping can be made (the
        process's map count is used up, the segment is gone): copy the bytes instead."""
        if length <= 0 or offset < 0 or offset + length > self.size:
            return None
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        flags, prot = mmap.MAP_PRIVATE | MAP_NORESERVE, mmap.PROT_READ | mmap.PROT_WRITE
        try:
            mm = mmap.mmap(self.fd, offset + length - start, flags=flags, prot=prot, offset=start)
        except (OSError, ValueError):
            return None
        return torch.frombuffer(mm, dtype=torch.uint8)[offset - start :], mm


class PoolMaps:
    """pool_id -> mapping (or None when the pool is not reachable from this process)."""

    def __init__(self, shm_dir: Path = SHM_DIR) -> None:
        self._shm_dir = shm_dir
        self._lock = threading.Lock()
        self._by_pool_id: dict[str, PoolMapping | None] = {}
        self._by_identity: dict[tuple[int, int, int], PoolMapping] = {}
        self._by_name: dict[str, tuple[int, int, int]] = {}

    def get(self, handle: pb.PoolHandle) -> PoolMapping | None:
        with self._lock:
            if handle.pool_id in self._by_pool_id:
                return self._by_pool_id[handle.pool_id]
            mapping = self._open(handle)
            self._by_pool_id[handle.pool_id] = mapping
            return mapping

    def _open(self, handle: pb.PoolHandle) -> PoolMapping | None:
        if handle.WhichOneof("kind") != "host_shm":
            return None
        desc = handle.host_shm
        if desc.boot_id and desc.boot_id != boot_id():
            return None  # another machine
        identity = (desc.st_dev, desc.st_ino, desc.size)
        if identity in self._by_identity:  # same segment under a new pool id
            return self._by_identity[identity]
        fd = open_segment(self._shm_dir, desc, os.O_RDONLY)
        if fd is None:
            return None
        try:
            mm = mmap.mmap(fd, desc.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        except BaseException:
            os.close(fd)
            raise
        with warnings.catch_warnings():
            # torch warns that the buffer is not writable: it is only read here.
            warnings.filterwarnings("ignore", message=".*not writable.*", category=UserWarning)
            tensor = torch.frombuffer(mm, dtype=torch.uint8)
        mapping = PoolMapping(desc.segment_name, desc.size, tensor, mm, fd)
        weakref.finalize(mapping, os.close, fd)  # once nothing can map views from it
        self._forget(desc.segment_name)
        self._by_identity[identity] = mapping
        self._by_name[desc.segment_name] = identity
        return mapping

    def _forget(self, name: str) -> None:
        """Drop the mapping of an older segment of this name (its daemon is gone): the
        memory is unmapped once the last tensor viewing it is freed, its file descriptor
        once nothing uses the mapping, and views mapped from it stay valid."""
        old = self._by_identity.pop(self._by_name.pop(name, (-1, -1, -1)), None)
        if old is not None:
            for pool_id, mapping in list(self._by_pool_id.items()):
                if mapping is old:
                    del self._by_pool_id[pool_id]


def open_segment(shm_dir: Path, desc: pb.HostShmPool, flags: int) -> int | None:
    """A descriptor of the daemon's segment ``desc`` opened with ``flags`` (``O_RDONLY``, or
    ``O_RDWR`` for a client the daemon lets fill reserved pages), or None when the file is
    not there, cannot be opened so, or is not that segment (another device or inode: another
    machine's or container's ``/dev/shm``). The caller checks the boot id first."""
    if "/" in desc.segment_name or not desc.segment_name:
        return None
    path = shm_dir / desc.segment_name
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        log.info("host pool %s not mappable here (%s)", path, exc)
        return None
    try:
        st = os.fstat(fd)
    except OSError:
        os.close(fd)
        return None
    if (st.st_dev, st.st_ino) != (desc.st_dev, desc.st_ino) or st.st_size < desc.size:
        log.info("%s is not the daemon's segment", path)
        os.close(fd)
        return None
    return fd


def mapped_segment(tensor: torch.Tensor, shm_dir: Path = SHM_DIR) -> str | None:
    """The name of the shared-memory segment (a file in ``shm_dir``) whose pages
    ``tensor``'s bytes are mapped from (a host view), or None (memory of this process, e.g.
    a gathered copy). Reads ``/proc/self/maps``: for tests and diagnostics only."""
    ptr = tensor.data_ptr()
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split(maxsplit=5)
        start, _, end = fields[0].partition("-")
        if int(start, 16) <= ptr < int(end, 16):
            path = fields[5] if len(fields) == 6 else ""
            return path.removeprefix(f"{shm_dir}/") if path.startswith(f"{shm_dir}/") else None
    return None


_process_maps = PoolMaps()


def process_pool_maps() -> PoolMaps:
    """The per-process cache (mappings live as long as the process: tensors point into them)."""
    return _process_maps
