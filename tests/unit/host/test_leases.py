"""Lease ids: unguessable (from the OS's random source), non-zero, 63-bit."""

from __future__ import annotations

from embcache.service.host.leases import RandomIds


def test_ids_are_nonzero_63_bit_and_refill() -> None:
    ids = RandomIds()
    drawn = [ids.next() for _ in range(3 * RandomIds.BATCH + 7)]  # three refills and more
    assert all(0 <= i < 2**63 for i in drawn)
    assert len(set(drawn)) == len(drawn)  # a clash has odds near 2**-43: a repeat means a bug
    assert max(drawn) >= 2**60  # the top bits are used
