"""The read table's layout (proto/read_table.py): the device sections of a slot round trip,
stay inside the slot, and refuse what does not fit instead of writing something else."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from embcache.proto import read_table as rt

runs_st = st.lists(
    st.tuples(st.integers(0, 2**32 - 1), st.integers(1, 2**32 - 1)), max_size=rt.DEVICE_RUNS
).map(tuple)


def test_geometry_fits() -> None:
    assert rt.VERSION == 2 and rt.SLOT_BYTES == 512
    assert rt.SEQ.size + rt.BODY.size == rt.DEVICE_AT
    assert rt.DEVICE_AT + rt.DEVICE_SECTIONS * rt.DEVICE.size <= rt.SLOT_BYTES
    assert rt.DEVICE_HEADER_AT >= rt.CLOSED_AT + 8  # after the closed word
    assert rt.DEVICE_HEADER_AT + rt.DEVICE_HEADER.size <= rt.HEADER_BYTES
    assert rt.device_at(1000, rt.DEVICE_SECTIONS - 1) + rt.DEVICE.size <= 1000 + rt.SLOT_BYTES
    # each section starts where the one before ends, after the body
    assert [rt.device_at(0, i) for i in range(3)] == [
        rt.DEVICE_AT,
        rt.DEVICE_AT + rt.DEVICE.size,
        rt.DEVICE_AT + 2 * rt.DEVICE.size,
    ]


@given(pool=st.integers(0, 255), runs=runs_st)
def test_device_section_round_trip(pool: int, runs: tuple[tuple[int, int], ...]) -> None:
    packed = rt.pack_device(pool, runs)
    assert len(packed) == rt.DEVICE.size
    assert rt.unpack_device(packed) == (pool, runs)
    slot = bytearray(rt.SLOT_BYTES)
    slot[rt.DEVICE_AT + rt.DEVICE.size : rt.DEVICE_AT + 2 * rt.DEVICE.size] = packed
    assert rt.unpack_device(bytes(slot), rt.device_at(0, 1)) == (pool, runs)
    assert rt.unpack_device(bytes(slot), rt.device_at(0, 0)) is None  # never written


@pytest.mark.parametrize(
    ("pool", "runs"),
    [
        (256, ((0, 1),)),  # a pool index past what a section names
        (-1, ((0, 1),)),
        (0, tuple((i, 1) for i in range(rt.DEVICE_RUNS + 1))),  # too many runs
        (0, ((2**32, 1),)),  # a page past 32 bits
        (0, ((0, -1),)),
    ],
)
def test_what_does_not_fit_is_refused(pool: int, runs: tuple[tuple[int, int], ...]) -> None:
    with pytest.raises(ValueError):
        rt.pack_device(pool, runs)


def test_a_torn_section_reads_as_none() -> None:
    cleared = bytes(rt.DEVICE.size)
    assert rt.unpack_device(cleared) is None  # not live
    torn = bytearray(rt.pack_device(3, ((1, 2),)))
    torn[2] = rt.DEVICE_RUNS + 1  # more runs than a section holds: a slot mid-change
    assert rt.unpack_device(bytes(torn)) is None
    assert struct.unpack_from("<B", rt.pack_device(3, ()))[0] == 1  # live with no runs
    assert rt.unpack_device(rt.pack_device(3, ())) == (3, ())
