"""Sizes in bytes, as people write them (``4GiB``, ``256KiB``) and read them; CPU lists
(``0-3,8``) as the kernel writes them."""

from __future__ import annotations

import re
from typing import Any

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: Any) -> int:
    """Parse ``4GiB`` / ``256KiB`` / ``1e6``-free integers into a byte count."""
    if isinstance(value, bool):
        raise ValueError("a size must be a number of bytes, not a boolean")
    if isinstance(value, int):
        size = value
    elif isinstance(value, float):
        if not value.is_integer():
            raise ValueError(f"size {value!r} is not a whole number of bytes")
        size = int(value)
    elif isinstance(value, str):
        match = _SIZE_RE.match(value)
        if match is None or match.group(2).lower() not in _UNITS:
            raise ValueError(f"cannot parse size {value!r} (expected e.g. 4GiB, 256KiB, 1048576)")
        number, unit = match.groups()
        scaled = float(number) * _UNITS[unit.lower()]
        if not scaled.is_integer():
            raise ValueError(f"size {value!r} is not a whole number of bytes")
        size = int(scaled)
    else:
        raise ValueError(f"cannot parse size {value!r}")
    if size < 0:
        raise ValueError(f"size {value!r} is negative")
    return size


def format_size(nbytes: int) -> str:
    """Human-readable binary size, e.g. ``256.0 KiB``."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def parse_cpu_list(text: str) -> set[int]:
    """CPUs of a list like ``0-3,8`` (the kernel's cpu-list syntax); empty text: none."""
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        lo, dash, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi if dash else lo)
        except ValueError:
            raise ValueError(f"bad CPU list item {part!r}: use forms like 2, 2-5") from None
        if first < 0 or last < first:
            raise ValueError(f"bad CPU range {part!r}")
        cpus.update(range(first, last + 1))
    return cpus
