"""Same-node gets without a call: copies of small entries straight out of the host pool.

The daemon publishes its READY entries in a read table beside the pool's segment
(``embcache.proto.read_table``; ``docs/same_node_reads.md``). A client on the node maps the
table and the pool read-only, finds a key's slot by its digest, copies the entry's runs and
then checks the slot's sequence number and the table's ``closed`` word again: unchanged
means the daemon neither changed nor withdrew the entry while the bytes were copied, so
the copy is the entry, whole. Anything else (not in the table, larger than the caller's
limit, changed meanwhile, the table closed) answers None, and the caller asks the daemon.

The check relies on the order in which one CPU's stores become visible to another, which
x86-64 guarantees for plain loads and stores (total store order); on other machines the
table is not used. Nothing is held while copying, so a reader that dies leaves nothing.
"""

from __future__ import annotations

import logging
import mmap
import os
import platform
import threading
from collections.abc import Sequence
from pathlib import Path

import torch

from embcache.clients.device.shm import SHM_DIR, PoolMapping, process_pool_maps
from embcache.proto import read_table as rt
from embcache.proto.constants import INLINE_TOTAL, SLOT_ALIGN
from embcache.proto.dtypes import DTYPES
from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.proto.locations import boot_id

log = logging.getLogger(__name__)

ORDERED_STORES = platform.machine().lower() in ("x86_64", "amd64")
_BUCKET = rt.WAYS * rt.SLOT_BYTES
_TORCH = [None, *(DTYPES[name].torch_dtype for name in rt.DTYPE_CODES)]  # by code


class ReadTable:
    """One daemon's read table, mapped read-only, and the pool its runs point into."""

    def __init__(self, mm: mmap.mmap, pool: PoolMapping, num_buckets: int, page: int) -> None:
        self._mm = mm  # kept: the view below reads it
        self._view = memoryview(mm)
        self._pool = pool.tensor
        self._pool_size = pool.size
        self._num_buckets = num_buckets
        self._page = page

    def read(self, key: str, limit: int) -> torch.Tensor | None:
        """A copy of ``key``'s entry if the table has it and it has at most ``limit`` bytes;
        None otherwise (ask the daemon)."""
        view = self._view
        key_digest = rt.digest(key)
        base = rt.slot_offset(rt.bucket_of(key_digest, self._num_buckets), 0)
        bucket = view[base : base + _BUCKET].tobytes()
        at = bucket.find(key_digest)
        while at >= 0 and at % rt.SLOT_BYTES != rt.DIGEST_AT:  # inside another field
            at = bucket.find(key_digest, at + 1)
        if at < 0:
            return None
        slot = base + at - rt.DIGEST_AT
        (seq,) = rt.SEQ.unpack_from(view, slot)
        if seq & 1:
            return None  # being rewritten
        fields = rt.BODY.unpack_from(view, slot + rt.SEQ.size)
        found, nbytes, live, code, ndim, nruns = fields[:6]
        if found != key_digest or not live or nbytes > limit or not 0 < code < len(_TORCH):
            return None
        out = self._copy(fields[6 + rt.MAX_DIMS :], nruns, nbytes)
        # Unchanged since before the copy, in a table still open: the daemon neither
        # rewrote nor withdrew the entry meanwhile.
        if out is None or rt.SEQ.unpack_from(view, slot)[0] != seq:
            return None
        if rt.SEQ.unpack_from(view, rt.CLOSED_AT)[0]:
            return None  # shut (draining, closed, or replaced by a new daemon)
        dtype = _TORCH[code]
        assert dtype is not None
        return out.view(dtype).view(fields[6 : 6 + ndim])

    def read_all(self, keys: Sequence[str], limit: int) -> list[torch.Tensor] | None:
        """Copies of every key's entry, or None if any one is not readable here or they
        come to more than a reply's copies would (``INLINE_TOTAL``: the daemon's answer
        then has views among them, and a table read gives the same answer or none)."""
        out, total = [], 0
        for key in keys:
            tensor = self.read(key, limit)
            if tensor is None:
                return None
            total += -total % SLOT_ALIGN + tensor.numel() * tensor.element_size()
            if total > INLINE_TOTAL:
                return None
            out.append(tensor)
        return out

    def _copy(self, runs: tuple[int, ...], nruns: int, nbytes: int) -> torch.Tensor | None:
        page, pool = self._page, self._pool
        if nruns == 1 and nbytes:
            start = runs[0] * page
            if start + nbytes > self._pool_size or runs[1] * page < nbytes:
                return None
            return pool[start : start + nbytes].clone()
        out = torch.empty(nbytes, dtype=torch.uint8)
        pos = 0
        for i in range(min(nruns, rt.MAX_RUNS)):
            start, take = runs[2 * i] * page, min(runs[2 * i + 1] * page, nbytes - pos)
            if start + take > self._pool_size:
                return None
            out[pos : pos + take].copy_(pool[start : start + take])
            pos += take
        return out if pos == nbytes else None


class ReadTables:
    """The tables this process has mapped, by file identity (None: not usable here)."""

    def __init__(self, shm_dir: Path = SHM_DIR) -> None:
        self._shm_dir = shm_dir
        self._lock = threading.Lock()
        self._by_identity: dict[tuple[str, int, int], ReadTable | None] = {}

    def get(self, info: pb.ReadTableInfo | None) -> ReadTable | None:
        """The table ``info`` names, mapped on first use; None where it cannot be used."""
        if info is None or not ORDERED_STORES:
            return None
        identity = (info.name, info.st_dev, info.st_ino)
        if identity in self._by_identity:
            return self._by_identity[identity]
        with self._lock:
            if identity not in self._by_identity:
                self._by_identity[identity] = self._open(info)
            return self._by_identity[identity]

    def _open(self, info: pb.ReadTableInfo) -> ReadTable | None:
        shm = info.pool.host_shm
        if info.pool.WhichOneof("kind") != "host_shm" or (shm.boot_id and shm.boot_id != boot_id()):
            return None  # another machine
        pool = process_pool_maps().get(info.pool)
        if pool is None or "/" in info.name or not info.name:
            return None
        try:
            fd = os.open(self._shm_dir / info.name, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as exc:
            log.info("read table %s not mappable here (%s)", info.name, exc)
            return None
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != (info.st_dev, info.st_ino) or st.st_size < info.size:
                return None  # another machine's or container's file of that name
            mm = mmap.mmap(fd, info.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        except (OSError, ValueError):
            return None
        finally:
            os.close(fd)  # the mapping stays
        header = rt.HEADER.unpack_from(mm, 0)
        magic, version, slot_bytes, ways, dims, runs, _, buckets, page, _ = header
        layout = (magic, version, slot_bytes, ways, dims, runs)
        expected = (rt.MAGIC, rt.VERSION, rt.SLOT_BYTES, rt.WAYS, rt.MAX_DIMS, rt.MAX_RUNS)
        if layout != expected or page != shm.page_bytes or rt.file_bytes(buckets) > info.size:
            log.info("read table %s has another layout: not used", info.name)
            mm.close()
            return None
        return ReadTable(mm, pool, buckets, page)


_process_tables = ReadTables()


def process_read_tables() -> ReadTables:
    """The per-process cache of mapped tables."""
    return _process_tables
