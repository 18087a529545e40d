"""The parameters of ``PUT /v1/entries/{key}``: dtype, shape and checksum, each given as a
header or a query parameter, parsed (bounded before any ``int()``) before a page is reserved."""

from __future__ import annotations

from embcache.errors import InvalidArgument
from embcache.service.host import admission


def one_of(header: str | None, query: str | None, name: str) -> str | None:
    """The value given as a header or a query parameter (InvalidArgument if both differ)."""
    if header is not None and query is not None and header != query:
        raise InvalidArgument(
            f"{name} given as header and query parameter with different values",
            header=header,
            query=query,
        )
    return header if header is not None else query


# What parse_shape accepts, for the schema (the two must agree, character for character):
# optional brackets, spaces and tabs around, at most 8 dims of 1-19 ASCII digits (a dim of
# 0 is fine: zero-byte entries exist; 19 digits is int64's width, overflow is checked later).
_BLANK = " \t"
_DIM = "[0-9]{1,19}"
_MORE = admission.MAX_NDIM - 1
SHAPE_PATTERN = rf"^[ \t]*\[?[ \t]*(?:{_DIM}(?:[ \t]*,[ \t]*{_DIM}){{0,{_MORE}}})?[ \t]*\]?[ \t]*$"


def parse_shape(text: str) -> tuple[int, ...]:
    """``"3,4"`` -> ``(3, 4)``; an empty string is a scalar. Bounded before int()."""
    text = text.strip(_BLANK).removeprefix("[").removesuffix("]").strip(_BLANK)
    if not text:
        return ()
    parts = text.split(",")
    if len(parts) > admission.MAX_NDIM:
        raise InvalidArgument("too many dimensions", ndim=len(parts), max_ndim=admission.MAX_NDIM)
    dims = []
    for part in parts:
        part = part.strip(_BLANK)
        if not part.isascii() or not part.isdigit() or len(part) > 19:
            raise InvalidArgument("shape must be comma-separated integers >= 0", shape=text)
        dims.append(int(part))
    return tuple(dims)


def parse_checksum(text: str) -> int:
    """A CRC32 as decimal or ``0x`` hex (no blanks: the schema's pattern has none)."""
    t = text.lower()
    digits, base = (t[2:], 16) if t.startswith("0x") else (t, 10)
    ok = 0 < len(digits) <= 10 and all(c in "0123456789abcdef"[:base] for c in digits)
    value = int(digits, base) if ok else -1
    if not 0 <= value < 2**32:
        raise InvalidArgument("checksum must be a CRC32 (decimal or 0x hex)", checksum=text)
    return value
