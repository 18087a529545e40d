"""A REST model derived from a dataclass record has the record's fields, types, defaults and
descriptions after its own; fields it declares itself, or retypes, keep REST's form."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import pytest
from pydantic import BaseModel, Field, ValidationError

from embcache.proto.records import doc
from embcache.service.transport.http.records import ClosedModel, derived, values_of


@dataclass(frozen=True)
class Inner:
    n: int = 0


@dataclass(frozen=True)
class Record:
    name: str = field(metadata=doc("What it is called."))
    token: int = 0
    inner: dict[str, int] = field(default_factory=dict, metadata=doc("Nested."))
    tags: list[str] = field(default_factory=list)


class InnerModel(ClosedModel):
    n: int = 0


@derived(Record, inner=InnerModel)
class RecordModel(ClosedModel):
    """A record as REST writes it."""

    kind: Literal["record"] = "record"
    token: str = Field(description="Decimal string.")


def test_fields_follow_the_record_after_the_class_own() -> None:
    assert list(RecordModel.model_fields) == ["kind", "token", "name", "inner", "tags"]
    schema = RecordModel.model_json_schema()
    assert (
        schema["title"] == "RecordModel" and schema["description"] == "A record as REST writes it."
    )
    props = schema["properties"]
    assert props["name"]["description"] == "What it is called."
    assert props["token"] == {"description": "Decimal string.", "title": "Token", "type": "string"}
    assert schema["required"] == ["token", "name"]


def test_values_convert_and_retyped_defaults_are_validated() -> None:
    rec = Record("a", 7, {"n": 2}, ["x"])
    model = RecordModel(**values_of(rec, token=str(rec.token)))
    assert model.model_dump() == {
        "kind": "record", "token": "7", "name": "a", "inner": {"n": 2}, "tags": ["x"]
    }  # fmt: skip
    assert isinstance(model.inner, InnerModel)
    assert RecordModel(name="b", token="1").inner == InnerModel()  # {} validated into a model
    with pytest.raises(ValidationError):
        RecordModel(name="b", token="1", other=1)  # the class's config still applies
    assert issubclass(RecordModel, BaseModel)
