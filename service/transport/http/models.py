"""Pydantic models of every REST body (requests, responses and errors).

The responses that mirror an engine record (stats, pools, entries) derive their fields from
its dataclass (``records.py``) and declare here only what REST writes differently."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field

from embcache.service.engine.stats import EngineStats, EntryInfo, ReadTableCounts, RestartCounts
from embcache.service.host.stats import PoolStats
from embcache.service.sizes import parse_size
from embcache.service.transport.http.poolmap import DownsampledPool, Series
from embcache.service.transport.http.records import ClosedModel, OpenModel, derived

EntryStateFilter = Literal["ready", "filling", "leased"]
TierName = Literal["host", "device"]
EntrySort = Literal["none", "size", "recent", "idle"]


class ErrorBody(ClosedModel):
    """Every error response: the typed engine error, or a validation/HTTP error in its shape."""

    error: str = Field(description="Error type, e.g. NotFound, EntryLeased, ValidationError.")
    code: str = Field(description="gRPC status code name from the shared error table.")
    message: str
    details: dict[str, Any] = Field(default_factory=dict)


@derived(PoolStats)
class PoolStatsModel(OpenModel):
    """One pool's sizes and fragmentation (tier: host, or device:<index>)."""


@derived(ReadTableCounts)
class ReadTableModel(ClosedModel):
    """The read table same-node clients copy small entries from without a call."""


@derived(RestartCounts)
class RestartModel(ClosedModel):
    """A warm restart's figures: all zero after a cold start."""


@derived(
    EngineStats,
    host=PoolStatsModel,
    device=list[PoolStatsModel],
    bytes_copied=dict[str, float],
    restart=RestartModel,
    read_table=ReadTableModel,
)
class StatsResponse(OpenModel):
    """The engine's counts, the daemon's build, and where its gRPC server listens."""

    version: str = Field(description="The daemon's version.")
    commit: str = Field(description="The git commit it was built from ('unknown' if not known).")
    grpc_port: int | None = Field(default=None, description="The daemon's gRPC TCP port.")
    grpc_socket: str | None = Field(default=None, description="Its gRPC Unix socket, if any.")
    hit_rate: float


@derived(EntryInfo, exclude=("page_runs", "lease_holders"))
class EntrySummary(ClosedModel):
    num_pages: int
    num_runs: int = Field(description="Page runs the entry occupies (1 = contiguous).")


class PageRun(ClosedModel):
    first_page: int
    num_pages: int
    byte_offset: int
    byte_length: int


class LeaseHolder(ClosedModel):
    owner: str = Field(description="Who holds the lease: a gRPC session, a REST client...")
    expires_in_s: float


class EntryDetail(EntrySummary):
    page_runs: list[PageRun]
    lease_holders: list[LeaseHolder] = Field(
        description="Owner and time left of each live lease (lease ids are not shown)."
    )


class EntryPage(ClosedModel):
    total: int = Field(description="Entries matching the filters, over all pages.")
    offset: int
    limit: int
    items: list[EntrySummary]


FREED_BYTES = (
    "Pool memory made free, in bytes: whole pages of the host pool (of device pool 'device' "
    "when given), whether keys or bytes were evicted; an entry's own nbytes may be less."
)


def _json_number(value: Any) -> Any:
    """A JSON number: never a boolean (which pydantic would read as 0 or 1) or a string."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError("must be a number")
    return value


def _whole_number(value: Any) -> Any:
    """A JSON integer: ints, and numbers like ``1320.0`` (JSON Schema counts them as
    integers); never booleans, strings or fractions."""
    if isinstance(_json_number(value), float):
        if not value.is_integer():
            raise ValueError("must be a whole number")
        return int(value)
    return value


# A non-negative JSON integer (see _whole_number).
Count = Annotated[int, Field(ge=0), BeforeValidator(_whole_number)]


# A positive JSON number, as the schema's "number" type says (see _json_number).
PositiveNumber = Annotated[float, Field(gt=0), BeforeValidator(_json_number)]
# A size as JSON text: whole bytes with an optional unit (k, KB, KiB, M, MB, MiB, G, ...).
SIZE_TEXT = r"^[0-9]{1,15}([KkMmGgTt]([Bb]|[Ii][Bb])?|[Bb])?$"


class _Evict(ClosedModel):
    device: Count | None = Field(
        default=None,
        ge=0,
        description="Device pool index: evict its copies only (host copies stay).",
    )


class EvictKeys(_Evict):
    """Evict these keys; leased ones are refused, never forced."""

    keys: list[str] = Field(max_length=10_000)


class EvictBytes(_Evict):
    """Free at least ``bytes`` of pool pages by LRU eviction."""

    bytes: Count | Annotated[str, Field(pattern=SIZE_TEXT)] = Field(
        description="A number of bytes, or a size with a unit: 1048576, '1MiB', '4GiB'."
    )

    def nbytes(self) -> int:
        return parse_size(self.bytes)


# Exactly one of the two shapes: a body with both, or with neither, fits none (422).
EvictRequest = EvictKeys | EvictBytes


class EvictResponse(ClosedModel):
    evicted: list[str] = Field(description="Keys evicted (empty for a by-bytes eviction).")
    not_found: list[str]
    leased: list[str] = Field(description="Keys refused because they are leased.")
    freed_entries: int
    freed_bytes: int = Field(description=FREED_BYTES)


class DeleteResponse(ClosedModel):
    key: str
    evicted: bool
    freed_bytes: int = Field(description=FREED_BYTES)


class Liveness(ClosedModel):
    status: Literal["ok"]


class Readiness(ClosedModel):
    status: Literal["ready", "not_ready"]
    pool_allocated: bool
    cuda_ready: bool | None = Field(description="None on a machine without CUDA.")
    draining: bool
    devices_out_of_service: list[int] = Field(
        default_factory=list,
        description="Device pools a device error took out; the others keep serving.",
    )


@derived(DownsampledPool)
class PoolMapTier(ClosedModel):
    tier: TierName
    index: int | None = Field(default=None, description="Device pools: which one this map draws.")
    pools: int | None = Field(default=None, description="Device pools: how many the daemon has.")
    out_of_service: str = Field(
        default="", description="Device pools: why a device error took it out."
    )
    states: list[str] = Field(description="State names; a digit in 'cells' indexes this list.")
    page_bytes: int


class PoolMapSummary(ClosedModel):
    host_used_bytes: int
    host_capacity_bytes: int
    device_used_bytes: int
    device_capacity_bytes: int
    entries: int
    filling: int
    leases_active: int
    hits: int
    misses: int
    evictions: int
    adopted_entries: int = 0
    dropped_checksum_entries: int = 0
    dropped_layout_entries: int = 0


@derived(Series)
class PoolMapHistory(ClosedModel):
    interval_s: float
    window_s: float


class PoolMapResponse(ClosedModel):
    version: str
    commit: str
    time: float
    ready: bool
    draining: bool
    summary: PoolMapSummary
    host: PoolMapTier
    device: PoolMapTier | None
    history: PoolMapHistory
