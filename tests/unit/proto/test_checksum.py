"""The payload checksum is zlib's CRC-32, computed by ISA-L when it is installed."""

from __future__ import annotations

import zlib

from hypothesis import given, settings
from hypothesis import strategies as st

from embcache.proto import checksum


def test_the_fast_implementation_is_in_use() -> None:
    assert checksum._crc32.__module__.startswith("isal"), checksum._crc32.__module__


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=4096), st.binary(max_size=4096), st.integers(0, 2**32 - 1))
def test_same_values_as_zlib(a: bytes, b: bytes, start: int) -> None:
    assert checksum.crc32(a) == zlib.crc32(a)
    assert checksum.crc32(b, checksum.crc32(a, start)) == zlib.crc32(a + b, start)
    assert checksum.crc32(memoryview(a + b)[len(a) :]) == zlib.crc32(b)
