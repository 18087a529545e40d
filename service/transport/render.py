"""Engine results rendered as transport-neutral locations (``embcache.proto.locations``).

One place turns engine results (``Lease``, ``DeviceLease``) into the plain dataclasses that a
transport then encodes its own way: JSON over REST, protobuf over gRPC. Nothing here imports
grpc, fastapi or protobuf.

Pool ids come from the engine (the host pool's is fresh for every daemon start, so a client
that cached the previous daemon's segment maps the new one), so every transport hands out
the same ids: a client that opened a pool through one recognises it in replies from another.

Descriptions of IPC handles (a legacy ``cudaIpcMemHandle``, or the fd socket plus the pool's
secret token) are capabilities: transports hand them only to callers that passed their auth
check.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from embcache.proto.locations import (
    BatchDescription,
    DeviceLocation,
    DevicePoolDesc,
    Hit,
    HostLocation,
    HostShmPool,
    Location,
    PoolDesc,
    boot_id,
)
from embcache.service.config import Settings
from embcache.service.device.pending_get import DeviceLease
from embcache.service.device.pool import DevicePool
from embcache.service.engine import CacheEngine
from embcache.service.host.leases import Lease


def host_location(lease: Lease, pool_id: str) -> HostLocation:
    """Where a leased entry's bytes are in the host pool ``pool_id``."""
    return HostLocation(pool_id, tuple(lease.byte_runs))


def device_location(found: DeviceLease) -> DeviceLocation:
    """Where a leased entry is in a device pool: a byte offset, or its page ids."""
    if found.offset is not None:
        return DeviceLocation(found.pool_id, found.gpu_uuid, found.offset, ())
    return DeviceLocation(found.pool_id, found.gpu_uuid, None, tuple(found.page_ids))


def _hit(key: str, lease: Lease, location: Location) -> Hit:
    return Hit(key, lease.lease_id, lease.dtype, tuple(lease.shape), lease.nbytes, location)


class LocationRenderer:
    """Renders one engine's results; pool descriptions are built once and cached."""

    def __init__(self, engine: CacheEngine, settings: Settings) -> None:
        self.engine = engine
        self.settings = settings
        self._lock = threading.Lock()
        self._host: HostShmPool | None = None
        self._devices: dict[str, DevicePoolDesc] = {}

    # -- pools ---------------------------------------------------------------------------
    def host_pool(self) -> HostShmPool:
        """How a client maps the host pool, with the segment's identity (boot id, inode)."""
        if self._host is None:
            pool = self.engine.host_segment()
            st = os.stat(pool.path)
            self._host = HostShmPool(
                pool_id=pool.pool_id,
                segment_name=pool.name,
                size=pool.nbytes,
                page_bytes=pool.page_bytes,
                boot_id=boot_id(),
                st_dev=st.st_dev,
                st_ino=st.st_ino,
            )
        return self._host

    def device_pool(self, pool: DevicePool) -> DevicePoolDesc:
        """How a client opens ``pool`` (the legacy export runs once per pool)."""
        with self._lock:
            desc = self._devices.get(pool.pool_id)
            if desc is None:
                desc = self._describe_device(pool)
                self._devices[pool.pool_id] = desc
            return desc

    def _describe_device(self, pool: DevicePool) -> DevicePoolDesc:
        common: dict[str, Any] = {
            "pool_id": pool.pool_id,
            "gpu_uuid": pool.gpu_uuid,
            "size": pool.nbytes,
            "page_bytes": pool.page_bytes,
        }
        if pool.ipc_mode == "legacy":
            import torch

            with torch.cuda.device(pool.device):
                handle = pool.export_legacy()
            return DevicePoolDesc(**common, ipc_mode="legacy", ipc_handle=bytes(handle))
        if pool.ipc_mode == "fd":
            return DevicePoolDesc(
                **common,
                ipc_mode="fd",
                fd_token=pool.fd_token,
                alloc_size=int(getattr(pool.slab, "nbytes", pool.nbytes)),
                fd_socket=str(self.settings.effective_ipc_socket),
            )
        return DevicePoolDesc(**common, ipc_mode="none")

    # -- batches -------------------------------------------------------------------------
    def host_batch(self, keys: Sequence[str], leases: Sequence[Lease | None]) -> BatchDescription:
        """Describe the result of ``engine.get``: host byte runs, and the host pool."""
        pool = self.host_pool()
        hits = tuple(
            None if lease is None else _hit(key, lease, host_location(lease, pool.pool_id))
            for key, lease in zip(keys, leases, strict=True)
        )
        pools: tuple[PoolDesc, ...] = (pool,) if any(hits) else ()
        return BatchDescription(tuple(keys), hits, pools)

    def device_batch(
        self, keys: Sequence[str], found: Sequence[DeviceLease | None], pool: DevicePool
    ) -> BatchDescription:
        """Describe the result of a get to device ``pool``."""
        hits = tuple(
            None if dl is None else _hit(key, dl.lease, device_location(dl))
            for key, dl in zip(keys, found, strict=True)
        )
        pools: tuple[PoolDesc, ...] = (self.device_pool(pool),) if any(hits) else ()
        return BatchDescription(tuple(keys), hits, pools)

    # -- whole gets (the lease-taking half shared by transports) -------------------------
    def get_host(
        self, keys: Sequence[str], owner: str, *, ttl_s: float | None = None
    ) -> BatchDescription:
        """Lease ``keys`` in the host pool and describe them; nothing leaks on failure."""
        leases = self.engine.get(list(keys), owner, ttl_s=ttl_s)
        with _released_on_error(self.engine, [x.lease_id for x in leases if x is not None]):
            return self.host_batch(keys, leases)


@contextlib.contextmanager
def _released_on_error(engine: CacheEngine, lease_ids: list[int]) -> Iterator[None]:
    try:
        yield
    except BaseException:
        engine.release(lease_ids)
        raise
