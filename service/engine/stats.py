"""The engine's snapshots for transports and operators (plain data, JSON-ready), and how
they are put together from the host store's counts and the device tier's pools.

These dataclasses are the records' one declaration: the REST models derive from their
fields, descriptions included (``proto/records.py``), and gRPC's Stats sends ``to_dict()``."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from embcache.proto.records import counter, doc
from embcache.service.device.tier import DeviceTier
from embcache.service.host.entries import Entry
from embcache.service.host.stats import PoolStats
from embcache.service.host.store import HostCounts


@dataclass(frozen=True, slots=True)
class ReadTableCounts:
    """The read table same-node clients copy small entries from without a call."""

    entries: int = counter("READY entries readable from the table.")
    skipped: int = counter("Entries left out of it (bucket full, too many runs or dims).")
    reads: int = counter("Hits clients served from it, as they reported.")
    device_published: int = counter(
        "Device-resident copies offered in it (clients copy them device to device)."
    )
    device_withdrawn: int = counter("Device copies taken out of it (evicted from their pool, ...).")
    device_skipped: int = counter(
        "Device copies not offered (too many runs, or more pools than a slot names)."
    )


@dataclass(frozen=True, slots=True)
class RestartCounts:
    """A warm restart's figures: all zero after a cold start."""

    adopted_entries: int = counter("READY entries adopted from the old segment.")
    adopted_bytes: int = counter("Their bytes.")
    unverified_entries: int = counter(
        "Adopted entries not yet checked against their CRC32 (checked "
        "first when read, and by a background pass)."
    )
    dropped_checksum_entries: int = counter(
        "Adopted entries dropped because their bytes failed their CRC32."
    )
    dropped_checksum_bytes: int = counter("Their bytes.")
    dropped_layout_entries: int = counter(
        "Entries of an old segment replaced because its layout differed."
    )
    dropped_layout_bytes: int = counter("Their bytes.")
    dropped_invalid_entries: int = counter(
        "Index records dropped because their page runs were not valid."
    )
    dropped_refused_entries: int = counter(
        "Index records dropped because a put would refuse them (key, "
        "dtype, shape or size), or because they did not decode."
    )
    untrusted_index: int = counter(
        "1 when a file at the index's names was refused (another uid "
        "owns it, others may write it, or it is a symlink): not read, written or replaced; the "
        "start was cold, and no index is kept while another user's file holds the name."
    )
    write_holds: int = counter(
        "Reservations of the old daemon that a client process still "
        "running may be writing: their pages stay out of reuse until it exits."
    )
    layout_replaced: int = counter("1 when an old segment was replaced.")


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineStats:
    """The engine's counts at one moment: pools, entries, hits, puts, leases, copies. The
    Stats calls answer with ``to_dict()``; the metrics read it at every scrape; the REST
    schema derives its model from these fields (``description``: what it says of one)."""

    host: PoolStats
    device: list[PoolStats]
    entries_ready: int
    entries_filling: int
    reserved_filling_bytes: int
    hits: int
    misses: int
    evictions: int
    evicted_bytes: int
    puts_committed: int
    puts_aborted: int
    put_bytes: int
    leases_active: int
    leases_expired: int
    lease_owners: int
    runs_per_entry: dict[str, int]  # bucket label -> entries
    bytes_copied: dict[str, int]  # direction -> bytes
    device_resident: list[int] = field(
        default_factory=list, metadata=doc("Entries resident on each device pool.")
    )
    draining: bool
    # the prealloc's pages (free, on loan); the name is on the wire
    put_landing_bytes: int = counter(
        "Host pool bytes set aside for puts from a device (counted as free)."
    )
    metadata_bytes: int = counter(
        "Estimated memory of the READY entries' metadata (key, shape, tables)."
    )
    max_entries: int = counter("Most entries kept; past it LRU ones are evicted.")
    leases_quarantined: int = counter(
        "Leases that ended by force while their owner's process may still read the pages "
        "through views: their pages stay out of reuse until it exits or drops them."
    )
    quarantined_bytes: int = counter(
        "Pages those quarantined leases hold, and reserved pages a live client may still "
        "be writing (held until it is done or exits), in bytes."
    )
    restart: dict[str, int] = field(  # the fields of RestartCounts
        default_factory=dict,
        metadata=doc("What this daemon adopted at a warm restart (docs/restart.md)."),
    )
    read_table: dict[str, int] = field(  # the fields of ReadTableCounts
        default_factory=dict,
        metadata=doc("Same-node clients' reads without a call (docs/same_node_reads.md)."),
    )
    hit_bytes: int = counter("Bytes of the entries hits handed out (host bytes out).")

    @property
    def hit_rate(self) -> float:
        """Hits over lookups since start (0.0 before the first)."""
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready values, ``hit_rate`` included."""
        d = asdict(self)
        d["hit_rate"] = self.hit_rate
        return d


@dataclass(frozen=True, slots=True)
class EntryInfo:
    """One entry as operators see it (the REST listing derives its model from these
    fields; ``residency``: ``host``, ``device:<i>``, ...)."""

    key: str
    state: str = field(metadata=doc("ready or filling (leased entries are ready with leases > 0)."))
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    page_runs: tuple[tuple[int, int], ...]
    leases: int = field(metadata=doc("Live leases on the entry."))
    idle_s: float = field(metadata=doc("Seconds since the entry was last written or read."))
    residency: tuple[str, ...] = field(metadata=doc("Tiers holding a copy: host, device..."))
    lease_holders: tuple[tuple[str, float], ...] = ()  # (owner, expires_in_s); ids stay secret

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready values (lists for tuples, lease holders as objects)."""
        d = asdict(self)
        d["shape"] = list(self.shape)
        d["page_runs"] = [list(r) for r in self.page_runs]
        d["residency"] = list(self.residency)
        d["lease_holders"] = [{"owner": o, "expires_in_s": t} for o, t in self.lease_holders]
        return d


