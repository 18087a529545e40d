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


def parse_shape(text: str) -> tuple[int, ...]:
    """``"3,4"`` -> ``(3, 4)``; an empty string is a scalar. Bounded before int()."""
    text = text.strip().removeprefix("[").removesuffix("]").strip()
    if not text:
        return ()
    parts = text.split(",")
    if len(parts) > admission.MAX_NDIM:
        raise InvalidArgument("too many dimensions", ndim=len(parts), max_ndim=admission.MAX_NDIM)
    dims = []
    for part in parts:
        part = part.strip()
        if not part.isascii() or not part.isdigit() or len(part) > 19:
            raise InvalidArgument("shape must be comma-separated integers >= 0", shape=text)
        dims.append(int(part))
    return tuple(dims)


def parse_checksum(text: str) -> int:
    """A CRC32 as decimal or ``0x`` hex."""
    t = text.strip().lower()
    digits, base = (t[2:], 16) if t.startswith("0x") else (t, 10)
    ok = 0 < len(digits) <= 10 and all(c in "0123456789abcdef"[:base] for c in digits)
    value = int(digits, base) if ok else -1
    if not 0 <= value < 2**32:
        raise InvalidArgument("checksum must be a CRC32 (decimal or 0x hex)", checksum=text)
    return value
