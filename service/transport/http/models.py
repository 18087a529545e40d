"""Pydantic models of every REST body (requests, responses and errors)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from embcache.service.config import ByteSize

EntryStateFilter = Literal["ready", "filling", "leased"]
TierName = Literal["host", "device"]
EntrySort = Literal["none", "size", "recent", "idle"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorBody(_Model):
    """Every error response: the typed engine error, or a validation/HTTP error in its shape."""

    error: str = Field(description="Error type, e.g. NotFound, EntryLeased, ValidationError.")
    code: str = Field(description="gRPC status code name from the shared error table.")
    message: str
    details: dict[str, Any] = Field(default_factory=dict)


class _OpenModel(BaseModel):
    """Responses that mirror engine snapshots: fields the engine adds later pass through."""

    model_config = ConfigDict(extra="allow")


class PoolStatsModel(_OpenModel):
    tier: str
    capacity_bytes: int
    used_bytes: int
    free_bytes: int
    page_bytes: int
    total_pages: int
    used_pages: int
    free_pages: int
    largest_free_run_pages: int
    free_runs: int
    out_of_service: str = Field(
        default="", description="Device pools only: why a device error took it out (empty if not)."
    )


class StatsResponse(_OpenModel):
    host: PoolStatsModel
    device: list[PoolStatsModel]
    entries_ready: int
    entries_filling: int
    reserved_filling_bytes: int
    hits: int
    misses: int
    hit_rate: float
    evictions: int
    evicted_bytes: int
    puts_committed: int
    puts_aborted: int
    put_bytes: int
    leases_active: int
    leases_expired: int
    lease_owners: int
    runs_per_entry: dict[str, int]
    bytes_copied: dict[str, float]
    device_resident: list[int] = Field(
        default_factory=list, description="Entries resident on each device pool."
    )
    draining: bool
    put_landing_bytes: int = Field(
        0, description="Host pool bytes set aside for puts from a device (counted as free)."
    )
    leases_quarantined: int = Field(
        0,
        description="Leases that ended by force while their owner's process may still read "
        "the pages through views: their pages stay out of reuse until it exits or drops them.",
    )
    quarantined_bytes: int = Field(0, description="Pages those quarantined leases hold, in bytes.")


class EntrySummary(_Model):
    key: str
    state: str = Field(description="ready or filling (leased entries are ready with leases > 0).")
    dtype: str
    shape: list[int]
    nbytes: int
    num_pages: int
    num_runs: int = Field(description="Page runs the entry occupies (1 = contiguous).")
    leases: int = Field(description="Live leases on the entry.")
    idle_s: float = Field(description="Seconds since the entry was last written or read.")
    residency: list[str] = Field(description="Tiers holding a copy: host, device...")


class PageRun(_Model):
    first_page: int
    num_pages: int
    byte_offset: int
    byte_length: int


class LeaseHolder(_Model):
    owner: str = Field(description="Who holds the lease: a gRPC session, a REST client...")
    expires_in_s: float


class EntryDetail(EntrySummary):
    page_runs: list[PageRun]
    lease_holders: list[LeaseHolder] = Field(
        description="Owner and time left of each live lease (lease ids are not shown)."
    )


class EntryPage(_Model):
    total: int = Field(description="Entries matching the filters, over all pages.")
    offset: int
    limit: int
    items: list[EntrySummary]


class EvictRequest(_Model):
    """Either ``keys`` to evict (leased ones are refused, never forced) or ``bytes`` to free.
    With ``device``, only copies in that device pool go; host copies stay."""

    keys: list[str] | None = Field(None, max_length=10_000)
    bytes: ByteSize | None = Field(
        None, description="Free at least this many bytes by LRU eviction (e.g. 1048576 or '1MiB')."
    )
    device: int | None = Field(
        default=None,
        ge=0,
        description="Device pool index: evict its copies only (host copies stay).",
    )

    @model_validator(mode="after")
    def _one_of(self) -> EvictRequest:
        if (self.keys is None) == (self.bytes is None):
            raise ValueError("give exactly one of 'keys' or 'bytes'")
        return self


class EvictResponse(_Model):
    evicted: list[str] = Field(description="Keys evicted (empty for a by-bytes eviction).")
    not_found: list[str]
    leased: list[str] = Field(description="Keys refused because they are leased.")
    freed_entries: int
    freed_bytes: int


class DeleteResponse(_Model):
    key: str
    evicted: bool
    freed_bytes: int


class Liveness(_Model):
    status: Literal["ok"]


class Readiness(_Model):
    status: Literal["ready", "not_ready"]
    pool_allocated: bool
    cuda_ready: bool | None = Field(description="None on a machine without CUDA.")
    draining: bool
    devices_out_of_service: list[int] = Field(
        default_factory=list,
        description="Device pools a device error took out; the others keep serving.",
    )


class PoolMapTier(_Model):
    tier: TierName
    index: int | None = Field(default=None, description="Device pools: which one this map draws.")
    pools: int | None = Field(default=None, description="Device pools: how many the daemon has.")
    out_of_service: str = Field(
        default="", description="Device pools: why a device error took it out."
    )
    states: list[str] = Field(description="State names; a digit in 'cells' indexes this list.")
    num_pages: int
    page_bytes: int
    pages_per_cell: int
    cells: str = Field(description="One digit per cell: the state drawn for that group of pages.")
    counts: dict[str, int] = Field(description="Pages per state over the whole pool.")


class PoolMapSummary(_Model):
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


class PoolMapHistory(_Model):
    interval_s: float
    window_s: float
    t: list[float] = Field(description="Unix time at the end of each interval.")
    hit_rate: list[float | None] = Field(description="Per interval; null when nothing was read.")
    bandwidth: dict[str, list[float]] = Field(description="Bytes per second per copy direction.")


class PoolMapResponse(_Model):
    time: float
    ready: bool
    draining: bool
    summary: PoolMapSummary
    host: PoolMapTier
    device: PoolMapTier | None
    history: PoolMapHistory
