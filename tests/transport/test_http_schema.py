"""The REST schema says what the server does (issue 33's list; schemathesis runs the rest in
tests/e2e/test_openapi_schemathesis.py)."""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from embcache import build_info
from embcache.errors import InvalidArgument
from embcache.service.config import Settings
from embcache.service.engine import CacheEngine
from embcache.service.observability.metrics import Metrics
from embcache.service.transport.http.app import create_app
from embcache.service.transport.http.put_params import SHAPE_PATTERN, parse_shape
from embcache.service.transport.http.testing import serve_in_thread

PAGE = 4096
TOKEN = "schema-token"


@pytest.fixture
def engine(shm_name: str) -> Iterator[CacheEngine]:
    settings = Settings(host_pool_bytes=64 * PAGE, page_bytes=PAGE, shm_name=shm_name,
                        device="cpu", auth_token=TOKEN, max_lease_ttl_s=120)  # fmt: skip
    with CacheEngine(settings) as eng:
        yield eng


@pytest.fixture
def http(engine: CacheEngine) -> Iterator[httpx.Client]:
    app = create_app(engine, engine.settings, Metrics(engine))
    headers = {"Authorization": f"Bearer {TOKEN}"}
    with serve_in_thread(app) as url, httpx.Client(base_url=url, headers=headers) as client:
        yield client


@pytest.fixture
def schema(http: httpx.Client) -> dict:
    return http.get("/openapi.json").json()


def test_evict_takes_keys_or_bytes(http: httpx.Client, engine: CacheEngine) -> None:
    for body in ({"keys": ["a"], "bytes": 1}, {}, {"device": 0}, {"bytes": True},
                 {"bytes": "1.5MiB"}, {"bytes": -1}):  # fmt: skip
        assert http.post("/v1/evict", json=body).status_code == 422, body
    engine.put("a", torch.ones(PAGE, dtype=torch.uint8))
    assert http.post("/v1/evict", json={"bytes": "1MiB"}).json()["freed_bytes"] == PAGE
    assert http.post("/v1/evict", json={"bytes": 1024.0}).status_code == 200


def test_evict_schema_has_both_shapes(schema: dict) -> None:
    body = schema["paths"]["/v1/evict"]["post"]["requestBody"]["content"]["application/json"]
    shapes = body["schema"]["anyOf"]
    assert len(shapes) == 2
    models = schema["components"]["schemas"]
    assert models["EvictKeys"]["required"] == ["keys"]
    size = models["EvictBytes"]["properties"]["bytes"]["anyOf"]
    assert {"type": "integer", "minimum": 0} in size
    assert any(c.get("type") == "string" and "pattern" in c for c in size)


@pytest.mark.parametrize("route", ["/v1/release", "/v1/renew"])
def test_lease_ids(http: httpx.Client, route: str) -> None:
    for ids in ([False], [-1], ["-1"], ["12345678901234567890"], [1.5]):
        assert http.post(route, json={"lease_ids": ids}).status_code == 422, ids
    assert http.post(route, json={"lease_ids": [2**64 + 5, "7", 3.0]}).status_code == 200


def test_ttl_bounds_follow_the_settings(http: httpx.Client, schema: dict) -> None:
    for name in ("GetRequest", "RenewRequest"):
        ttl = schema["components"]["schemas"][name]["properties"]["ttl_s"]["anyOf"]
        number = next(c for c in ttl if c.get("type") == "number")
        assert number["exclusiveMinimum"] == 0 and number["maximum"] == 120
    assert http.post("/v1/renew", json={"lease_ids": [], "ttl_s": 120}).status_code == 200


def test_put_dtype_is_an_enum_and_empty_headers_are_refused(
    http: httpx.Client, schema: dict
) -> None:
    params = schema["paths"]["/v1/entries/{key}"]["put"]["parameters"]
    by_name = {p["name"]: p for p in params}
    for name in ("X-Embcache-Dtype", "dtype"):
        enum = by_name[name]["schema"]["enum"]
        assert "bfloat16" in enum and "bf16" in enum and "" not in enum
    headers = {"X-Embcache-Dtype": "", "X-Embcache-Shape": "4"}
    refused = http.put("/v1/entries/k?dtype=uint8", content=b"abcd", headers=headers)
    assert refused.status_code == 400
    ok = http.put("/v1/entries/k?dtype=uint8&shape=4", content=b"abcd")
    assert ok.status_code == 201


