"""Malformed input to the operator plane: named kinds of REST requests (hand-made bodies and
parameters, wrong methods and routes, schema-driven values from the app's own OpenAPI) and
raw bytes for both listeners (broken HTTP/1.1, HTTP/2 and TLS sent to the wrong port).
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from hypothesis import strategies as st

Draw = Callable[[st.SearchStrategy[Any]], Any]
FIXED, LEASED = "fixed-f16", "fixed-leased"
ANY = frozenset(range(200, 500))  # schema fuzzing: anything but a 5xx


@dataclass
class Req:
    method: str
    path: str
    expected: frozenset[int]
    body: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)
    params: dict[str, Any] | None = None


KINDS: dict[str, Callable[[Draw], Req]] = {}


def kind(name: str) -> Callable[[Callable[[Draw], Req]], Callable[[Draw], Req]]:
    def register(fn: Callable[[Draw], Req]) -> Callable[[Draw], Req]:
        assert name not in KINDS, name
        KINDS[name] = fn
        return fn

    return register


def one(*codes: int) -> frozenset[int]:
    return frozenset(codes)


JSON = {"content-type": "application/json"}
INTS_BAD = st.sampled_from(["x", "1.5", "", "1e3", "0x10", "NaN", "1 1", "--1"])

# -- query parameters ------------------------------------------------------------------------
PARAMS: dict[str, tuple[str, str, st.SearchStrategy[Any]]] = {
    "entries_offset_negative": ("/v1/entries", "offset", st.integers(max_value=-1)),
    "entries_offset_not_int": ("/v1/entries", "offset", INTS_BAD),
    "entries_offset_huge": ("/v1/entries", "offset", st.integers(min_value=2**62 + 1)),
    "entries_limit_zero_or_less": ("/v1/entries", "limit", st.integers(max_value=0)),
    "entries_limit_over_1000": ("/v1/entries", "limit", st.integers(min_value=1001)),
    "entries_limit_not_int": ("/v1/entries", "limit", INTS_BAD),
    "entries_state_unknown": ("/v1/entries", "state", st.sampled_from(["READY", "busy", "", "*"])),
    "entries_tier_unknown": ("/v1/entries", "tier", st.sampled_from(["gpu", "HOST", "disk", "0"])),
    "entries_sort_unknown": ("/v1/entries", "sort", st.sampled_from(["lru", "SIZE", "-size", "1"])),
    "poolmap_max_cells_small": ("/v1/pool-map", "max_cells", st.integers(max_value=15)),
    "poolmap_max_cells_large": ("/v1/pool-map", "max_cells", st.integers(min_value=16385)),
    "poolmap_max_cells_not_int": ("/v1/pool-map", "max_cells", INTS_BAD),
}
for _name, (_path, _param, _values) in PARAMS.items():

    def _param_kind(draw: Draw, path: str = _path, p: str = _param, v: Any = _values) -> Req:
        return Req("GET", path, one(422), params={p: str(draw(v))})

    kind(f"rest/{_name}")(_param_kind)

# -- bodies of POST /v1/evict -------------------------------------------------------------------
BODIES: dict[str, st.SearchStrategy[bytes]] = {
    "not_json": st.sampled_from([b"notjson", b"{", b"{'keys': []}", b"\xff\xfe", b"{]}"]),
    "empty": st.just(b""),
    "json_array": st.just(b'["a", "b"]'),
    "json_scalar": st.sampled_from([b'"x"', b"1", b"null", b"true"]),
    "keys_not_a_list": st.sampled_from([b'{"keys": "a"}', b'{"keys": 1}', b'{"keys": {}}']),
    "keys_not_strings": st.sampled_from([b'{"keys": [1]}', b'{"keys": [null]}', b'{"keys": [[]]}']),
    "keys_too_many": st.just(b'{"keys": [' + b",".join([b'"k"'] * 10_001) + b"]}"),
    "bytes_negative": st.integers(max_value=-1).map(lambda n: b'{"bytes": %d}' % n),
    "bytes_bad_unit": st.sampled_from(
        [b'{"bytes": "1XiB"}', b'{"bytes": "GiB"}', b'{"bytes": "-1GiB"}']
    ),
    "bytes_fractional": st.sampled_from([b'{"bytes": 1.5}', b'{"bytes": "0.5B"}']),
    "bytes_boolean": st.sampled_from([b'{"bytes": true}', b'{"bytes": false}']),
    "keys_and_bytes": st.just(b'{"keys": ["a"], "bytes": 1}'),
    "neither_keys_nor_bytes": st.sampled_from([b"{}", b'{"keys": null}', b'{"bytes": null}']),
    "unknown_field": st.sampled_from([b'{"zzz": 1}', b'{"keys": [], "force": true}']),
    "deeply_nested": st.integers(50, 400).map(lambda n: b'{"keys": ' + b"[" * n + b"]" * n + b"}"),
}
for _name, _body in BODIES.items():

    def _body_kind(draw: Draw, b: st.SearchStrategy[bytes] = _body) -> Req:
        return Req("POST", "/v1/evict", one(422), body=draw(b), headers=JSON)

    kind(f"rest/evict_body_{_name}")(_body_kind)


@kind("rest/evict_body_wrong_content_type")
def _(draw: Draw) -> Req:
    ctype = draw(st.sampled_from(["text/plain", "application/x-www-form-urlencoded", "image/png"]))
    return Req(
        "POST", "/v1/evict", one(422), body=b'{"keys": ["a"]}', headers={"content-type": ctype}
    )


# -- methods, routes, keys ----------------------------------------------------------------------
for _method, _path in [
    ("PUT", "/v1/stats"),
    ("POST", "/v1/stats"),
    ("DELETE", "/v1/stats"),
    ("GET", "/v1/evict"),
    ("PUT", "/v1/evict"),
    ("PATCH", "/v1/entries/k"),
    ("POST", "/v1/entries/k"),
    ("POST", "/livez"),
    ("DELETE", "/metrics"),
]:

    def _method_kind(draw: Draw, m: str = _method, p: str = _path) -> Req:
        return Req(m, p, one(405))

    kind(f"rest/method_not_allowed_{_method}_{_path.strip('/').replace('/', '_')}")(_method_kind)


@kind("rest/unknown_route")
def _(draw: Draw) -> Req:
    tail = draw(st.text("abcdefghijklmnopqrstuvwxyz0123456789-_", min_size=1, max_size=20))
    prefix = draw(st.sampled_from(["/v2/", "/v1/stats/", "/api/", "/v1/x"]))
    return Req("GET", prefix + tail, one(404))


@kind("rest/entry_missing")
def _(draw: Draw) -> Req:
    key = quote("absent-" + draw(st.text(min_size=1, max_size=30)), safe="")
    return Req(draw(st.sampled_from(["GET", "DELETE"])), f"/v1/entries/{key}", one(404))


@kind("rest/entry_key_control_chars")
def _(draw: Draw) -> Req:
    key = quote(draw(st.sampled_from(["\x00", "a\x00b", "\x7f", "\n", "%"])), safe="")
    return Req("GET", f"/v1/entries/{key}", one(404))


@kind("rest/entry_key_traversal")
def _(draw: Draw) -> Req:
    key = draw(st.sampled_from(["..%2F..%2Fetc%2Fpasswd", "%2e%2e/%2e%2e/x", "a/../../b"]))
    return Req("GET", f"/v1/entries/{key}", one(404))


@kind("rest/entry_key_huge")
def _(draw: Draw) -> Req:
    return Req("GET", "/v1/entries/" + "k" * draw(st.integers(2_000, 30_000)), one(404))


@kind("rest/delete_leased_entry")
def _(draw: Draw) -> Req:
    return Req("DELETE", f"/v1/entries/{LEASED}", one(409))


# -- raw bytes on a socket ----------------------------------------------------------------------
@dataclass
class Raw:
    port: str  # "http" or "grpc"
    data: bytes
    expect: str  # "http400": an HTTP/1.1 400 reply; "closed_or_h2": no HTTP/1.1 success


RAW: dict[str, Callable[[Draw], Raw]] = {}


def raw_kind(name: str, port: str, expect: str, data: st.SearchStrategy[bytes]) -> None:
    RAW[name] = lambda draw: Raw(port, draw(data), expect)


H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
TLS_HELLO = b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + b"\x00" * 32
raw_kind(
    "raw/http/bad_request_line",
    "http",
    "http400",
    st.sampled_from([b"GARBAGE\r\n\r\n", b"GET\r\n\r\n", b"GET / HTTP/9.9\r\n\r\n"]),
)
raw_kind(
    "raw/http/header_without_colon",
    "http",
    "http400",
    st.just(b"GET /livez HTTP/1.1\r\nHost x\r\n\r\n"),
)
raw_kind(
    "raw/http/content_length_not_a_number",
    "http",
    "http400",
    st.sampled_from([b"abc", b"-1", b"1,2", b"0x10"]).map(
        lambda v: b"POST /v1/evict HTTP/1.1\r\nHost: [::1]\r\nContent-Length: " + v + b"\r\n\r\n"
    ),
)
raw_kind(
    "raw/http/chunked_garbage",
    "http",
    "http400",
    st.just(b"POST /v1/evict HTTP/1.1\r\nHost: [::1]\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"),
)
raw_kind("raw/http/http2_preface", "http", "http400", st.just(H2_PREFACE))
raw_kind("raw/http/tls_client_hello", "http", "http400", st.just(TLS_HELLO))
raw_kind(
    "raw/http/nul_bytes",
    "http",
    "http400",
    st.binary(min_size=1, max_size=64).map(lambda b: b"\x00" + b + b"\r\n\r\n"),
)
raw_kind(
    "raw/grpc/http1_request",
    "grpc",
    "closed_or_h2",
    st.sampled_from(
        [
            b"GET / HTTP/1.1\r\nHost: [::1]\r\n\r\n",
            b"POST /embcache.v1.EmbeddingCache/Stats HTTP/1.1\r\n"
            b"Host: [::1]\r\nContent-Length: 0\r\n\r\n",
        ]
    ),
)
raw_kind("raw/grpc/tls_client_hello", "grpc", "closed_or_h2", st.just(TLS_HELLO))
raw_kind("raw/grpc/garbage", "grpc", "closed_or_h2", st.binary(min_size=1, max_size=256))
raw_kind(
    "raw/grpc/h2_preface_then_garbage",
    "grpc",
    "closed_or_h2",
    st.binary(min_size=1, max_size=64).map(lambda b: H2_PREFACE + b"\xff" * 9 + b),
)


def send_raw(port: int, data: bytes, timeout: float = 3.0) -> bytes:
    """Send bytes on a fresh loopback connection; what came back until close or timeout."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        except OSError:
            return b""
        out = b""
        try:
            while len(out) < 65536 and (got := s.recv(65536)):
                out += got
        except (TimeoutError, OSError):
            pass
        return out


