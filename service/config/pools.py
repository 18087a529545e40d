"""The pool settings: sizes of the host and device pools, their pages, and how they are shared.

A group of fields that ``Settings`` is assembled from, kept beside the checks that need only
these fields (page sizes, segment names and modes, the GPU list).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, field_validator

from embcache.service.config.forms import SHM_NAME, ByteSize


class PoolSettings(BaseModel):
    """The host and device pools, their shared-memory segment and the sockets that hand them
    out (part of ``Settings``; every field is ``EMBCACHE_<FIELD>`` or ``--<field>``)."""

    host_pool_bytes: ByteSize = Field(
        1024**3, description="Size of the host page pool (shared memory; pinned on CUDA machines)."
    )
    page_bytes: ByteSize = Field(256 * 1024, description="Host page size in bytes.")
    max_entry_bytes: ByteSize = Field(
        256 * 1024**2, description="Largest entry accepted; larger puts fail before reserving."
    )
    device_pool_bytes: ByteSize = Field(
        0, description="Device (HBM) pool size per GPU; 0 disables the device tier."
    )
    device_page_bytes: ByteSize = Field(256 * 1024, description="Device page size in bytes.")
    device_put_prealloc_bytes: ByteSize = Field(
        64 * 1024**2,
        description="Host memory set aside for puts from a device (at most 1/16 of the host "
        "pool): such a put takes its pages from it and queues its copy before it is checked "
        "and recorded (0: off). Counted as free; taken back whenever room is short.",
    )
    device_free_reserve: float = Field(
        1 / 16,
        ge=0,
        le=0.5,
        description="Share of each device pool kept free: after a Get, least recently used "
        "unleased copies are evicted until this much is free, so a cold Get of up to that "
        "size takes its pages without evicting on its path (0: evict only on demand).",
    )
    device_table_flush_s: float = Field(
        0.025,
        ge=0,
        le=1.0,
        description="Longest a device pool's page-table updates wait to be launched together "
        "(0: after every Get). Copies never read the tables and a reader flushes first; "
        "fewer launches take fewer GPU time slices from decoders in other processes.",
    )
    shm_name: str = Field(
        "",
        description="Name of the POSIX shared-memory segment of the host pool (empty: "
        "'embcache-<port>-<random>', created exclusively; the ready line names it).",
    )
    warm_restart: bool = Field(
        True,
        description="on: a restarted daemon adopts the READY entries its predecessor left in "
        "the segment --shm-name names (or the newest stale 'embcache-<port>-*' one), if its "
        "index has this layout, page size and pool size, and SIGTERM leaves the segment and "
        "its index in place; off: every start is cold and SIGTERM removes the segment "
        "(docs/restart.md).",
    )
    gpus: str = Field(
        "all",
        description="GPUs that get a device pool: 'all' visible ones, or indices like '0,2'.",
    )
    ipc_mode: Literal["fd", "legacy"] = Field(
        "fd",
        description="How device pools are shared: 'fd' (VMM, POSIX fd over a Unix socket; "
        "containers share only the socket directory) or 'legacy' (cudaIpcMemHandle; "
        "containers must share IPC and PID namespaces).",
    )
    ipc_socket: Path | None = Field(
        None,
        description="Unix socket that hands device-pool file descriptors to clients "
        "(empty: '<grpc_socket>.fds', or /tmp/embcache-<port>.fds).",
    )
    shm_mode: str = Field(
        "0600",
        description="Permissions (octal) of the host pool's shared-memory segment; e.g. 0640 "
        "lets the segment's group map it read-only for zero-copy gets.",
    )
    socket_mode: str = Field(
        "0660", description="Permissions (octal) of the gRPC and fd Unix sockets."
    )
    read_table: bool = Field(
        True,
        description="Publish READY entries in a read-only table beside the segment, so "
        "clients on the node that map the pool copy small entries out of it with no call "
        "(docs/same_node_reads.md); off: every get is a call.",
    )

    @field_validator("page_bytes", "device_page_bytes")
    @classmethod
    def _page_size(cls, v: int) -> int:
        if v < 4096 or v & (v - 1):
            raise ValueError("must be a power of two of at least 4096 bytes")
        return v

    @field_validator("shm_name")
    @classmethod
    def _shm_name(cls, v: str) -> str:
        if v and not SHM_NAME.match(v):
            raise ValueError("use 1-200 letters, digits, '.', '_' or '-'")
        if v.endswith((".index", ".tmp")):
            raise ValueError("names ending in .index or .tmp are the warm-restart index's")
        return v

    @field_validator("gpus")
    @classmethod
    def _gpu_list(cls, v: str) -> str:
        if v.strip() == "all":
            return "all"
        try:
            ids = [int(x) for x in v.split(",") if x.strip()]
        except ValueError:
            raise ValueError("must be 'all' or comma-separated GPU indices like 0,1") from None
        if not ids or min(ids) < 0 or len(set(ids)) != len(ids):
            raise ValueError("must list distinct, non-negative GPU indices")
        return ",".join(str(i) for i in ids)

    def gpu_indices(self, visible: int) -> list[int]:
        """The GPUs to serve, given how many are visible."""
        if self.gpus == "all":
            return list(range(visible))
        ids = [int(x) for x in self.gpus.split(",")]
        if max(ids) >= visible:
            raise ValueError(f"gpus={self.gpus} but only {visible} GPUs are visible")
        return ids

    @field_validator("shm_mode", "socket_mode")
    @classmethod
    def _octal_mode(cls, v: str) -> str:
        try:
            mode = int(v, 8)
        except ValueError:
            raise ValueError("must be an octal permission like 0660") from None
        if not 0 <= mode <= 0o777 or mode & 0o111:
            raise ValueError("must be a permission without execute bits, at most 0666")
        return v

    @field_validator("shm_mode")
    @classmethod
    def _owner_writes(cls, v: str) -> str:
        # Clients map the pool read-only; a segment others may write is a cache anyone
        # on the node can corrupt under every reader.
        if int(v, 8) & 0o022:
            raise ValueError("must not let group or others write the segment (e.g. 0600, 0640)")
        return v

    @field_validator("host_pool_bytes")
    @classmethod
    def _pool_size(cls, v: int) -> int:
        if v <= 0:
            raise ValueError("must be positive")
        return v
