"""What ``embcache serve --help`` says of each setting, read off the Settings model's fields:
its type or unit (the metavar), its default as a flag would take it, its environment
variable, and its range. Nothing here names a field: a field added to ``service/config/``
gets its help from its type, default and description."""

from __future__ import annotations

import types
import typing
from pathlib import Path
from typing import Any, Literal

import annotated_types
from pydantic.fields import FieldInfo
from pydantic.functional_validators import BeforeValidator

from embcache.service.sizes import parse_size

ENV_PREFIX = "EMBCACHE_"
_BINARY_UNITS = (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024))


def env_var(name: str) -> str:
    """The environment variable of a field: ``host_pool_bytes`` -> ``EMBCACHE_HOST_POOL_BYTES``."""
    return ENV_PREFIX + name.upper()


def is_size(field: FieldInfo) -> bool:
    """A byte count that takes units (``4GiB``): an int parsed by ``parse_size``."""
    return any(isinstance(m, BeforeValidator) and m.func is parse_size for m in field.metadata)


def _base(annotation: Any) -> Any:
    """``X | None`` -> ``X``."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else annotation
    return annotation


def metavar(name: str, field: FieldInfo) -> str:
    """The value a flag takes, as its help shows it: SIZE, SECONDS, on|off, a|b|c, PATH..."""
    kind = _base(field.annotation)
    if typing.get_origin(kind) is Literal:
        return "|".join(str(a) for a in typing.get_args(kind))
    if kind is bool:
        return "on|off"
    if is_size(field):
        return "SIZE"
    if kind is float:
        return "SECONDS" if name.endswith("_s") else "NUMBER"
    if kind is int:
        if name.endswith("_us"):
            return "MICROSECONDS"
        return "PORT" if name.endswith("_port") else "INTEGER"
    if isinstance(kind, type) and issubclass(kind, Path):
        return "PATH"
    return "TEXT"


def format_default(name: str, field: FieldInfo) -> str:
    """The default as a flag would be given it (``1GiB``, ``on``, ``0.0625``); ``none`` for
    unset and ``empty`` for an empty string."""
    value = field.get_default(call_default_factory=True)
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if is_size(field) and isinstance(value, int) and value:
        for unit, scale in _BINARY_UNITS:
            if value % scale == 0:
                return f"{value // scale}{unit}"
    if isinstance(value, str):
        return value if value else "empty"
    return str(value)


def value_range(field: FieldInfo) -> str:
    """``>= 0, <= 65535`` from the field's bounds; empty when it has none."""
    bounds = []
    for m in field.metadata:
        for op, attr in ((">=", "ge"), (">", "gt"), ("<=", "le"), ("<", "lt")):
            bound = getattr(m, attr, None)
            if isinstance(m, annotated_types.BaseMetadata) and bound is not None:
                bounds.append(f"{op} {bound:g}" if isinstance(bound, float) else f"{op} {bound}")
    return ", ".join(bounds)


def option_help(name: str, field: FieldInfo) -> str:
    """The description, then ``[default: ...; range; env: EMBCACHE_...]``."""
    tail = [f"default: {format_default(name, field)}"]
    if bounds := value_range(field):
        tail.append(bounds)
    tail.append(f"env: {env_var(name)}")
    text = (field.description or "").strip()
    return f"{text} [{'; '.join(tail)}]" if text else f"[{'; '.join(tail)}]"
