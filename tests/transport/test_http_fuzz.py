"""Schema-driven fuzzing: requests generated from the app's own OpenAPI document.

Every operation in ``/openapi.json`` gets parameters and bodies drawn from its JSON
schemas, valid and deliberately invalid, against a real engine behind uvicorn. The
server must never answer 5xx, and every error must have the one error shape.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from embcache.service.config import Settings
from embcache.service.engine import CacheEngine
from embcache.service.observability.metrics import Metrics
from embcache.service.transport.http.app import create_app
from embcache.service.transport.http.testing import serve_in_thread

PAGE = 4096
TOKEN = "fuzz-token"
KEYS = ["a", "b/c", "d e", "ünï", "x" * 200]

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text()
)
any_json = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=6,
)


def from_schema(schema: dict[str, Any], spec: dict[str, Any]) -> st.SearchStrategy[Any]:
    """A strategy for values that satisfy ``schema`` (the subset FastAPI emits)."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return from_schema(spec["components"]["schemas"][name], spec)
    for combinator in ("anyOf", "oneOf"):
        if combinator in schema:
            return st.one_of([from_schema(s, spec) for s in schema[combinator]])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "const" in schema:
        return st.just(schema["const"])
    kind = schema.get("type")
    if kind == "string":
        return st.text(max_size=int(schema.get("maxLength", 40))) | st.sampled_from(KEYS)
    if kind == "integer":
        return st.integers(min_value=schema.get("minimum"), max_value=schema.get("maximum"))
    if kind == "number":
        return st.floats(allow_nan=False, allow_infinity=False)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "array":
        items = from_schema(schema.get("items", {}), spec)
        return st.lists(items, max_size=min(int(schema.get("maxLength", 5)), 5))
    if kind == "object" or "properties" in schema:
        props = {k: from_schema(v, spec) for k, v in schema.get("properties", {}).items()}
        required = set(schema.get("required", ()))
        return st.fixed_dictionaries(
            {k: v for k, v in props.items() if k in required},
            optional={k: v for k, v in props.items() if k not in required},
        )
    return any_json


def maybe_invalid(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly schema-valid values, sometimes anything at all."""
    return st.one_of(strategy, strategy, strategy, any_json)


def operations(spec: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [
        (method.upper(), path, op)
        for path, item in sorted(spec["paths"].items())
        for method, op in sorted(item.items())
    ]


@st.composite
def requests(draw: st.DrawFn, spec: dict[str, Any]) -> tuple[str, str, dict, Any]:
    method, path, op = draw(st.sampled_from(operations(spec)))
    query = {}
    for param in op.get("parameters", []):
        value = draw(maybe_invalid(from_schema(param.get("schema", {}), spec)))
        if param["in"] == "path":
            text = value if isinstance(value, str) else json.dumps(value)
            path = path.replace("{" + param["name"] + "}", quote(text, safe="/") or "k")
        elif param["in"] == "query" and (param.get("required") or draw(st.booleans())):
            query[param["name"]] = value if isinstance(value, str) else json.dumps(value)
    body = None
    content = op.get("requestBody", {}).get("content", {})
    if "application/json" in content:
        body = draw(maybe_invalid(from_schema(content["application/json"]["schema"], spec)))
    return method, path, query, body


@dataclass
class Served:
    client: httpx.Client
    spec: dict[str, Any] = field(repr=False)  # keeps failure reports short


@pytest.fixture(params=[None, TOKEN], ids=["open", "token"])
def server(request: pytest.FixtureRequest, shm_name: str) -> Iterator[Served]:
    settings_ = Settings(
        host_pool_bytes=32 * PAGE,
        page_bytes=PAGE,
        shm_name=shm_name,
        device="cpu",
        auth_token=request.param,
    )
    with CacheEngine(settings_) as engine:
        for i, key in enumerate(KEYS):
            engine.put(key, torch.full((i + 1, 256), float(i)))
        engine.get(KEYS[:2], owner="fuzz")
        app = create_app(engine, settings_, Metrics(engine))
        headers = {"Authorization": f"Bearer {TOKEN}"} if request.param else {}
        with (
            serve_in_thread(app) as url,
            httpx.Client(base_url=url, headers=headers, timeout=10) as client,
        ):
            yield Served(client, client.get("/openapi.json").json())


def test_openapi_covers_every_v1_route(server: Served) -> None:
    spec = server.spec
    ops = {(m, p) for m, p, _ in operations(spec)}
    assert {
        ("GET", "/v1/stats"),
        ("GET", "/v1/entries"),
        ("GET", "/v1/entries/{key}"),
        ("DELETE", "/v1/entries/{key}"),
        ("POST", "/v1/evict"),
        ("GET", "/v1/pool-map"),
        ("PUT", "/v1/entries/{key}"),
        ("GET", "/v1/entries/{key}/data"),
        ("POST", "/v1/get"),
        ("POST", "/v1/release"),
        ("POST", "/v1/renew"),
    } <= ops


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_fuzz_no_server_errors(server: Served, data: st.DataObject) -> None:
    client, spec = server.client, server.spec
    method, path, query, body = data.draw(requests(spec))
    kwargs: dict[str, Any] = {"params": query}
    if body is not None:
        kwargs["json"] = body
    resp = client.request(method, path, **kwargs)
    assert resp.status_code < 500, (method, path, query, body, resp.text)
    if resp.status_code >= 400:
        assert set(resp.json()) == {"error", "code", "message", "details"}, resp.text
    elif resp.headers.get("content-type") == "application/octet-stream":
        assert int(resp.headers["x-embcache-nbytes"]) >= len(resp.content)  # entry bytes
    elif re.fullmatch(r"/v1/.*", path):
        resp.json()  # every other /v1 success is JSON
