"""Pydantic models of the REST data plane: put/get headers, batch get, release, renew.

64-bit integers that are identifiers (lease ids, fd tokens) travel as decimal strings:
they do not fit a JSON number in every language. Requests accept them as strings or
integers. Binary handles (a legacy ``cudaIpcMemHandle``) are base64.
"""

from __future__ import annotations

import base64
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from embcache.service.transport import render as d
from embcache.service.transport.http.models import Count, PositiveNumber

MAX_BATCH = 10_000

DecimalId = Annotated[str, Field(pattern=r"^[0-9]{1,20}$", description="Decimal string.")]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PutResponse(_Model):
    key: str
    created: bool = Field(description="False: an identical entry existed (the put is idempotent).")
    dtype: str
    shape: list[int]
    nbytes: int


# -- batch get -----------------------------------------------------------------------------
class GetRequest(_Model):
    keys: list[str] = Field(min_length=1, max_length=MAX_BATCH)
    ttl_s: PositiveNumber | None = Field(
        default=None,
        description="Lease lifetime in seconds (default: the daemon's lease_ttl_s).",
    )
    gpu_uuid: str | None = Field(
        default=None,
        max_length=128,
        description="Make the entries resident in this GPU's device pool and answer with "
        "device locations; without it, host (shared-memory) locations.",
    )


class ByteRun(_Model):
    offset: int = Field(description="Byte offset in the pool.")
    length: int


class HostLocationModel(_Model):
    kind: Literal["host"] = "host"
    pool_id: str
    runs: list[ByteRun] = Field(description="The entry's bytes, in order, in the host pool.")


class DeviceLocationModel(_Model):
    kind: Literal["device"] = "device"
    pool_id: str
    gpu_uuid: str
    offset: int | None = Field(
        default=None, description="Byte offset when the entry is one contiguous range; else null."
    )
    page_ids: list[int] | None = Field(
        default=None, description="Physical pages of page_bytes, in order (when offset is null)."
    )


Location = Annotated[HostLocationModel | DeviceLocationModel, Field(discriminator="kind")]


class GetResult(_Model):
    key: str
    found: bool
    dtype: str | None = None
    shape: list[int] | None = None
    nbytes: int | None = None
    lease_id: DecimalId | None = Field(
        default=None, description="Release with POST /v1/release; it ends by TTL otherwise."
    )
    location: Location | None = None


class HostShmPoolModel(_Model):
    kind: Literal["host_shm"] = "host_shm"
    pool_id: str
    segment_name: str = Field(description="Map /dev/shm/<segment_name> read-only.")
    size: int
    page_bytes: int
    boot_id: str = Field(description="Kernel boot id: a different one means another machine.")
    st_dev: int = Field(description="st_dev of the segment file: compare before mapping.")
    st_ino: int = Field(description="st_ino of the segment file: compare before mapping.")


class DevicePoolModel(_Model):
    kind: Literal["device"] = "device"
    pool_id: str
    gpu_uuid: str
    size: int
    page_bytes: int
    ipc_mode: Literal["legacy", "fd", "none"] = Field(
        description="legacy: open ipc_handle; fd: fetch the fd from fd_socket with fd_token "
        "and map alloc_size bytes; none: a test pool nobody else can open."
    )
    ipc_handle: str | None = Field(default=None, description="Base64 cudaIpcMemHandle (legacy).")
    fd_token: DecimalId | None = None
    alloc_size: int | None = None
    fd_socket: str | None = None


Pool = Annotated[HostShmPoolModel | DevicePoolModel, Field(discriminator="kind")]


class GetResponse(_Model):
    results: list[GetResult]
    pools: list[Pool] = Field(description="The pools the locations name, each once.")
    ttl_s: float = Field(description="Lease lifetime granted, in seconds.")


def render_batch(batch: d.BatchDescription, ttl_s: float) -> GetResponse:
    results = []
    for key, hit in zip(batch.keys, batch.hits, strict=True):
        if hit is None:
            results.append(GetResult(key=key, found=False))
            continue
        results.append(
            GetResult(
                key=key,
                found=True,
                dtype=hit.dtype,
                shape=list(hit.shape),
                nbytes=hit.nbytes,
                lease_id=str(hit.lease_id),
                location=_location(hit.location),
            )
        )
    return GetResponse(results=results, pools=[_pool(p) for p in batch.pools], ttl_s=ttl_s)


def _location(loc: d.Location) -> HostLocationModel | DeviceLocationModel:
    if isinstance(loc, d.HostLocation):
        runs = [ByteRun(offset=off, length=n) for off, n in loc.runs]
        return HostLocationModel(pool_id=loc.pool_id, runs=runs)
    if loc.offset is not None:
        return DeviceLocationModel(pool_id=loc.pool_id, gpu_uuid=loc.gpu_uuid, offset=loc.offset)
    return DeviceLocationModel(
        pool_id=loc.pool_id, gpu_uuid=loc.gpu_uuid, page_ids=list(loc.page_ids)
    )


def _pool(pool: d.PoolDesc) -> HostShmPoolModel | DevicePoolModel:
    if isinstance(pool, d.HostShmPool):
        return HostShmPoolModel(
            pool_id=pool.pool_id,
            segment_name=pool.segment_name,
            size=pool.size,
            page_bytes=pool.page_bytes,
            boot_id=pool.boot_id,
            st_dev=pool.st_dev,
            st_ino=pool.st_ino,
        )
    return DevicePoolModel(
        pool_id=pool.pool_id,
        gpu_uuid=pool.gpu_uuid,
        size=pool.size,
        page_bytes=pool.page_bytes,
        ipc_mode=pool.ipc_mode,
        ipc_handle=base64.b64encode(pool.ipc_handle).decode() if pool.ipc_handle else None,
        fd_token=None if pool.fd_token is None else str(pool.fd_token),
        alloc_size=pool.alloc_size,
        fd_socket=pool.fd_socket,
    )


# -- leases --------------------------------------------------------------------------------
# A lease id as a request may give it: a non-negative integer, or its decimal string (19
# digits at most: every 63-bit id). Ids no lease has (past 2^63 too) are skipped.
LeaseIdIn = Count | Annotated[str, Field(pattern=r"^[0-9]{1,19}$")]


class _LeaseIds(_Model):
    lease_ids: list[LeaseIdIn] = Field(
        max_length=MAX_BATCH, description="Lease ids (decimal strings or integers)."
    )

    def ids(self) -> list[int]:
        return [int(i) for i in self.lease_ids]


class ReleaseRequest(_LeaseIds):
    pass


class ReleaseResponse(_Model):
    released: int = Field(description="Leases ended; unknown or expired ids are skipped.")


class RenewRequest(_LeaseIds):
    ttl_s: PositiveNumber | None = Field(
        default=None, description="New lifetime from now, in seconds."
    )


class RenewResponse(_Model):
    renewed: int