def engine_stats(host: HostCounts, tier: DeviceTier, *, draining: bool) -> EngineStats:
    """One snapshot of the host store's counts and the device pools."""
    c = host.counters
    return EngineStats(
        host=host.pool,
        device=tier.stats(),
        entries_ready=host.entries_ready,
        entries_filling=host.entries_filling,
        reserved_filling_bytes=host.reserved_filling_bytes,
        hits=c.get("hits", 0),
        misses=c.get("misses", 0),
        evictions=c.get("evictions", 0),
        evicted_bytes=c.get("evicted_bytes", 0),
        puts_committed=c.get("puts_committed", 0),
        puts_aborted=c.get("puts_aborted", 0),
        put_bytes=c.get("put_bytes", 0),
        hit_bytes=c.get("hit_bytes", 0),
        leases_active=host.leases_active,
        leases_expired=c.get("leases_expired", 0),
        lease_owners=host.lease_owners,
        runs_per_entry=host.runs_per_entry,
        bytes_copied=tier.copier.copied(),
        device_resident=tier.resident_entries(),
        draining=draining,
        put_landing_bytes=host.prealloc_bytes,
        metadata_bytes=host.metadata_bytes,
        max_entries=host.max_entries,
        leases_quarantined=host.quarantined,
        quarantined_bytes=host.quarantined_bytes,
        restart=restart_counts(c),
        read_table=asdict(
            ReadTableCounts(
                entries=host.table_entries,
                skipped=host.table_skipped,
                reads=c.get("table_reads", 0),
                device_published=host.table_device[0],
                device_withdrawn=host.table_device[1],
                device_skipped=host.table_device[2],
            )
        ),
    )


def restart_counts(c: dict[str, int]) -> dict[str, int]:
    """What the warm restart at start adopted and dropped (``host/restart.py``), and how
    many adopted entries are not checked against their CRC32 yet."""
    adopted = c.get("adopted_entries", 0)
    counts = RestartCounts(
        adopted_entries=adopted,
        adopted_bytes=c.get("adopted_bytes", 0),
        unverified_entries=adopted - c.get("adopt_checked", 0),
        dropped_checksum_entries=c.get("adopt_dropped_checksum", 0),
        dropped_checksum_bytes=c.get("adopt_dropped_checksum_bytes", 0),
        dropped_layout_entries=c.get("adopt_dropped_layout", 0),
        dropped_layout_bytes=c.get("adopt_dropped_layout_bytes", 0),
        dropped_invalid_entries=c.get("adopt_dropped_invalid", 0),
        dropped_refused_entries=c.get("adopt_dropped_refused", 0),
        untrusted_index=c.get("adopt_untrusted_index", 0),
        write_holds=c.get("adopt_write_holds", 0),
        layout_replaced=c.get("adopt_layout_replaced", 0),
    )
    return asdict(counts)


def entry_info(
    entry: Entry,
    tier: DeviceTier,
    now: float,
    holders: tuple[tuple[str, float], ...] = (),
) -> EntryInfo:
    """What operators see of one entry: metadata, page runs, residency, lease holders."""
    return EntryInfo(
        entry.key,
        entry.state.name.lower(),
        entry.dtype.name,
        entry.shape,
        entry.nbytes,
        entry.runs,
        entry.ref_cnt,
        max(0.0, now - entry.last_access),
        tier.residency(entry),
        holders,
    )
