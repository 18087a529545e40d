"""Device-resident hits without a call: device-to-device copies out of the daemon's pools.

An entry the daemon keeps resident in a device pool (HBM) is offered in the read table
with its page runs there (``proto/read_table.py``; ``docs/same_node_reads.md``,
"Device-resident hits"). A client on the node that maps that pool (the same cached IPC
mapping device gets use, ``pools.py``) copies the runs into its own tensor on its own
stream, waits for that copy, and then checks the slot as for a host copy:

    located = table.locate(key)
    placement = placement_on(located, table.device_pools, out.device)
    event = copy_from_device_pool(located, placement, table.device_pools, out, stream)
    event.synchronize()
    table.unchanged(located)  # True: ``out`` holds the entry, whole

Why the check holds: the daemon withdraws the runs (the slot's sequence number changes)
before the pages go back to its allocator, so before any copy that reuses them is even
queued; a copy that read a byte of such a reuse therefore ran after the change was made,
and the check made after that copy completed sees it. A 4 MiB device-to-device copy takes a
few microseconds; the call it replaces, hundreds.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Sequence

import torch

from embcache.clients.device.device_replies import pool_handle
from embcache.clients.device.pools import DevicePoolCache, process_device_pools
from embcache.clients.device.read_table import DevicePlacement, Located, ReadTable
from embcache.proto.embcache.v1 import embcache_pb2 as pb

log = logging.getLogger(__name__)

_Opened = tuple[torch.Tensor, int, int]  # the pool's bytes, its page size, its CUDA ordinal


class TablePools:
    """Device pools opened for table reads, by pool id (once each, through the process's
    ``DevicePoolCache``), and the pools that cannot be opened here, so that a client
    without access to one does not ask the daemon's fd socket again on every read."""

    def __init__(self, cache: DevicePoolCache | None = None) -> None:
        self._cache = cache if cache is not None else process_device_pools()
        self._lock = threading.Lock()
        self._opened: dict[str, _Opened | None] = {}

    def open(self, handle: pb.PoolHandle) -> _Opened | None:
        """``handle``'s pool as ``(bytes, page size, CUDA ordinal)``; None where it cannot
        be opened in this process (another machine's GPU, no IPC, a refused fd)."""
        if handle.pool_id in self._opened:
            return self._opened[handle.pool_id]
        with self._lock:
            if handle.pool_id not in self._opened:
                self._opened[handle.pool_id] = self._open(handle)
            return self._opened[handle.pool_id]

    def _open(self, handle: pb.PoolHandle) -> _Opened | None:
        if handle.WhichOneof("kind") != "device" or not handle.pool_id:
            return None
        try:
            desc = pool_handle(handle)
            if desc.page_bytes <= 0 or (desc.ipc_handle is None and desc.fd_socket is None):
                return None  # nothing this process can map (a CPU test pool)
            tensor = self._cache.pool_tensor(desc, handle.device.size)
        except (OSError, RuntimeError, ValueError) as exc:
            log.info(
                "device pool %s not readable here (%s): table reads use the host",
                handle.pool_id,
                exc,
            )
            return None
        return tensor, desc.page_bytes, tensor.device.index or 0


_process_pools = TablePools()


def process_table_pools() -> TablePools:
    """The per-process pools opened for table reads."""
    return _process_pools


@functools.cache
def _gpu_uuid(index: int) -> str:
    from embcache.kernels import cuda_mem

    return cuda_mem.gpu_uuid(index)


def placement_on(
    located: Located, pools: Sequence[pb.PoolHandle], device: torch.device
) -> DevicePlacement | None:
    """The placement of ``located`` in a pool on ``device``'s GPU (``pools``: the table's
    ``device_pools``), or None when it has none there."""
    if not located.devices or device.type != "cuda":
        return None
    uuid = _gpu_uuid(torch.cuda.current_device() if device.index is None else device.index)
    for placement in located.devices:
        if 0 <= placement.pool < len(pools):
            handle = pools[placement.pool]
            if handle.WhichOneof("kind") == "device" and handle.device.gpu_uuid == uuid:
                return placement
    return None


