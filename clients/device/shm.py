"""Read-only mappings of the daemon's host pool, opened once per process and cached.

The pool is a POSIX shared-memory segment. It is mapped straight from ``/dev/shm/<name>``
with ``mmap``, never through ``multiprocessing.shared_memory``: on Python 3.11/3.12 that
registers the segment with the resource tracker, which unlinks the daemon's segment when
this process exits. The mapping is read-only: a write through a returned tensor faults
instead of corrupting the cache for every other reader.

Before mapping, the segment's identity (kernel boot id, device and inode of the file) is
compared with what the daemon reported, so a client on another machine, or in a container
with its own ``/dev/shm``, never reads a different segment that happens to share the name;
it gets ``None`` and falls back to streaming the bytes.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.proto.locations import boot_id

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")


@dataclass(frozen=True, slots=True)
class PoolMapping:
    name: str
    size: int
    tensor: torch.Tensor  # uint8 view of the whole segment (read-only memory)
    _mmap: mmap.mmap


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
        if "/" in desc.segment_name or not desc.segment_name:
            return None
        path = self._shm_dir / desc.segment_name
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            log.info("host pool %s not mappable here (%s); streaming bytes instead", path, exc)
            return None
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != (desc.st_dev, desc.st_ino) or st.st_size < desc.size:
                log.info("%s is not the daemon's segment; streaming bytes instead", path)
                return None
            mm = mmap.mmap(fd, desc.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        with warnings.catch_warnings():
            # torch warns that the buffer is not writable: that is the point.
            warnings.filterwarnings("ignore", message=".*not writable.*", category=UserWarning)
            tensor = torch.frombuffer(mm, dtype=torch.uint8)
        mapping = PoolMapping(desc.segment_name, desc.size, tensor, mm)
        self._forget(desc.segment_name)
        self._by_identity[identity] = mapping
        self._by_name[desc.segment_name] = identity
        return mapping

    def _forget(self, name: str) -> None:
        """Drop the mapping of an older segment of this name (its daemon is gone): the
        memory is unmapped once the last tensor viewing it is freed."""
        old = self._by_identity.pop(self._by_name.pop(name, (-1, -1, -1)), None)
        if old is not None:
            for pool_id, mapping in list(self._by_pool_id.items()):
                if mapping is old:
                    del self._by_pool_id[pool_id]


_process_maps = PoolMaps()


def process_pool_maps() -> PoolMaps:
    """The per-process cache (mappings live as long as the process: tensors point into them)."""
    return _process_maps
