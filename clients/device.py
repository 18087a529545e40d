"""Client side of get-to-device: open each daemon pool once, turn results into tensors.

A device pool is opened once per process and cached by its pool id (opening costs about
half a millisecond; FACTS.md). Results carry page ids or one offset; a contiguous entry
becomes a zero-copy view of the pool, a fragmented one is gathered with one launch into a
tensor the client owns. A mapping lives as long as the process (tensors point into it); a
daemon that restarts announces new pool ids, which are opened afresh.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)


class HostFallbacks:
    """GPUs (by uuid) whose device path failed in this client, so gets for them copy
    through the host for a while: ``retry_s`` later the device path is tried again (a
    restarted daemon, a pool back in service). Each fallback is logged as a warning."""

    def __init__(self, retry_s: float = 30.0, clock: Callable[[], float] = time.monotonic):
        self.retry_s = retry_s
        self._clock = clock
        self._until: dict[str, float] = {}

    def add(self, uuid: str, reason: object) -> None:
        log.warning("GPU %s: %s; copying through the host for %.0f s", uuid, reason, self.retry_s)
        self._until[uuid] = self._clock() + self.retry_s

    def __contains__(self, uuid: object) -> bool:
        until = self._until.get(uuid)  # type: ignore[call-overload]
        if until is None:
            return False
        if self._clock() >= until:
            self._until.pop(uuid, None)  # type: ignore[call-overload]
            return False
        return True

    def __iter__(self) -> Iterator[str]:
        return iter([u for u in list(self._until) if u in self])

    def __len__(self) -> int:
        return sum(1 for _ in self)


def fetch_fd(path: str | Path, pool_id: str, token: int, timeout: float = 5.0) -> int:
    """Ask the daemon's fd socket for a pool's file descriptor (the caller owns it)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(str(path))
        sock.sendall(json.dumps({"pool_id": pool_id, "token": token}).encode() + b"\n")
        msg, fds, _, _ = socket.recv_fds(sock, 256, 1)
        if not msg.startswith(b"OK") or not fds:
            for fd in fds:
                os.close(fd)
            raise ConnectionError(f"fd server refused: {msg.decode(errors='replace').strip()}")
        return fds[0]


@dataclass(frozen=True, slots=True)
class DevicePoolHandle:
    """What a client needs to open a device pool (from a Get reply)."""

    pool_id: str
    gpu_uuid: str
    nbytes: int  # bytes to map: the whole exported allocation
    page_bytes: int
    ipc_handle: bytes | None = None  # legacy cudaIpcMemHandle
    fd_socket: str | None = None  # POSIX-fd mode: where to fetch the fd
    fd_token: int | None = None


class DevicePoolCache:
    """Process-wide cache of opened device pools, keyed by pool id."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[str, Any] = {}  # pool id -> kernels.cuda_ipc.ImportedMemory
        self._tensors: dict[str, torch.Tensor] = {}  # pool id -> uint8 view of its bytes
        self._events: dict[bytes, torch.cuda.Event] = {}  # IPC event handle -> opened event
        self.opens = 0

    def open(self, handle: DevicePoolHandle) -> Any:
        with self._lock:
            mem = self._open.get(handle.pool_id)
            if mem is not None:
                return mem
            from embcache.kernels import cuda_ipc, cuda_mem

            device = cuda_mem.device_by_uuid(handle.gpu_uuid)
            if device is None:
                raise RuntimeError(f"GPU {handle.gpu_uuid} is not visible in this process")
            if handle.ipc_handle is not None:
                mem = cuda_ipc.open_legacy(handle.ipc_handle, device, handle.nbytes)
            elif handle.fd_socket is not None and handle.fd_token is not None:
                fd = fetch_fd(handle.fd_socket, handle.pool_id, handle.fd_token)
                mem = cuda_ipc.import_fd(fd, device, handle.nbytes)
            else:
                raise ValueError("pool handle carries neither an IPC handle nor an fd socket")
            self._open[handle.pool_id] = mem
            self.opens += 1
            return mem

    def pool_tensor(self, handle: DevicePoolHandle, size: int) -> torch.Tensor:
        """A uint8 tensor over the first ``size`` bytes of the pool (opened on first use)."""
        t = self._tensors.get(handle.pool_id)
        if t is None:
            if not 0 <= size <= handle.nbytes:
                raise ValueError(f"size: {size} outside the pool allocation ({handle.nbytes})")
            mem = self.open(handle)
            with self._lock:
                t = self._tensors.setdefault(handle.pool_id, mem.tensor(0, size))
        return t

    def ready_event(self, handle: bytes, device: torch.device) -> torch.cuda.Event:
        """The daemon's interprocess event behind ``handle``, opened once per process (a
        daemon keeps a small ring of them per pool). RuntimeError if it cannot be opened
        here (another IPC namespace, or the daemon runs in this very process)."""
        ev = self._events.get(handle)
        if ev is None:
            ev = torch.cuda.Event.from_ipc_handle(device, handle)
            with self._lock:
                ev = self._events.setdefault(handle, ev)
        return ev

    def close(self) -> None:
        """Unmap every pool. Tensors that point into them must not be used afterwards."""
        with self._lock:
            for mem in self._open.values():
                mem.close()
            self._open.clear()
            self._tensors.clear()
            self._events.clear()


_process_pools = DevicePoolCache()


def process_device_pools() -> DevicePoolCache:
    """The per-process cache: each daemon pool is opened once per process, whatever the
    number of clients."""
    return _process_pools


def resolve_device(device: str | torch.device | int) -> tuple[torch.device, str]:
    """(``cuda:N``, the GPU's uuid) for ``"cuda"``, ``"cuda:N"``, an index or a torch.device."""
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"device: not a CUDA device: {device!r}")
    if not _cuda_available():
        raise RuntimeError(f"device={device!r} but CUDA is not available in this process")
    index = torch.cuda.current_device() if dev.index is None else dev.index
    from embcache.kernels import cuda_mem

    return torch.device("cuda", index), cuda_mem.gpu_uuid(index)


