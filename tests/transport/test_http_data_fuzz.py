"""Fuzzing the data routes through what the OpenAPI fuzz test cannot reach: headers and
raw bodies. ``test_http_fuzz.py`` already drives every route from the schema (paths, query
parameters, JSON bodies); here dtype/shape/checksum headers, body lengths and chunking, and
Range headers are drawn. Never a 5xx, errors in the one shape, and after every request
nothing stays reserved or leased; a 201 means the bytes read back are the bytes sent.
"""

from __future__ import annotations

import math
import time
import uuid
import zlib
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from embcache.service.config import Settings
from embcache.service.engine import CacheEngine
from embcache.service.observability.metrics import Metrics
from embcache.service.transport.http.app import create_app
from embcache.service.transport.http.testing import serve_in_thread

PAGE = 4096
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "uint8": 1, "float64": 8}
DTYPES = list(ITEMSIZE)
ascii_text = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=24)
header_text = ascii_text.map(str.strip)  # HTTP drops surrounding whitespace
dims = st.lists(st.integers(min_value=-2, max_value=3000), max_size=9)
shapes = dims.map(lambda d: ",".join(map(str, d))) | header_text
# Keys are percent-encoded into the path; dots are left out (URL normalisation drops them).
keys = st.sampled_from(["a", "b/c", "d/data", "ü/x"]) | ascii_text.filter(lambda k: "." not in k)


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[CacheEngine, httpx.Client]]:
    s = Settings(
        host_pool_bytes=64 * PAGE,
        page_bytes=PAGE,
        shm_name=f"embcache-test-datafuzz-{uuid.uuid4().hex[:10]}",
        device="cpu",
        max_entry_bytes=16 * PAGE,
    )
    with CacheEngine(s) as engine:
        app = create_app(engine, s, Metrics(engine))
        with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=10) as client:
            yield engine, client


CREATED: list[str] = []


def settled(engine: CacheEngine) -> bool:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        s = engine.stats()
        if (s.leases_active, s.entries_filling, s.reserved_filling_bytes) == (0, 0, 0):
            return True
        time.sleep(0.01)
    return False


def check_error(resp: httpx.Response) -> None:
    assert resp.status_code < 500, resp.text
    if resp.status_code >= 400:
        assert set(resp.json()) == {"error", "code", "message", "details"}, resp.text


@st.composite
def uploads(draw: st.DrawFn) -> tuple[str, dict[str, str], bytes, bool]:
    if draw(st.booleans()):  # metadata and length that agree: the put should succeed
        dtype = draw(st.sampled_from(DTYPES))
        dims = draw(st.lists(st.integers(min_value=0, max_value=40), max_size=3))
        shape = ",".join(map(str, dims))
        size = ITEMSIZE[dtype] * math.prod(dims)
    else:
        dtype = draw(st.sampled_from(DTYPES) | header_text)
        shape = draw(shapes)
        size = draw(st.integers(min_value=0, max_value=4 * PAGE))
    headers = {"X-Embcache-Dtype": dtype, "X-Embcache-Shape": shape}
    body = draw(st.binary(min_size=size, max_size=size)) if size < 256 else b"\7" * size
    choice = draw(st.sampled_from(["none", "right", "wrong", "text"]))
    if choice == "right":
        headers["X-Embcache-Checksum"] = str(zlib.crc32(body))
    elif choice == "wrong":
        headers["X-Embcache-Checksum"] = str((zlib.crc32(body) + 1) % 2**32)
    elif choice == "text":
        headers["X-Embcache-Checksum"] = draw(header_text)
    return draw(keys), headers, body, draw(st.booleans())


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(upload=uploads())
def test_fuzz_put_headers_and_bodies(served: Any, upload: Any) -> None:
    engine, client = served
    key, headers, body, chunked = upload
    key = quote(key, safe="/")
    content: Any = iter([body[: len(body) // 2], body[len(body) // 2 :]]) if chunked else body
    resp = client.put(f"/v1/entries/{key}", headers=headers, content=content)
    check_error(resp)
    assert settled(engine)
    if resp.status_code == 201:
        CREATED.append(key)
        back = client.get(f"/v1/entries/{key}/data")
        assert back.status_code == 200 and back.content == body
        client.delete(f"/v1/entries/{key}")


ranges = (
    st.builds(lambda a, b: f"bytes={a}-{b}", st.integers(-5, 5000), st.integers(-5, 5000))
    | st.builds(lambda a: f"bytes={a}-", st.integers(0, 5000))
    | st.builds(lambda n: f"bytes=-{n}", st.integers(0, 5000))
    | header_text
)


@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(header=ranges)
def test_fuzz_range(served: Any, header: str) -> None:
    engine, client = served
    data = bytes(range(256)) * 12  # 3072 bytes
    if not engine.exists(["range/src"])[0]:
        client.put(
            "/v1/entries/range/src", params={"dtype": "uint8", "shape": "3072"}, content=data
        )
    resp = client.get("/v1/entries/range/src/data", headers={"Range": header})
    check_error(resp)
    if resp.status_code == 206:
        first, last = resp.headers["content-range"].split(" ")[1].split("/")[0].split("-")
        assert resp.content == data[int(first) : int(last) + 1]
    elif resp.status_code == 200:
        assert resp.content == data
    else:
        assert resp.status_code == 416, resp.text
    assert settled(engine)


def test_fuzz_created_entries(served: Any) -> None:
    assert len(CREATED) > 10  # the consistent half of the uploads really got stored