def test_paths_ending_in_data_are_read_only(http: httpx.Client) -> None:
    for method in ("PUT", "DELETE", "OPTIONS"):
        reply = http.request(method, "/v1/entries/a/data")
        assert reply.status_code == 405 and reply.headers["allow"] == "GET", method
    created = http.put("/v1/entries/a%2Fdata?dtype=uint8&shape=1", content=b"x")
    assert created.status_code == 201 and created.json()["key"] == "a/data"
    assert http.options("/v1/entries/k").headers["allow"] == "DELETE, GET, PUT"


def test_probes_answer_head_and_401s_are_documented(http: httpx.Client, schema: dict) -> None:
    for path in ("/livez", "/readyz"):
        assert http.head(path).status_code == 200
        assert "head" in schema["paths"][path]
    assert "401" in schema["paths"]["/metrics"]["get"]["responses"]
    assert "401" in schema["paths"]["/v1/stats"]["get"]["responses"]
    assert httpx.get(str(http.base_url.join("/metrics"))).status_code == 401


def test_stats_and_pool_map_carry_the_build(http: httpx.Client) -> None:
    for route in ("/v1/stats", "/v1/pool-map"):
        body = http.get(route).json()
        assert body["version"] == build_info.version(), route
        assert body["commit"] == build_info.git_commit(), route


def test_schema_requires_the_token_it_is_served_with(http: httpx.Client, schema: dict) -> None:
    assert schema["components"]["securitySchemes"]
    for path, operations in schema["paths"].items():
        for method, op in operations.items():
            probe = path in ("/livez", "/readyz")
            assert ("security" in op) is not probe, (method, path)
            assert ("401" in op["responses"]) is not probe, (method, path)
            assert "403" in op["responses"], (method, path)  # Host / Origin refused


def test_schema_without_a_token_asks_for_none(shm_name: str) -> None:
    settings = Settings(host_pool_bytes=64 * PAGE, page_bytes=PAGE, shm_name=shm_name,
                        device="cpu")  # fmt: skip
    with (
        CacheEngine(settings) as engine,
        serve_in_thread(create_app(engine, settings, Metrics(engine))) as url,
    ):
        schema = httpx.get(f"{url}/openapi.json").json()
        # What the schema promises holds: no token is needed.
        assert httpx.get(f"{url}/v1/stats").status_code == 200
    assert "securitySchemes" not in schema.get("components", {})
    for path, operations in schema["paths"].items():
        for method, op in operations.items():
            assert "security" not in op and "401" not in op["responses"], (method, path)


def test_info_version_is_the_package_version(schema: dict) -> None:
    assert schema["info"]["version"] == build_info.version()
    assert "/v1" in schema["info"]["description"]


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=" \t[],0123456789x-\x0b", max_size=40))
def test_shape_pattern_is_what_the_server_reads(text: str) -> None:
    """The schema's shape pattern and the server's parser accept exactly the same strings."""
    try:
        parse_shape(text)
        accepted = True
    except InvalidArgument:
        accepted = False
    assert bool(re.fullmatch(SHAPE_PATTERN, text)) is accepted, repr(text)


def test_shape_pattern_bounds_dims_and_digits(http: httpx.Client, schema: dict) -> None:
    params = schema["paths"]["/v1/entries/{key}"]["put"]["parameters"]
    shapes = [p for p in params if p["name"] in ("X-Embcache-Shape", "shape")]
    assert [p["schema"]["pattern"] for p in shapes] == [SHAPE_PATTERN] * 2
    # A dim is at most 19 digits (int64's width): 64 zeros are refused by both.
    assert not re.fullmatch(SHAPE_PATTERN, "0" * 64)
    reply = http.put(f"/v1/entries/z?dtype=uint8&shape={'0' * 64}", content=b"")
    assert reply.status_code == 400
    # Zero-byte entries are valid.
    assert http.put("/v1/entries/z?dtype=uint8&shape=0,4", content=b"").status_code == 201