# Asked on every device get and never changes in a process (with the uuid, now cached in
# cuda_mem, it cost about 45 us per get on the H200 host).
@functools.cache
def _cuda_available() -> bool:
    return torch.cuda.is_available()


def materialize(
    pool_bytes: torch.Tensor,
    *,
    page_bytes: int,
    page_ids: list[int] | tuple[int, ...],
    offset: int | None,
    nbytes: int,
    dtype: torch.dtype,
    shape: tuple[int, ...],
) -> torch.Tensor:
    """The entry as a tensor: a view of the pool when contiguous, else a gathered copy.

    A view is valid only while the lease lives; a gathered copy belongs to the caller.
    """
    if offset is not None:
        flat = pool_bytes[offset : offset + nbytes]
    else:
        flat = gather_pages(pool_bytes, page_bytes, [(page_ids, nbytes)])[0]
    return flat.view(dtype).view(shape)


def gather_pages(
    pool_bytes: torch.Tensor,
    page_bytes: int,
    entries: list[tuple[list[int] | tuple[int, ...], int]],
) -> list[torch.Tensor]:
    """Copies of several fragmented entries (page ids, nbytes) in one gather: one upload of
    the page ids and one ``index_select`` launch for the whole batch. Each entry's region
    starts on a page boundary of the shared buffer (so any dtype can view it)."""
    pages = [p for page_ids, _ in entries for p in page_ids]
    counts = [len(page_ids) for page_ids, _ in entries]
    gather = plan_gather(pool_bytes, page_bytes, pages, counts, [n for _, n in entries])
    flat = gather.run()
    return [flat[at : at + n] for at, (_, n) in zip(gather.offsets, entries, strict=True)]


@dataclass(frozen=True, slots=True)
class PageGather:
    """A planned gather of whole pages (:func:`plan_gather`): :meth:`run` launches it, or
    :meth:`abandon` drops it."""

    rows: torch.Tensor  # the pool as rows of pages (8-byte words when aligned)
    index: torch.Tensor | None  # page ids in gather order, on the pool's device; None: none
    offsets: list[int]  # each entry's byte offset in the result
    ring: Any = None  # uva_ids.UvaIds whose slot ``slot`` holds the index, if any
    slot: int = -1

    def run(self) -> torch.Tensor:
        """The gathered bytes (one flat uint8 tensor the caller owns), queued on the current
        stream."""
        if self.index is None:
            return self.rows.new_empty(0, dtype=torch.uint8)
        out = self.rows.index_select(0, self.index)
        if self.ring is not None:
            self.ring.launched(self.slot, torch.cuda.current_stream(self.rows.device))
        return out.view(torch.uint8).view(-1)

    def abandon(self) -> None:
        if self.ring is not None:
            self.ring.abandon(self.slot)


def plan_gather(
    pool_bytes: torch.Tensor,
    page_bytes: int,
    pages: list[int] | np.ndarray,
    counts: list[int],
    nbytes: list[int],
) -> PageGather:
    """Check a gather of the entries' pages, concatenated (``counts[i]`` ids for entry i,
    holding its ``nbytes[i]``), and put the ids where the GPU reads them. The pages are
    copied whole, in order, by one ``index_select`` over the pool seen as rows of pages.
    On a GPU the ids go to a pinned slot the kernel reads directly (``uva_ids.py``: no copy
    call, which cost the H200 host about 250 us while the daemon's copy ran), else they are
    uploaded. On the H200 host the gather beat a ``torch.cat`` of the page runs on the GPU
    (100-113 against 150 us for 32 runs, 64 MiB) and in host time when idle (107 against
    158 us)."""
    if page_bytes <= 0:
        raise ValueError(f"page_bytes: must be positive, got {page_bytes}")
    offsets, at = [], 0
    for count, n in zip(counts, nbytes, strict=True):
        if count * page_bytes < n:
            raise ValueError("pages: each entry needs pages that hold its bytes")
        offsets.append(at)
        at += count * page_bytes
    ids = np.asarray(pages, dtype=np.int64)
    if sum(counts) != ids.size:
        raise ValueError(f"counts: sum to {sum(counts)}, but there are {ids.size} page ids")
    num_pages = pool_bytes.numel() // page_bytes
    rows = pool_bytes[: num_pages * page_bytes].view(num_pages, page_bytes)
    if page_bytes % 8 == 0 and rows.storage_offset() % 8 == 0:
        rows = rows.view(torch.int64)  # fewer, wider elements: a faster gather
    if ids.size == 0:
        return PageGather(rows, None, offsets)
    if ids.min() < 0 or ids.max() >= num_pages:
        raise ValueError(f"pages: ids must lie in [0, {num_pages})")
    if not rows.is_cuda:
        return PageGather(rows, torch.from_numpy(ids), offsets)
    from embcache.clients.uva_ids import ring_for

    ring = ring_for(rows.device)
    got = ring.put(ids) if ring is not None else None
    if got is not None:
        return PageGather(rows, got[0], offsets, ring, got[1])
    # pinned: a copy from pageable memory would wait for the stream's work
    index = torch.from_numpy(ids).pin_memory().to(rows.device, non_blocking=True)
    return PageGather(rows, index, offsets)
