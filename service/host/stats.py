"""Snapshots the engine hands to transports and operators (plain data, JSON-ready)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class PoolStats:
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
    out_of_service: str = ""  # a device pool a device error took out: why (empty: serving)


@dataclass(frozen=True, slots=True)
class EngineStats:
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
    put_landing_bytes: int = 0  # host pages set aside for puts from a device (free, on loan)

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["hit_rate"] = self.hit_rate
        return d


@dataclass(frozen=True, slots=True)
class EntryInfo:
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
        d = asdict(self)
        d["shape"] = list(self.shape)
        d["page_runs"] = [list(r) for r in self.page_runs]
        d["residency"] = list(self.residency)
        d["lease_holders"] = [{"owner": o, "expires_in_s": t} for o, t in self.lease_holders]
        return d


RUN_BUCKETS = ((1, "1"), (2, "2"), (4, "3-4"), (8, "5-8"), (16, "9-16"), (None, ">16"))


def run_bucket(num_runs: int) -> str:
    for limit, label in RUN_BUCKETS:
        if limit is None or num_runs <= limit:
            return label
    raise AssertionError("unreachable")
