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
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from embcache.clients.device.shm import SHM_DIR, PoolMapping, PoolMaps, process_pool_maps
from embcache.proto import read_table as rt
from embcache.proto.dtypes import DTYPES
from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.proto.locations import boot_id

log = logging.getLogger(__name__)

# The default ``copy_gets_up_to``: same-node gets copy entries up to this size out of the pool
# (no lease held past the call); larger ones are leased views, which copy nothing.
COPY_GETS_UP_TO = 256 << 20
ORDERED_STORES = platform.machine().lower() in ("x86_64", "amd64")
_BUCKET = rt.WAYS * rt.SLOT_BYTES
_TORCH = [None, *(DTYPES[name].torch_dtype for name in rt.DTYPE_CODES)]  # by code


class DevicePlacement(NamedTuple):
    """Where an entry is resident in one of the daemon's device pools: the pool's index in
    ``ReadTableInfo.device_pools`` and its page runs there, ``(first page, page count)`` in
    that pool's pages (``table_device.copy_from_device_pool`` copies them)."""

    pool: int
    runs: rt.PageRuns


@dataclass(frozen=True, slots=True)
class Located:
    """An entry found in the table: where its bytes are, and the slot's sequence number
    when it was read (:meth:`ReadTable.unchanged` checks it again after a copy)."""

    slot: int
    seq: int
    nbytes: int
    dtype: torch.dtype
    dtype_name: str  # as the wire names it ("bfloat16")
    shape: tuple[int, ...]
    runs: tuple[tuple[int, int], ...]  # (byte offset in the pool, byte count), in order
    devices: tuple[DevicePlacement, ...] = ()  # its copies in device pools, if any


class ReadTable:
    """One daemon's read table, mapped read-only, and the pool its runs point into."""

    def __init__(self, mm: mmap.mmap, pool: PoolMapping, num_buckets: int, page: int) -> None:
        self._mm = mm  # kept: the view below reads it
        self._view = memoryview(mm)
        self.pool = pool
        self._num_buckets = num_buckets
        self._page = page
        self.device_pools: tuple[pb.PoolHandle, ...] = ()  # the pools device sections name

    def locate(self, key: str, limit: int | None = None) -> Located | None:
        """Where ``key``'s entry is, if the table has it (of at most ``limit`` bytes, when
        given) and no change of its slot is under way; None otherwise (ask the daemon).
        Nothing is copied: check :meth:`unchanged` after copying the runs."""
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
        if found != key_digest or not live or not 0 < code < len(_TORCH) or ndim > rt.MAX_DIMS:
            return None
        if limit is not None and nbytes > limit:
            return None
        runs = self._byte_runs(fields[6 + rt.MAX_DIMS :], nruns, nbytes)
        if runs is None or rt.SEQ.unpack_from(view, rt.CLOSED_AT)[0]:
            return None
        dtype = _TORCH[code]
        assert dtype is not None
        name = rt.DTYPE_CODES[code - 1]
        devices = _devices(view, slot)
        shape = tuple(fields[6 : 6 + ndim])
        return Located(slot, seq, nbytes, dtype, name, shape, runs, devices)

    def unchanged(self, located: Located) -> bool:
        """True when the slot still holds what :meth:`locate` found, in a table still open:
        the daemon neither rewrote nor withdrew the entry since, so a copy made in between
        (and complete by now) is the entry, whole."""
        if rt.SEQ.unpack_from(self._view, located.slot)[0] != located.seq:
            return False
        return not rt.SEQ.unpack_from(self._view, rt.CLOSED_AT)[0]

    def copy_host(self, located: Located, out: torch.Tensor | None = None) -> torch.Tensor:
        """The entry's bytes copied out of the pool into ``out`` (a contiguous uint8 CPU
        tensor of ``located.nbytes``) or a new tensor; check :meth:`unchanged` afterwards."""
        pool = self.pool.tensor
        if out is None:
            if len(located.runs) == 1:
                start, take = located.runs[0]
                return pool[start : start + take].clone()
            out = torch.empty(located.nbytes, dtype=torch.uint8)
        pos = 0
        for start, take in located.runs:
            out[pos : pos + take].copy_(pool[start : start + take])
            pos += take
        return out

    def read(self, key: str, limit: int | None = None) -> torch.Tensor | None:
        """A copy of ``key``'s entry if the table has it (of at most ``limit`` bytes, when
        given) and it did not change while it was copied; None otherwise (ask the daemon)."""
        located = self.locate(key, limit)
        if located is None:
            return None
        out = self.copy_host(located)
        if not self.unchanged(located):
            return None
        return out.view(located.dtype).view(located.shape)

    def read_all(self, keys: Sequence[str], limit: int | None = None) -> list[torch.Tensor] | None:
        """Copies of every key's entry, or None if any one is not readable here."""
        out = []
        for key in keys:
            tensor = self.read(key, limit)
            if tensor is None:
                return None
            out.append(tensor)
        return out

    def contains(self, key: str) -> bool:
        """True when the table has ``key``'s entry, READY, right now; False means only
        "not here": the daemon may still hold it (ask it)."""
        located = self.locate(key)
        return located is not None and self.unchanged(located)

    def _byte_runs(
        self, runs: tuple[int, ...], nruns: int, nbytes: int
    ) -> tuple[tuple[int, int], ...] | None:
        """The slot's page runs as byte ranges of the pool that add up to ``nbytes``; None
        when they do not fit the pool (a slot changing under the reader) or fall short."""
        page, size = self._page, self.pool.size
        out, pos = [], 0
        for i in range(min(nruns, rt.MAX_RUNS)):
            if pos == nbytes:
                break
            start, take = runs[2 * i] * page, min(runs[2 * i + 1] * page, nbytes - pos)
            if start + take > size:
                return None
            out.append((start, take))
            pos += take
        return tuple(out) if pos == nbytes else None


