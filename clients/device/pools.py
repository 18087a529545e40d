"""Device pools of the daemon, opened in this process once each and cached by pool id.

Opening a pool maps its memory over CUDA IPC (a legacy handle from the Get reply, or a file
descriptor fetched from the daemon's fd socket), which costs far more than a lookup, so each
pool is opened once per process. A mapping lives as long as the process (tensors point into
it); a daemon that restarts announces new pool ids, which are opened afresh.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


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


# Asked on every device get and never changes in a process: cached (docs/grpc.md).
@functools.cache
def _cuda_available() -> bool:
    return torch.cuda.is_available()


def uuid_of(device: str | torch.device | int | None) -> str | None:
    """The uuid of ``device``'s GPU (:func:`resolve_device`), or None for no device: what a
    request names to act on that GPU's copies only."""
    return None if device is None else resolve_device(device)[1]
