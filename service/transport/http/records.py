"""REST models derived from the daemon's dataclass records (``proto/records.py``).

A record's fields are declared once, on its dataclass; its REST model takes their names,
types, defaults and descriptions from there, so the JSON a route answers with and the
OpenAPI schema follow the record. The model class itself carries only what REST adds or
writes differently: a ``kind`` tag, a base64 or decimal-string form, a nested model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection
from typing import Any, TypeVar, cast, get_type_hints

from pydantic import BaseModel, ConfigDict, Field, create_model

from embcache.proto.records import description

ModelT = TypeVar("ModelT", bound=BaseModel)


class ClosedModel(BaseModel):
    """A REST body that names every field it may have: requests with others are refused."""

    model_config = ConfigDict(extra="forbid")


class OpenModel(BaseModel):
    """Responses that mirror engine snapshots: fields the engine adds later pass through."""

    model_config = ConfigDict(extra="allow")


def derived(
    record: type, *, exclude: Collection[str] = (), **wire_types: Any
) -> Callable[[type[ModelT]], type[ModelT]]:
    """Class decorator: the model gets every field of the dataclass ``record`` (but those
    in ``exclude``) after its own, with the record's type, default and description.

    A field the class declares itself is kept as declared (REST writes it differently);
    ``wire_types`` names fields whose JSON type differs (a nested record's model, say) and
    keeps their default and description. The model keeps the class's name and docstring,
    so the OpenAPI schema names it as before.
    """
    hints = get_type_hints(record)

    def build(cls: type[ModelT]) -> type[ModelT]:
        own = set(cls.model_fields)
        fields: dict[str, Any] = {}
        for f in dataclasses.fields(record):
            if f.name in own or f.name in exclude:
                continue
            annotation = wire_types.get(f.name, hints[f.name])
            fields[f.name] = (annotation, _field_info(f, validate=f.name in wire_types))
        model = create_model(
            cls.__name__, __base__=cls, __module__=cls.__module__, __doc__=cls.__doc__, **fields
        )
        return cast(type[ModelT], model)

    return build


def values_of(record: Any, **changes: Any) -> dict[str, Any]:
    """The fields of the dataclass ``record`` by name (shallow), with ``changes`` applied:
    the keyword arguments of its derived model."""
    values = {f.name: getattr(record, f.name) for f in dataclasses.fields(record)}
    values.update(changes)
    return values


def _field_info(f: dataclasses.Field[Any], *, validate: bool) -> Any:
    """The pydantic field of a dataclass field: its default and description. A default
    given in the record's type is validated into the wire type (``{}`` into a model)."""
    kwargs: dict[str, Any] = {"description": description(f)}
    if f.default is not dataclasses.MISSING:
        kwargs["default"] = f.default
    elif f.default_factory is not dataclasses.MISSING:
        kwargs["default_factory"] = f.default_factory
    if validate and len(kwargs) > 1:
        kwargs["validate_default"] = True
    return Field(**kwargs)
