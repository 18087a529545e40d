"""Counted nouns for messages and log lines: ``1 entry``, ``2 entries``, never ``1 entries``."""

from __future__ import annotations

# Nouns whose plural is not the singular plus "s".
_IRREGULAR = {"entry": "entries", "copy": "copies", "process": "processes"}


def plural(n: int, noun: str, many: str | None = None) -> str:
    """``n`` and ``noun`` agreeing in number: ``plural(1, "lease")`` -> ``1 lease``;
    ``many`` overrides the plural form. Counts are written with thousands separators."""
    if n == 1:
        return f"1 {noun}"
    return f"{n:,} {many or _IRREGULAR.get(noun) or noun + 's'}"