def copy_from_device_pool(
    located: Located,
    placement: DevicePlacement,
    pools: Sequence[pb.PoolHandle],
    out: torch.Tensor,
    stream: torch.cuda.Stream,
    *,
    opened: TablePools | None = None,
) -> torch.cuda.Event | None:
    """Queue the copies of ``placement``'s runs (of the entry ``located``) into ``out`` on
    ``stream`` and return an event recorded after them; check ``ReadTable.unchanged``
    once it has fired. None, nothing queued, when the pool cannot be used here: not
    announced, not openable, on another GPU than ``out``, or runs that do not fit it (a
    slot that changed under the reader): the caller copies from the host instead.

    Args:
        pools: the device pools the table announced (``ReadTable.device_pools``).
        out: a contiguous CUDA tensor of exactly ``located.nbytes`` bytes (any dtype).
        stream: a stream of ``out``'s device; the copies follow the work queued on it.
        opened: where pools are opened and cached (the process's by default).
    Raises:
        ValueError: ``out`` is not a contiguous CUDA tensor of the entry's size.
    """
    if out.device.type != "cuda" or not out.is_contiguous():
        raise ValueError(f"out: a contiguous CUDA tensor is needed, got {out.device}")
    if out.numel() * out.element_size() != located.nbytes:
        raise ValueError(f"out: {out.numel() * out.element_size()} bytes, entry {located.nbytes}")
    if not 0 <= placement.pool < len(pools):
        return None
    found = (opened if opened is not None else _process_pools).open(pools[placement.pool])
    if found is None:
        return None
    pool, page, gpu = found
    if gpu != out.device.index:
        return None
    runs = _byte_runs(placement.runs, page, located.nbytes, pool.numel())
    if runs is None:
        return None
    from embcache import kernels

    rt = kernels.cuda_runtime()
    if rt is None:
        return None
    dst, src, handle = out.data_ptr(), pool.data_ptr(), stream.cuda_stream
    with _on_device(gpu):
        try:
            for start, take, at in runs:
                rt.memcpy_async(dst + at, src + start, take, handle)
        except kernels.CudaRuntimeError as exc:
            log.warning("device-to-device copy from the table failed: %s", exc)
            return None
        event = torch.cuda.Event()
        event.record(stream)
    return event


def read_into(
    table: ReadTable,
    key: str,
    out: torch.Tensor,
    stream: torch.cuda.Stream | None = None,
    *,
    opened: TablePools | None = None,
) -> Located | None:
    """Copy ``key``'s entry into ``out`` (a contiguous CUDA tensor of its size) from a
    device pool on ``out``'s GPU, the whole flow: locate, copy, wait, check. Returns what
    was located when ``out`` holds the entry, whole; None when the table cannot serve it
    that way (not there, not resident on that GPU, another size, changed meanwhile), and
    the caller takes another path. Blocks until the copy is complete."""
    located = table.locate(key)
    if located is None or located.nbytes != out.numel() * out.element_size():
        return None
    placement = placement_on(located, table.device_pools, out.device)
    if placement is None:
        return None
    if stream is None:
        stream = torch.cuda.current_stream(out.device)
    event = copy_from_device_pool(
        located, placement, table.device_pools, out, stream, opened=opened
    )
    if event is None:
        return None
    event.synchronize()
    return located if table.unchanged(located) else None


def _byte_runs(
    runs: Sequence[tuple[int, int]], page: int, nbytes: int, size: int
) -> list[tuple[int, int, int]] | None:
    """``(source offset, byte count, destination offset)`` per page run, trimmed to
    ``nbytes``; None when they fall outside a pool of ``size`` bytes or short of
    ``nbytes`` (a slot read while it changed)."""
    out, pos = [], 0
    for first, count in runs:
        if pos == nbytes:
            break
        start, take = first * page, min(count * page, nbytes - pos)
        if count <= 0 or start + take > size:
            return None
        out.append((start, take, pos))
        pos += take
    return out if pos == nbytes else None


def _on_device(index: int) -> contextlib.AbstractContextManager[object]:
    """Make ``index`` current only when it is not already (switching costs microseconds)."""
    if torch.cuda.current_device() == index:
        return contextlib.nullcontext()
    return torch.cuda.device(index)
