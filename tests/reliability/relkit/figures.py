"""Figures tables: print them (pytest ``-s`` shows them) and save them as JSON."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def table(title: str, rows: dict[str, Any]) -> str:
    """A two-column text table; nested dicts are flattened with ``/``."""
    flat: list[tuple[str, str]] = []

    def add(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                add(f"{prefix}/{k}" if prefix else str(k), v)
        elif isinstance(value, list):
            flat.append((prefix, "; ".join(str(v) for v in value) or "-"))
        else:
            flat.append((prefix, "-" if value in ({}, None) else str(value)))

    add("", rows)
    width = max((len(k) for k, _ in flat), default=10)
    lines = [f"== {title} ==", *(f"  {k.ljust(width)}  {v}" for k, v in flat)]
    return "\n".join(lines)


def save(section: str, figures: dict[str, Any], path: Path | None = None) -> Path | None:
    """Merge ``figures`` under ``section`` into a JSON file: ``path``, or the file named by
    ``EMBCACHE_RELIABILITY_JSON`` (tests write nothing into the tree unless asked)."""
    target = path or (Path(p) if (p := os.environ.get("EMBCACHE_RELIABILITY_JSON")) else None)
    if target is None:
        return None
    data: dict[str, Any] = {}
    if target.exists():
        try:
            data = json.loads(target.read_text())
        except ValueError:
            data = {}
    data[section] = figures
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return target