class ReadTables:
    """The tables this process has mapped, by file identity (None: not usable here)."""

    def __init__(self, shm_dir: Path = SHM_DIR) -> None:
        self._shm_dir = shm_dir
        self._lock = threading.Lock()
        self._by_identity: dict[tuple[str, int, int, int], ReadTable | None] = {}

    def get(self, info: pb.ReadTableInfo | None, maps: PoolMaps | None = None) -> ReadTable | None:
        """The table ``info`` names, mapped on first use (its pool through ``maps``, the
        process's by default); None where it cannot be used."""
        if info is None or not ORDERED_STORES:
            return None
        maps = maps or process_pool_maps()
        identity = (info.name, info.st_dev, info.st_ino, id(maps))
        if identity in self._by_identity:
            return self._by_identity[identity]
        with self._lock:
            if identity not in self._by_identity:
                self._by_identity[identity] = self._open(info, maps)
            return self._by_identity[identity]

    def _open(self, info: pb.ReadTableInfo, maps: PoolMaps) -> ReadTable | None:
        shm = info.pool.host_shm
        if info.pool.WhichOneof("kind") != "host_shm" or (shm.boot_id and shm.boot_id != boot_id()):
            return None  # another machine
        pool = maps.get(info.pool)
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
        sections, device_runs = rt.DEVICE_HEADER.unpack_from(mm, rt.DEVICE_HEADER_AT)
        layout = (magic, version, slot_bytes, ways, dims, runs, sections, device_runs)
        expected = (
            *(rt.MAGIC, rt.VERSION, rt.SLOT_BYTES, rt.WAYS, rt.MAX_DIMS, rt.MAX_RUNS),
            *(rt.DEVICE_SECTIONS, rt.DEVICE_RUNS),
        )
        if layout != expected or page != shm.page_bytes or rt.file_bytes(buckets) > info.size:
            log.info("read table %s has another layout: not used", info.name)
            mm.close()
            return None
        table = ReadTable(mm, pool, buckets, page)
        table.device_pools = tuple(info.device_pools)
        return table


def _devices(view: memoryview, slot: int) -> tuple[DevicePlacement, ...]:
    """The live device sections of the slot at ``slot`` (unchecked: a copy made from them
    is validated by the slot's sequence number, as the host runs are)."""
    out = []
    for i in range(rt.DEVICE_SECTIONS):
        at = rt.device_at(slot, i)
        if view[at]:  # live
            found = rt.unpack_device(view, at)
            if found is not None:
                out.append(DevicePlacement(*found))
    return tuple(out)


_process_tables = ReadTables()


def process_read_tables() -> ReadTables:
    """The per-process cache of mapped tables."""
    return _process_tables
