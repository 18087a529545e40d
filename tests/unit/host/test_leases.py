"""Lease ids: unguessable (from the OS's random source), non-zero, 63-bit; what each owner
holds, and the caps on it."""

from __future__ import annotations

import pytest

from embcache.errors import LeaseLimitExceeded
from embcache.proto.dtypes import lookup
from embcache.service.host.entries import Entry, EntryState
from embcache.service.host.leases import LeaseCaps, LeaseTable, RandomIds


def test_ids_are_nonzero_63_bit_and_refill() -> None:
    ids = RandomIds()
    drawn = [ids.next() for _ in range(3 * RandomIds.BATCH + 7)]  # three refills and more
    assert all(0 <= i < 2**63 for i in drawn)
    assert len(set(drawn)) == len(drawn)  # a clash has odds near 2**-43: a repeat means a bug
    assert max(drawn) >= 2**60  # the top bits are used


def _entry(key: str, nbytes: int) -> Entry:
    return Entry(key, lookup("uint8"), (nbytes,), nbytes, ((0, 1),), EntryState.READY)  # type: ignore[arg-type]


def test_usage_counts_leases_and_the_bytes_of_distinct_entries() -> None:
    table, a, b = LeaseTable(), _entry("a", 100), _entry("b", 10)
    first = table.add(a, "o", 10.0, 4096)
    table.add(a, "o", 10.0, 4096)  # a second lease of one entry pins no more bytes
    table.add(b, "o", 10.0, 4096)
    table.add(b, "other", 10.0, 4096)
    assert table.usage("o") == (3, 110) and table.usage("other") == (1, 10)
    table.pop(first.lease_id)
    assert table.usage("o") == (2, 110)
    for lease_id in table.owned_by("o"):
        table.pop(lease_id)
    assert table.usage("o") == (0, 0) and table.owners() == 1


def test_caps_refuse_before_anything_changes() -> None:
    table, a, b = LeaseTable(), _entry("a", 100), _entry("b", 10)
    table.add(a, "o", 10.0, 4096)
    caps = LeaseCaps(leases=3, nbytes=105)
    table.check_caps("o", [a, None, a], caps)  # 3 leases, a's bytes already held: fine
    with pytest.raises(LeaseLimitExceeded, match="leased bytes"):
        table.check_caps("o", [b], caps)  # 110 > 105
    with pytest.raises(LeaseLimitExceeded, match="too many leases"):
        table.check_caps("o", [a, a, a], caps)
    assert table.usage("o") == (1, 100)
