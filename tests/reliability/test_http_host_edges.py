"""The HTTP plane's Host and Origin checks against the less obvious ways a request can name
its host or come from another site.

- HTTP/1.1 requires ``Host``: a request without one is refused (400), not served as if it
  had named the daemon.
- An absolute-form target (``GET http://attacker.example/... HTTP/1.1``) names the host
  itself; the server must use it and ignore ``Host``, so it is what gets checked.
- A browser's request from another site (``Sec-Fetch-Site: cross-site`` or ``same-site``,
  another port of localhost included) is refused unless it is a top-level navigation: an
  ``<img>`` or ``no-cors`` fetch on a page cannot read the bytes, but it would still count
  hits, move the LRU and take leases.

Raw sockets on loopback, every wait bounded.
"""

from __future__ import annotations

import json
import select
import socket
import time
from collections.abc import Iterator

import pytest
import torch

from embcache.service.config import Settings
from embcache.service.engine import CacheEngine
from embcache.service.observability.metrics import Metrics
from embcache.service.transport.http.app import create_app
from embcache.service.transport.http.testing import serve_in_thread


@pytest.fixture
def served(shm_name: str) -> Iterator[tuple[int, CacheEngine]]:
    settings = Settings(host_pool_bytes="4MiB", page_bytes="64KiB", shm_name=shm_name,
                        device="cpu", http_allowed_origins="https://dash.internal")  # fmt: skip
    with CacheEngine(settings) as engine:
        engine.put("k", torch.tensor([1, 2, 3, 4], dtype=torch.uint8))
        with serve_in_thread(create_app(engine, settings, Metrics(engine))) as url:
            yield int(url.rsplit(":", 1)[1]), engine


