"""Pydantic models of every REST body (requests, responses and errors)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from embcache.service.sizes import parse_size

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


class ReadTableModel(_Model):
    """The read table same-node clients copy small entries from without a call."""

    entries: int = Field(default=0, description="READY entries readable from the table.")
    skipped: int = Field(
        default=0, description="Entries left out of it (bucket full, too many runs or dims)."
    )
    reads: int = Field(default=0, description="Hits clients served from it, as they reported.")
    device_published: int = Field(
        default=0,
        description="Device-resident copies offered in it (clients copy them device to device).",
    )
    device_withdrawn: int = Field(
        default=0, description="Device copies taken out of it (evicted from their pool, ...)."
    )
    device_skipped: int = Field(
        default=0,
        description="Device copies not offered (too many runs, or more pools than a slot names).",
    )


class RestartModel(_Model):
    """A warm restart's figures: all zero after a cold start."""

    adopted_entries: int = Field(
        default=0, description="READY entries adopted from the old segment."
    )
    adopted_bytes: int = Field(default=0, description="Their bytes.")
    unverified_entries: int = Field(
        default=0, description="Adopted entries not yet checked against their CRC32 (checked first "
        "when read, and by a background pass).",
    )  # fmt: skip
    dropped_checksum_entries: int = Field(
        default=0, description="Adopted entries dropped because their bytes failed their CRC32."
    )
    dropped_checksum_bytes: int = Field(default=0, description="Their bytes.")
    dropped_layout_entries: int = Field(
        default=0, description="Entries of an old segment replaced because its layout differed."
    )
    dropped_layout_bytes: int = Field(default=0, description="Their bytes.")
    dropped_invalid_entries: int = Field(
        default=0, description="Index records dropped because their page runs were not valid."
    )
    dropped_refused_entries: int = Field(
        default=0, description="Index records dropped because a put would refuse them (key, "
        "dtype, shape or size), or because they did not decode.",
    )  # fmt: skip
    untrusted_index: int = Field(
        default=0, description="1 when a file at the index's names was refused (another uid "
        "owns it, others may write it, or it is a symlink): not read, written or replaced; the "
        "start was cold, and no index is kept while another user's file holds the name.",
    )  # fmt: skip
    write_holds: int = Field(
        default=0, description="Reservations of the old daemon that a client process still "
        "running may be writing: their pages stay out of reuse until it exits.",
    )  # fmt: skip
    layout_replaced: int = Field(default=0, description="1 when an old segment was replaced.")


class StatsResponse(_OpenModel):
    version: str = Field(description="The daemon's version.")
    commit: str = Field(description="The git commit it was built from ('unknown' if not known).")
    grpc_port: int | None = Field(default=None, description="The daemon's gRPC TCP port.")
    grpc_socket: str | None = Field(default=None, description="Its gRPC Unix socket, if any.")
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
    metadata_bytes: int = Field(
        0, description="Estimated memory of the READY entries' metadata (key, shape, tables)."
    )
    max_entries: int = Field(0, description="Most entries kept; past it LRU ones are evicted.")
    leases_quarantined: int = Field(
        0,
        description="Leases that ended by force while their owner's process may still read "
        "the pages through views: their pages stay out of reuse until it exits or drops them.",
    )
    quarantined_bytes: int = Field(
        0,
        description="Pages those quarantined leases hold, and reserved pages a live client "
        "may still be writing (held until it is done or exits), in bytes.",
    )
    restart: RestartModel = Field(
        default_factory=lambda: RestartModel(),
        description="What this daemon adopted at a warm restart (docs/restart.md).",
    )
    read_table: ReadTableModel = Field(
        default_factory=lambda: ReadTableModel(),
        description="Same-node clients' reads without a call (docs/same_node_reads.md).",
    )


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


class _Evict(_Model):
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


class EvictResponse(_Model):
    evicted: list[str] = Field(description="Keys evicted (empty for a by-bytes eviction).")
    not_found: list[str]
    leased: list[str] = Field(description="Keys refused because they are leased.")
    freed_entries: int
    freed_bytes: int = Field(description=FREED_BYTES)


class DeleteResponse(_Model):
    key: str
    evicted: bool
    freed_bytes: int = Field(description=FREED_BYTES)


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
    adopted_entries: int = 0
    dropped_checksum_entries: int = 0
    dropped_layout_entries: int = 0


class PoolMapHistory(_Model):
    interval_s: float
    window_s: float
    t: list[float] = Field(description="Unix time at the end of each interval.")
    hit_rate: list[float | None] = Field(description="Per interval; null when nothing was read.")
    bandwidth: dict[str, list[float]] = Field(description="Bytes per second per copy direction.")
    host_in: list[float] = Field(description="Bytes per second stored by puts.")
    host_out: list[float] = Field(description="Bytes per second of entries handed out by hits.")
    ops: list[float] = Field(
        description="Data operations (puts, gets, reads, releases, ...) per second."
    )
    p50_s: list[float | None] = Field(
        description="Median latency of those operations, seconds (null: none finished)."
    )
    p99_s: list[float | None] = Field(description="99th percentile latency, seconds.")


class PoolMapResponse(_Model):
    version: str
    commit: str
    time: float
    ready: bool
    draining: bool
    summary: PoolMapSummary
    host: PoolMapTier
    device: PoolMapTier | None
    history: PoolMapHistory
