"""Malformed REST uploads: each is refused and leaves nothing behind.

After every case the pool is as before: no new entry, nothing FILLING, no reserved bytes,
the same pages in use. Cases that pass admission reserve pages and must abort them (the
engine's ``puts_aborted`` counts those). Truncated and dropped uploads use raw sockets
against a real uvicorn server, so the connection really ends mid-body.
"""

from __future__ import annotations

import socket
import struct
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import torch

from embcache.service.config import Settings
from embcache.service.engine import CacheEngine
from embcache.service.observability.metrics import Metrics
from embcache.service.transport.http.app import create_app
from embcache.service.transport.http.testing import serve_in_thread

PAGE = 4096
NBYTES = 3 * 1049 * 4  # a float32 entry of shape (3, 1049): about 3 pages
GOOD = {"X-Embcache-Dtype": "float32", "X-Embcache-Shape": "3,1049"}
BODY = bytes(range(256)) * (NBYTES // 256) + bytes(NBYTES % 256)


@dataclass
class Served:
    engine: CacheEngine
    client: httpx.Client
    port: int


@pytest.fixture
def served(shm_name: str) -> Iterator[Served]:
    s = Settings(
        host_pool_bytes=64 * PAGE,
        page_bytes=PAGE,
        shm_name=shm_name,
        device="cpu",
        max_entry_bytes=32 * PAGE,
    )
    with CacheEngine(s) as engine:
        engine.put("existing", torch.ones(PAGE // 4))
        app = create_app(engine, s, Metrics(engine))
        with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=10) as client:
            yield Served(engine, client, int(url.rsplit(":", 1)[1]))


def snapshot(engine: CacheEngine) -> tuple[int, ...]:
    s = engine.stats()
    return (s.host.used_pages, s.entries_ready, s.entries_filling, s.reserved_filling_bytes)


def assert_nothing_reserved(engine: CacheEngine, before: tuple[int, ...], key: str) -> None:
    deadline = time.monotonic() + 10
    while snapshot(engine) != before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert snapshot(engine) == before
    assert engine.exists([key]) == [False]
    assert engine.stats().leases_active == 0


def chunks(data: bytes, size: int = 1000) -> Iterator[bytes]:  # a chunked body
    for i in range(0, len(data), size):
        yield data[i : i + size]


CASES: list[tuple[str, dict[str, str], Any, int, str, bool]] = [
    # id, headers, body, status, error, reserves pages first
    ("short", GOOD, BODY[:-1], 400, "InvalidArgument", False),
    ("long", GOOD, BODY + b"x", 400, "InvalidArgument", False),
    ("short-chunked", GOOD, lambda: chunks(BODY[:-10]), 400, "InvalidArgument", True),
    ("long-chunked", GOOD, lambda: chunks(BODY + b"extra"), 400, "InvalidArgument", True),
    ("bad-dtype", {**GOOD, "X-Embcache-Dtype": "float33"}, BODY, 400, "InvalidArgument", False),
    ("no-dtype", {"X-Embcache-Shape": "3,1049"}, BODY, 400, "InvalidArgument", False),
    ("no-shape", {"X-Embcache-Dtype": "float32"}, BODY, 400, "InvalidArgument", False),
    ("shape-word", {**GOOD, "X-Embcache-Shape": "3,x"}, BODY, 400, "InvalidArgument", False),
    ("shape-neg", {**GOOD, "X-Embcache-Shape": "-3,1049"}, BODY, 400, "InvalidArgument", False),
    ("shape-semi", {**GOOD, "X-Embcache-Shape": "3;1049"}, BODY, 400, "InvalidArgument", False),
    ("shape-gap", {**GOOD, "X-Embcache-Shape": "3,,1049"}, BODY, 400, "InvalidArgument", False),
    ("shape-9d", {**GOOD, "X-Embcache-Shape": ",".join("1" * 9)}, BODY, 400, "", False),
    ("shape-20dig", {**GOOD, "X-Embcache-Shape": "9" * 20}, BODY, 400, "InvalidArgument", False),
    ("shape-ovf", {**GOOD, "X-Embcache-Shape": "999999999,999999999,99999999"}, BODY, 400, "", 0),
    ("huge", {**GOOD, "X-Embcache-Shape": "1000000,1000000"}, BODY, 413, "EntryTooLarge", False),
    ("crc-wrong", {**GOOD, "X-Embcache-Checksum": "12345"}, BODY, 400, "ChecksumMismatch", True),
    ("crc-word", {**GOOD, "X-Embcache-Checksum": "abc"}, BODY, 400, "InvalidArgument", False),
    ("crc-hex", {**GOOD, "X-Embcache-Checksum": "0xZZ"}, BODY, 400, "InvalidArgument", False),
    ("crc-big", {**GOOD, "X-Embcache-Checksum": str(2**32)}, BODY, 400, "InvalidArgument", False),
    ("crc-neg", {**GOOD, "X-Embcache-Checksum": "-1"}, BODY, 400, "InvalidArgument", False),
    ("conflict", {**GOOD, "X-Embcache-Shape": "1049,3"}, BODY, 409, "MetadataConflict", False),
]


@pytest.mark.parametrize(
    ("headers", "body", "status", "error", "reserves"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_malformed_upload(
    served: Served, headers: dict[str, str], body: Any, status: int, error: str, reserves: bool
) -> None:
    engine = served.engine
    key = "existing" if error == "MetadataConflict" else "k/new"
    before, aborted = snapshot(engine), engine.stats().puts_aborted
    content = body() if callable(body) else body
    r = served.client.put(f"/v1/entries/{key}", headers=headers, content=content)
    assert r.status_code == status, r.text
    assert set(r.json()) == {"error", "code", "message", "details"}
    if error:
        assert r.json()["error"] == error, r.text
    if key != "existing":
        assert_nothing_reserved(engine, before, key)
    assert engine.stats().puts_aborted == aborted + int(reserves)


def test_bad_key_and_query_conflict(served: Served) -> None:
    before = snapshot(served.engine)
    r = served.client.put("/v1/entries/", headers=GOOD, content=BODY)  # empty key
    assert r.status_code == 400, r.text
    r = served.client.put("/v1/entries/" + "k" * 2000, headers=GOOD, content=BODY)
    assert r.status_code == 400 and "too long" in r.json()["message"]
    r = served.client.put("/v1/entries/k/new", headers=GOOD, params={"dtype": "int8"}, content=BODY)
    assert r.status_code == 400
    assert_nothing_reserved(served.engine, before, "k/new")


def test_crc_right_is_accepted(served: Served) -> None:
    crc = {"X-Embcache-Checksum": str(zlib.crc32(BODY))}
    r = served.client.put("/v1/entries/k/new", headers={**GOOD, **crc}, content=BODY)
    assert r.status_code == 201, r.text


def raw_put(port: int, key: str, length: int, extra: str = "") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    head = (
        f"PUT /v1/entries/{key} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {length}\r\n"
        f"X-Embcache-Dtype: float32\r\nX-Embcache-Shape: {length // 4}\r\n{extra}\r\n"
    )
    sock.sendall(head.encode())
    return sock


def wait_for(cond: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_truncated_body_aborts(served: Served) -> None:
    engine = served.engine
    before, aborted = snapshot(engine), engine.stats().puts_aborted
    sock = raw_put(served.port, "trunc", NBYTES)
    sock.sendall(BODY[: NBYTES // 2])
    wait_for(lambda: engine.stats().entries_filling == 1)  # pages reserved, bytes arriving
    sock.shutdown(socket.SHUT_WR)  # the body ends early: EOF before Content-Length bytes
    wait_for(lambda: engine.stats().puts_aborted == aborted + 1)
    sock.close()
    assert_nothing_reserved(engine, before, "trunc")


def test_dropped_connection_aborts(served: Served) -> None:
    engine = served.engine
    before, aborted = snapshot(engine), engine.stats().puts_aborted
    length = 8 * PAGE
    sock = raw_put(served.port, "dropped", length)
    sock.sendall(b"\1" * (length // 3))
    wait_for(lambda: engine.stats().entries_filling == 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()  # RST mid-body
    wait_for(lambda: engine.stats().puts_aborted == aborted + 1)
    assert_nothing_reserved(engine, before, "dropped")
    # the server is fine afterwards
    r = served.client.put("/v1/entries/after", headers=GOOD, content=BODY)
    assert r.status_code == 201


def test_huge_declared_size_is_refused_before_the_body(served: Served) -> None:
    before = snapshot(served.engine)
    length = 1 << 40  # a terabyte nobody will send
    sock = raw_put(served.port, "huge", length, "Expect: 100-continue\r\n")
    try:
        reply = sock.recv(65536)  # answered without reading (or asking for) any body byte
    finally:
        sock.close()
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert b"100 Continue" not in reply
    assert_nothing_reserved(served.engine, before, "huge")


@pytest.mark.parametrize(
    ("path", "body"),
    [("/v1/get", {"keys": ["existing"], "ttl_s": True}),
     ("/v1/get", {"keys": ["existing"], "ttl_s": "5"}),
     ("/v1/renew", {"lease_ids": [1], "ttl_s": False}),
     ("/v1/evict", {"keys": ["existing"], "device": True})],
)  # fmt: skip
def test_json_booleans_and_strings_are_not_numbers(
    served: Served, path: str, body: dict[str, Any]
) -> None:
    """JSON ``true`` is not the number 1 (the schema says "number"): refused, nothing taken."""
    r = served.client.post(path, json=body)
    assert r.status_code == 422, r.text
    assert r.json()["error"] == "ValidationError"
    assert served.engine.stats().leases_active == 0
    assert served.engine.stats().entries_ready == 1  # "existing" neither leased nor evicted
