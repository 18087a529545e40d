"""Pydantic models of the REST data plane: put/get headers, batch get, release, renew.

64-bit integers that are identifiers (lease ids, fd tokens) travel as decimal strings:
they do not fit a JSON number in every language. Requests accept them as strings or
integers. Binary handles (a legacy ``cudaIpcMemHandle``) are base64.
"""

from __future__ import annotations

import base64
from typing import Annotated, Literal

from pydantic import Field

from embcache.proto import locations as d
from embcache.service.transport.http.models import Count, PositiveNumber
from embcache.service.transport.http.records import ClosedModel, derived, values_of

MAX_BATCH = 10_000

DecimalId = Annotated[str, Field(pattern=r"^[0-9]{1,20}$", description="Decimal string.")]


class PutResponse(ClosedModel):
    key: str
    created: bool = Field(description="False: an identical entry existed (the put is idempotent).")
    dtype: str
    shape: list[int]
    nbytes: int


# -- batch get -----------------------------------------------------------------------------
class GetRequest(ClosedModel):
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


class ByteRun(ClosedModel):
    offset: int = Field(description="Byte offset in the pool.")
    length: int


@derived(d.HostLocation)
class HostLocationModel(ClosedModel):
    kind: Literal["host"] = "host"
    runs: list[ByteRun] = Field(description="The entry's bytes, in order, in the host pool.")


@derived(d.DeviceLocation)
class DeviceLocationModel(ClosedModel):
    kind: Literal["device"] = "device"
    offset: int | None = Field(
        default=None, description="Byte offset when the entry is one contiguous range; else null."
    )
    page_ids: list[int] | None = Field(
        default=None, description="Physical pages of page_bytes, in order (when offset is null)."
    )


Location = Annotated[HostLocationModel | DeviceLocationModel, Field(discriminator="kind")]


class GetResult(ClosedModel):
    key: str
    found: bool
    dtype: str | None = None
    shape: list[int] | None = None
    nbytes: int | None = None
    lease_id: DecimalId | None = Field(
        default=None, description="Release with POST /v1/release; it ends by TTL otherwise."
    )
    location: Location | None = None


@derived(d.HostShmPool)
class HostShmPoolModel(ClosedModel):
    kind: Literal["host_shm"] = "host_shm"


@derived(d.DevicePoolDesc)
class DevicePoolModel(ClosedModel):
    kind: Literal["device"] = "device"
    ipc_handle: str | None = Field(default=None, description="Base64 cudaIpcMemHandle (legacy).")
    fd_token: DecimalId | None = None


Pool = Annotated[HostShmPoolModel | DevicePoolModel, Field(discriminator="kind")]


class GetResponse(ClosedModel):
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
        return HostLocationModel(**values_of(loc, runs=runs))
    if loc.offset is not None:
        return DeviceLocationModel(**values_of(loc, page_ids=None))
    return DeviceLocationModel(**values_of(loc, offset=None, page_ids=list(loc.page_ids)))


def _pool(pool: d.PoolDesc) -> HostShmPoolModel | DevicePoolModel:
    if isinstance(pool, d.HostShmPool):
        return HostShmPoolModel(**values_of(pool))
    handle = base64.b64encode(pool.ipc_handle).decode() if pool.ipc_handle else None
    token = None if pool.fd_token is None else str(pool.fd_token)
    return DevicePoolModel(**values_of(pool, ipc_handle=handle, fd_token=token))


# -- leases --------------------------------------------------------------------------------
# A lease id as a request may give it: a non-negative integer, or its decimal string (19
# digits at most: every 63-bit id). Ids no lease has (past 2^63 too) are skipped.
LeaseIdIn = Count | Annotated[str, Field(pattern=r"^[0-9]{1,19}$")]


class _LeaseIds(ClosedModel):
    lease_ids: list[LeaseIdIn] = Field(
        max_length=MAX_BATCH, description="Lease ids (decimal strings or integers)."
    )

    def ids(self) -> list[int]:
        return [int(i) for i in self.lease_ids]


class ReleaseRequest(_LeaseIds):
    pass


class ReleaseResponse(ClosedModel):
    released: int = Field(description="Leases ended; unknown or expired ids are skipped.")


class RenewRequest(_LeaseIds):
    ttl_s: PositiveNumber | None = Field(
        default=None, description="New lifetime from now, in seconds."
    )


class RenewResponse(ClosedModel):
    renewed: int
