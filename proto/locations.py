"""Where leased bytes are, and how to open the pools that hold them.

The daemon answers a get with these descriptions; each transport renders them in its own
encoding (protobuf over gRPC, JSON over REST), and the client reads them back. A pool
description is a capability: whoever holds a device pool's IPC handle or fd token can map
that pool, so transports hand them only to callers that passed their auth check.

Each record here is declared once: the REST models derive from its fields (with the
descriptions in their metadata) and the gRPC replies fill their messages from it by
field name (``records.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from embcache.proto.records import doc


# -- pools ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class HostShmPool:
    """The host pool: a POSIX shared-memory segment a same-node client maps read-only.

    ``boot_id``, ``st_dev`` and ``st_ino`` identify the segment, so a client in another
    machine or ``/dev/shm`` namespace never maps a different segment of the same name."""

    pool_id: str
    segment_name: str = field(metadata=doc("Map /dev/shm/<segment_name> read-only."))
    size: int
    page_bytes: int
    boot_id: str = field(metadata=doc("Kernel boot id: a different one means another machine."))
    st_dev: int = field(metadata=doc("st_dev of the segment file: compare before mapping."))
    st_ino: int = field(metadata=doc("st_ino of the segment file: compare before mapping."))


@dataclass(frozen=True, slots=True)
class DevicePoolDesc:
    """A device pool in HBM and how to open it.

    ``ipc_mode``: ``legacy`` (``ipc_handle`` holds a ``cudaIpcMemHandle``), ``fd`` (ask
    ``fd_socket`` for the fd with ``fd_token``; map ``alloc_size`` bytes) or ``none`` (a CPU
    test pool that no other process can open)."""

    pool_id: str
    gpu_uuid: str
    size: int
    page_bytes: int
    ipc_mode: Literal["legacy", "fd", "none"] = field(
        metadata=doc(
            "legacy: open ipc_handle; fd: fetch the fd from fd_socket with fd_token and map "
            "alloc_size bytes; none: a test pool nobody else can open."
        )
    )
    ipc_handle: bytes | None = None
    fd_token: int | None = None
    alloc_size: int | None = None
    fd_socket: str | None = None


PoolDesc = HostShmPool | DevicePoolDesc


# -- locations -----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class HostLocation:
    """Byte runs ``(offset, length)`` of the entry in the host pool, in order."""

    pool_id: str
    runs: tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class DeviceLocation:
    """The entry in a device pool: one byte ``offset``, or physical ``page_ids`` in order."""

    pool_id: str
    gpu_uuid: str
    offset: int | None
    page_ids: tuple[int, ...]


Location = HostLocation | DeviceLocation


@dataclass(frozen=True, slots=True)
class Hit:
    """One found key: its metadata, the lease that keeps it in place, and where it is."""

    key: str
    lease_id: int
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    location: Location


@dataclass(frozen=True, slots=True)
class BatchDescription:
    """A batch get: per key a :class:`Hit` or ``None`` (a miss), and the pools the hits
    name (each once), for clients that have not opened them yet."""

    keys: tuple[str, ...]
    hits: tuple[Hit | None, ...]
    pools: tuple[PoolDesc, ...]

    @property
    def lease_ids(self) -> list[int]:
        return [h.lease_id for h in self.hits if h is not None]


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""