def raw_ok(reply: bytes, expect: str) -> bool:
    if expect == "http400":
        return reply.startswith(b"HTTP/1.1 400")
    return not reply.startswith(b"HTTP/1.") or reply.startswith(b"HTTP/1.1 4")


# -- schema fuzzing over /openapi.json ----------------------------------------------------------
def from_schema(schema: dict[str, Any], spec: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values for a JSON schema (the subset FastAPI emits), plus arbitrary JSON."""
    if "$ref" in schema:
        return from_schema(spec["components"]["schemas"][schema["$ref"].rsplit("/", 1)[-1]], spec)
    for comb in ("anyOf", "oneOf"):
        if comb in schema:
            return st.one_of([from_schema(s, spec) for s in schema[comb]])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    t = schema.get("type")
    simple = {
        "string": st.text(max_size=30),
        "integer": st.integers(),
        "number": st.floats(allow_nan=False),
        "boolean": st.booleans(),
        "null": st.none(),
    }
    if t in simple:
        return simple[t]
    if t == "array":
        return st.lists(from_schema(schema.get("items", {}), spec), max_size=4)
    if t == "object" or "properties" in schema:
        props = {k: from_schema(v, spec) for k, v in schema.get("properties", {}).items()}
        return st.fixed_dictionaries({}, optional=props)
    return st.none() | st.integers() | st.text(max_size=10)


def register_schema_kinds(spec: dict[str, Any]) -> list[str]:
    """One kind per operation of the OpenAPI document: parameters and bodies drawn from its
    schemas (valid or not); the daemon must answer without a 5xx."""
    names = []
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            name = f"rest/schema_{method.upper()}_{path}"
            params = [p for p in op.get("parameters", ()) if p["in"] == "query"]
            path_params = [p["name"] for p in op.get("parameters", ()) if p["in"] == "path"]
            body = op.get("requestBody", {}).get("content", {}).get("application/json", {})

            def build(
                draw: Draw,
                path: str = path,
                method: str = method,
                params: list[Any] = params,
                path_params: list[str] = path_params,
                body: dict[str, Any] = body,
            ) -> Req:
                url = path
                for p in path_params:
                    key = draw(
                        st.sampled_from([FIXED, LEASED, "absent", "a/b"])
                        | st.text(min_size=1, max_size=20)
                    )
                    url = url.replace("{" + p + "}", quote(key, safe="/")).replace(
                        "{" + p + ":path}", quote(key, safe="/")
                    )
                query = {
                    p["name"]: draw(from_schema(p.get("schema", {}), spec) | st.text(max_size=8))
                    for p in params
                    if draw(st.booleans())
                }
                data = None
                if body:
                    import json

                    data = json.dumps(draw(from_schema(body.get("schema", {}), spec))).encode()
                return Req(
                    method.upper(),
                    url,
                    ANY,
                    body=data,
                    headers=JSON,
                    params={k: str(v) for k, v in query.items()},
                )

            KINDS[name] = build
            names.append(name)
    return names
