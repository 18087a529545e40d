"""``Range: bytes=...`` for one range, as RFC 9110 reads it.

A header we do not serve (another unit, several ranges, bad syntax) is ignored: the whole
entry is sent with 200, which the RFC allows. A well-formed range that starts past the end
is unsatisfiable (416).
"""

from __future__ import annotations

import re

_RANGE = re.compile(r"^\s*bytes\s*=\s*(\d{0,19})\s*-\s*(\d{0,19})\s*$", re.IGNORECASE)


class RangeNotSatisfiable(Exception):
    """The range lies outside the entry."""


def parse_range(header: str | None, nbytes: int) -> tuple[int, int] | None:
    """``(start, stop)`` (stop exclusive) of the requested bytes, or None for all of them."""
    if header is None:
        return None
    match = _RANGE.match(header)
    if match is None:
        return None
    first, last = match.groups()
    if not first:
        if not last:
            return None  # "bytes=-": malformed, ignored
        suffix = int(last)
        if suffix == 0 or nbytes == 0:
            raise RangeNotSatisfiable(f"suffix range of {suffix} bytes of a {nbytes}-byte entry")
        return max(0, nbytes - suffix), nbytes
    start = int(first)
    stop = nbytes if not last else int(last) + 1
    if last and stop <= start:
        return None  # last < first: malformed, ignored
    if start >= nbytes:
        raise RangeNotSatisfiable(f"range starts at {start}; the entry has {nbytes} bytes")
    return start, min(stop, nbytes)
