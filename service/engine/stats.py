"""The engine's snapshots for transports and operators (plain data, JSON-ready), and how
they are put together from the host store's counts and the device tier's pools."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from embcache.service.device.tier import DeviceTier
from embcache.service.host.entries import Entry
from embcache.service.host.stats import PoolStats
from embcache.service.host.store import HostCounts


@dataclass(frozen=True, slots=True)
class EngineStats:
    """The engine's counts at one moment: pools, entries, hits, puts, leases, copies. The
    Stats calls answer with ``to_dict()``; the metrics read it at every scrape."""

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
    runs_per_entry: dict[str, int] = field(default_factory=dict)  # bucket label -> entries
    bytes_copied: dict[str, int] = field(default_factory=dict)  # direction -> bytes
    device_resident: list[int] = field(default_factory=list)  # entries resident per device
    draining: bool = False
    put_landing_bytes: int = 0  # the prealloc's pages (free, on loan); the name is on the wire
    metadata_bytes: int = 0  # an estimate of the READY entries' metadata (host/entries.py)
    max_entries: int = 0  # READY and FILLING entries together are kept at most this many
    leases_quarantined: int = 0  # holds kept after a forced end (host/quarantine.py)
    quarantined_bytes: int = 0
    restart: dict[str, int] = field(default_factory=dict)  # what a warm restart adopted
    read_table: dict[str, int] = field(default_factory=dict)  # same-node reads (read_table.py)
    hit_bytes: int = 0  # bytes of the entries hits handed out (host bytes out)

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
    """One entry as operators see it (``state``: ``ready`` or ``filling``; ``leases``: how
    many; ``residency``: ``host``, ``device:<i>``, ...)."""

    key: str
    state: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    page_runs: tuple[tuple[int, int], ...]
    leases: int
    idle_s: float
    residency: tuple[str, ...]
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
        read_table={
            "entries": host.table_entries,
            "skipped": host.table_skipped,
            "reads": c.get("table_reads", 0),
            "device_published": host.table_device[0],
            "device_withdrawn": host.table_device[1],
            "device_skipped": host.table_device[2],
        },
    )


def restart_counts(c: dict[str, int]) -> dict[str, int]:
    """What the warm restart at start adopted and dropped (``host/restart.py``), and how
    many adopted entries are not checked against their CRC32 yet."""
    adopted = c.get("adopted_entries", 0)
    return {
        "adopted_entries": adopted,
        "adopted_bytes": c.get("adopted_bytes", 0),
        "unverified_entries": adopted - c.get("adopt_checked", 0),
        "dropped_checksum_entries": c.get("adopt_dropped_checksum", 0),
        "dropped_checksum_bytes": c.get("adopt_dropped_checksum_bytes", 0),
        "dropped_layout_entries": c.get("adopt_dropped_layout", 0),
        "dropped_layout_bytes": c.get("adopt_dropped_layout_bytes", 0),
        "dropped_invalid_entries": c.get("adopt_dropped_invalid", 0),
        "dropped_refused_entries": c.get("adopt_dropped_refused", 0),
        "untrusted_index": c.get("adopt_untrusted_index", 0),
        "write_holds": c.get("adopt_write_holds", 0),
        "layout_replaced": c.get("adopt_layout_replaced", 0),
    }


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
