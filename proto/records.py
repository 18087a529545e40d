"""Records declared once, as dataclasses, and their protobuf form derived by field name.

A record the daemon answers with (a pool description, a location, the stats) is one stdlib
dataclass. Each transport derives its encoding from those fields instead of listing them
again: the REST models take their types, defaults and the ``description`` kept in each
field's metadata (:func:`doc`), and a protobuf message takes the fields it has a same-named
field for (:func:`fill_message`). A field added to the record then reaches every encoding.
Nothing here imports protobuf: a message is only read through its descriptor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from typing import Any, TypeVar

DESCRIPTION = "description"

M = TypeVar("M")


def doc(text: str) -> dict[str, str]:
    """A field's metadata that carries what the REST schema says of it."""
    return {DESCRIPTION: text}


def counter(text: str) -> Any:
    """A described count that starts at 0 (a dataclass field, as ``field()`` makes)."""
    return dataclasses.field(default=0, metadata=doc(text))


def description(f: dataclasses.Field[Any]) -> str | None:
    """What the field's metadata says of it, if anything."""
    text = f.metadata.get(DESCRIPTION)
    return None if text is None else str(text)


def fill_message(
    message: M,
    record: Any,
    *,
    renames: Mapping[str, str] | None = None,
    skip: Collection[str] = (),
) -> M:
    """Set the scalar and repeated-scalar fields of ``message`` from the same-named fields
    of the dataclass ``record`` (``renames``: record field -> message field, where the
    names differ). Fields the message lacks, those in ``skip`` and ``None`` values are left
    unset, so an optional or ``oneof`` member is set only when the record has it."""
    names = renames or {}
    wire = message.DESCRIPTOR.fields_by_name  # type: ignore[attr-defined]
    for f in dataclasses.fields(record):
        name = names.get(f.name, f.name)
        value = getattr(record, f.name)
        if f.name in skip or name not in wire or value is None:
            continue
        target = wire[name]
        if target.message_type is not None:
            raise TypeError(f"{name} is a message field: map it by hand")
        if target.is_repeated:
            getattr(message, name).extend(value)
        else:
            setattr(message, name, value)
    return message