def _exchange(port: int, head: str, timeout: float = 10.0) -> tuple[int, bytes]:
    """Send one request (``Connection: close``), read the reply until the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(head.encode())
        deadline = time.monotonic() + timeout
        got = b""
        while time.monotonic() < deadline:
            chunk = sock.recv(65536)
            if not chunk:
                break
            got += chunk
    status = int(got.split(b"\r\n", 1)[0].split()[1])
    return status, got.split(b"\r\n\r\n", 1)[1]


def _request(method: str, target: str, *headers: str) -> str:
    return "\r\n".join([f"{method} {target} HTTP/1.1", *headers, "Connection: close", "", ""])


def _hits(engine: CacheEngine) -> int:
    return int(engine.stats().hits)


def test_http11_request_without_host_is_refused(served: tuple[int, CacheEngine]) -> None:
    port, engine = served
    before = _hits(engine)
    status, body = _exchange(port, _request("GET", "/v1/entries/k/data"))
    assert status == 400, body[:200]
    assert json.loads(body)["error"] == "InvalidArgument"
    assert b"\x01\x02\x03\x04" not in body and _hits(engine) == before
    # HTTP/1.0 has no Host requirement (and no browser sends it): served.
    status, body = _exchange(port, "GET /v1/entries/k/data HTTP/1.0\r\n\r\n")
    assert status == 200 and body == b"\x01\x02\x03\x04"


def test_absolute_form_target_names_the_host_checked(served: tuple[int, CacheEngine]) -> None:
    port = served[0]
    good = f"Host: 127.0.0.1:{port}"
    for target in (f"http://attacker.example:{port}/v1/entries/k/data",
                   "http://attacker.example/v1/stats",
                   f"http://localhost:{port + 1}/v1/stats"):  # fmt: skip
        status, body = _exchange(port, _request("GET", target, good))
        assert status == 403, (target, body[:200])
        assert json.loads(body)["error"] == "PermissionDenied"
    # A target naming the daemon is served, whatever Host says.
    for target in (f"http://127.0.0.1:{port}/v1/entries/k/data",
                   f"http://[::1]:{port}/v1/entries/k/data"):  # fmt: skip
        status, body = _exchange(port, _request("GET", target, "Host: attacker.example"))
        assert (status, body) == (200, b"\x01\x02\x03\x04"), (target, body[:200])


def test_requests_from_other_sites_are_refused(served: tuple[int, CacheEngine]) -> None:
    port, engine = served
    host = f"Host: 127.0.0.1:{port}"
    before = _hits(engine)
    for site in ("cross-site", "same-site", "CROSS-SITE"):
        for mode, dest in (("no-cors", "image"), ("cors", "empty"), ("navigate", "iframe")):
            fetch = (f"Sec-Fetch-Site: {site}", f"Sec-Fetch-Mode: {mode}",
                     f"Sec-Fetch-Dest: {dest}")  # fmt: skip
            for target in ("/v1/entries/k/data", "/v1/entries/k", "/v1/stats"):
                status, body = _exchange(port, _request("GET", target, host, *fetch))
                assert status == 403, (site, mode, target, body[:200])
                assert b"\x01\x02\x03\x04" not in body
    assert _hits(engine) == before
    # The daemon's own page, a typed URL or a link followed to a page, and clients that are
    # not browsers are served.
    for fetch in (("Sec-Fetch-Site: same-origin", "Sec-Fetch-Mode: cors"),
                  ("Sec-Fetch-Site: none", "Sec-Fetch-Mode: navigate", "Sec-Fetch-Dest: document"),
                  ("Sec-Fetch-Site: cross-site", "Sec-Fetch-Mode: navigate",
                   "Sec-Fetch-Dest: document"), ()):  # fmt: skip
        status, body = _exchange(port, _request("GET", "/v1/entries/k/data", host, *fetch))
        assert (status, body) == (200, b"\x01\x02\x03\x04"), fetch
    # A write from an origin the operator allowed is a cross-site request too: served.
    allowed = ("Origin: https://dash.internal", "Sec-Fetch-Site: cross-site",
               "Sec-Fetch-Mode: cors", "Content-Type: application/json",
               "Content-Length: 12")  # fmt: skip
    status, body = _exchange(port, _request("POST", "/v1/evict", host, *allowed) + '{"keys": []}')
    assert status == 200, body[:200]
    # A navigation that writes (a cross-site form POST) is refused.
    form = ("Sec-Fetch-Site: cross-site", "Sec-Fetch-Mode: navigate", "Sec-Fetch-Dest: document",
            "Content-Type: text/plain", "Content-Length: 12")  # fmt: skip
    status, body = _exchange(port, _request("POST", "/v1/evict", host, *form) + '{"keys": []}')
    assert status == 403, body[:200]


def test_websocket_upgrades_go_through_the_checks(served: tuple[int, CacheEngine]) -> None:
    """The HTTP plane serves no WebSocket: an upgrade request is a plain request, so the Host
    check answers it like any other (no second protocol stack before the checks)."""
    port = served[0]
    upgrade = ("Upgrade: websocket", "Connection: Upgrade, close", "Sec-WebSocket-Version: 13",
               "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==")  # fmt: skip
    for target in ("/v1/entries/k/data", "/static/poolmap.js", "/"):
        head = "\r\n".join([f"GET {target} HTTP/1.1", "Host: attacker.example", *upgrade, "", ""])
        status, body = _exchange(port, head)
        assert status == 403, (target, body[:200])
        assert json.loads(body)["error"] == "PermissionDenied"


def test_connections_past_the_bound_are_closed_at_once(shm_name: str) -> None:
    """Connections that never send a head, past twice ``http_max_concurrency``: closed when
    they open, not held until the header timeout (file descriptors the gRPC listener, the
    session socket and the pools also need). Up to twice the bound, a request gets its 503."""
    settings = Settings(host_pool_bytes="4MiB", page_bytes="64KiB", shm_name=shm_name,
                        device="cpu", http_max_concurrency=4, http_header_timeout_s=60)  # fmt: skip
    with (
        CacheEngine(settings) as engine,
        serve_in_thread(create_app(engine, settings, Metrics(engine))) as url,
    ):
        port = int(url.rsplit(":", 1)[1])
        socks = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(40)]
        try:
            deadline = time.monotonic() + 10  # far less than the 60 s header timeout
            open_ = list(socks)
            while len(open_) > 8 and time.monotonic() < deadline:
                ready = select.select(open_, [], [], 0.2)[0]
                for sock in ready:
                    try:
                        gone = sock.recv(65536, socket.MSG_PEEK) == b""
                    except ConnectionResetError:
                        gone = True
                    if gone:
                        open_.remove(sock)
            assert len(open_) == 8, len(open_)
        finally:
            for sock in socks:
                sock.close()
