"""A pool's occupancy at one moment, and the buckets of the runs-per-entry histogram."""

from __future__ import annotations

from dataclasses import dataclass, field

from embcache.proto.records import doc


@dataclass(frozen=True, slots=True)
class PoolStats:
    """One pool's sizes and fragmentation (``tier``: ``host`` or ``device:<index>``).

    The record's one declaration: the REST model derives from these fields, with the
    descriptions in their metadata (``proto/records.py``)."""

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
    out_of_service: str = field(
        default="",
        metadata=doc("Device pools only: why a device error took it out (empty if not)."),
    )


RUN_BUCKETS = ((1, "1"), (2, "2"), (4, "3-4"), (8, "5-8"), (16, "9-16"), (None, ">16"))


def run_bucket(num_runs: int) -> str:
    """The histogram label of an entry held in ``num_runs`` page runs."""
    for limit, label in RUN_BUCKETS:
        if limit is None or num_runs <= limit:
            return label
    raise AssertionError("unreachable")
