"""The HTTP plane against hostile browsers and slow clients.

- DNS rebinding: a page whose name is re-pointed at 127.0.0.1 sends its own name as ``Host``;
  the daemon refuses every such request (403 in the API's error shape) before any route runs,
  so the page can neither list keys, nor read bytes, nor evict.
- Cross-site writes: a state-changing request carrying a foreign ``Origin`` is refused.
- Slow and idle connections: a request head that never completes, a connection that sends
  nothing and an idle keep-alive connection are closed within their bounds; past the
  concurrency bound a request is answered 503 at once.

Raw sockets on loopback, every wait bounded.
"""

from __future__ import annotations

import json
import select
import socket
import time
from collections.abc import Iterator

import httpx
import pytest
import torch
from pydantic import ValidationError

from embcache.service.config import Settings
from embcache.service.daemon_process import DaemonProcess
from embcache.service.engine import CacheEngine
from embcache.service.observability.metrics import Metrics
from embcache.service.transport.http.app import create_app
from embcache.service.transport.http.testing import serve_in_thread

FLAGS = ["--host-pool-bytes", "16MiB", "--page-bytes", "64KiB", "--device", "cpu"]
KEY = "secret/embedding"


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    """A daemon with default HTTP settings and no token: the set-up DNS rebinding targets."""
    proc = DaemonProcess(FLAGS, timeout=60)
    try:
        yield proc
    finally:
        assert proc.stop(timeout=30) == 0


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _put(url: str, key: str = KEY) -> None:
    reply = httpx.put(f"{url}/v1/entries/{key}?dtype=uint8&shape=4", content=b"abcd", timeout=10)
    assert reply.status_code in (200, 201), reply.text


def _refused(reply: httpx.Response, what: str) -> None:
    assert reply.status_code == 403, (what, reply.status_code, reply.text[:300])
    body = reply.json()
    assert set(body) == {"error", "code", "message", "details"}, body
    assert body["error"] == "PermissionDenied" and body["code"] == "PERMISSION_DENIED"


def test_rebound_host_gets_nothing(daemon: DaemonProcess) -> None:
    url, port = daemon.http_url, _port(daemon.http_url)
    _put(url)
    # What the browser sends once attacker.example resolves to 127.0.0.1.
    for host in (f"attacker.example:{port}", "attacker.example", f"localhost.evil.example:{port}",
                 f"127.0.0.1.nip.io:{port}", f"localhost:{port + 1}", f"0.0.0.0:{port}",
                 "localhost@attacker.example", ""):  # fmt: skip
        headers = {"Host": host}
        with httpx.Client(base_url=url, headers=headers, timeout=10) as rebound:
            for method, path, body in (
                ("GET", "/v1/entries", None),
                ("GET", f"/v1/entries/{KEY}", None),
                ("GET", f"/v1/entries/{KEY}/data", None),
                ("GET", "/v1/stats", None),
                ("GET", "/metrics", None),
                ("GET", "/", None),
                ("GET", "/openapi.json", None),
                ("POST", "/v1/evict", {"bytes": 2**40}),
                ("DELETE", f"/v1/entries/{KEY}", None),
                ("POST", "/v1/get", {"keys": [KEY]}),
            ):
                reply = rebound.request(method, path, json=body)
                _refused(reply, f"{method} {path} Host={host!r}")
                assert KEY.encode() not in reply.content and b"abcd" not in reply.content
    # Nothing ran: the entry is there, with its bytes.
    assert httpx.get(f"{url}/v1/entries/{KEY}/data", timeout=10).content == b"abcd"


def test_the_daemons_own_names_are_served(daemon: DaemonProcess) -> None:
    url, port = daemon.http_url, _port(daemon.http_url)
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"LOCALHOST:{port}", f"[::1]:{port}",
                 f"localhost.:{port}"):  # fmt: skip
        reply = httpx.get(f"{url}/v1/stats", headers={"Host": host}, timeout=10)
        assert reply.status_code == 200, (host, reply.text[:200])


def test_two_host_headers_are_refused(daemon: DaemonProcess) -> None:
    port = _port(daemon.http_url)
    head = (f"GET /v1/stats HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nHost: attacker.example\r\n"
            "Connection: close\r\n\r\n")  # fmt: skip
    reply = _raw_exchange(port, head.encode())
    assert reply.split(b"\r\n", 1)[0].split()[1] in (b"400", b"403"), reply[:200]


def test_writes_from_another_origin_are_refused(daemon: DaemonProcess) -> None:
    url, port = daemon.http_url, _port(daemon.http_url)
    _put(url, "origin/victim")
    for origin in ("http://localhost:8000", "https://attacker.example", "null",
                   f"https://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"):  # fmt: skip
        headers = {"Origin": origin}
        _refused(httpx.post(f"{url}/v1/evict", json={"bytes": 2**40}, headers=headers), origin)
        _refused(httpx.delete(f"{url}/v1/entries/origin/victim", headers=headers), origin)
        put = httpx.put(f"{url}/v1/entries/origin/new?dtype=uint8&shape=1", content=b"x",
                        headers=headers)  # fmt: skip
        _refused(put, origin)
    assert httpx.get(f"{url}/v1/entries/origin/victim", timeout=10).status_code == 200
    assert httpx.get(f"{url}/v1/entries/origin/new", timeout=10).status_code == 404
    # The daemon's own page (same origin) may write; reads carry no Origin check (a browser
    # keeps another site's page from reading them).
    same = {"Origin": url}
    assert httpx.post(f"{url}/v1/evict", json={"keys": ["none"]}, headers=same).status_code == 200
    foreign = {"Origin": "http://localhost:8000"}
    assert httpx.get(f"{url}/v1/stats", headers=foreign).status_code == 200


def _raw_exchange(port: int, data: bytes, timeout: float = 10.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        return _read_until_closed(sock, timeout)


def _read_until_closed(sock: socket.socket, timeout: float) -> bytes:
    """Everything the server sends until it closes; TimeoutError if it stays open."""
    deadline = time.monotonic() + timeout
    got = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"still open after {timeout} s; got {got[:200]!r}")
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            raise TimeoutError(f"still open after {timeout} s; got {got[:200]!r}") from None
        except ConnectionResetError:
            return got
        if not chunk:
            return got
        got += chunk


def test_unfinished_request_head_is_closed_by_the_daemon(daemon: DaemonProcess) -> None:
    """The default header timeout (5 s) holds in the daemon itself: a partial request line,
    and a connection that sends nothing, are closed well within 15 s."""
    port = _port(daemon.http_url)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as partial, \
            socket.create_connection(("127.0.0.1", port), timeout=5) as silent:  # fmt: skip
        partial.sendall(b"GET /v1/stats HT")
        start = time.monotonic()
        got = _read_until_closed(partial, 15)
        assert got.startswith(b"HTTP/1.1 408 "), got[:200]
        assert json.loads(got.split(b"\r\n\r\n", 1)[1])["error"] == "IdleTimeout"
        assert _read_until_closed(silent, 15 - (time.monotonic() - start)) == b""


@pytest.fixture
def guarded(shm_name: str) -> Iterator[tuple[str, CacheEngine]]:
    settings = Settings(host_pool_bytes="4MiB", page_bytes="64KiB", shm_name=shm_name,
                        device="cpu", http_header_timeout_s=1, http_keepalive_timeout_s=1,
                        http_max_concurrency=4)  # fmt: skip
    with CacheEngine(settings) as engine:
        engine.put("a", torch.ones(4, dtype=torch.uint8))
        with serve_in_thread(create_app(engine, settings, Metrics(engine))) as url:
            yield url, engine


def test_slow_heads_and_idle_connections_are_closed(guarded: tuple[str, CacheEngine]) -> None:
    port = _port(guarded[0])
    host = f"Host: 127.0.0.1:{port}\r\n"
    # A head trickled a byte at a time, each well within any per-read timeout: the head's
    # deadline counts from the connection's start, so it is closed all the same.
    with socket.create_connection(("127.0.0.1", port), timeout=5) as slow:
        start = time.monotonic()
        for byte in f"GET /v1/stats HTTP/1.1\r\n{host}X-Padding: {'a' * 80}".encode():
            if select.select([slow], [], [], 0.05)[0]:  # the server answered or closed
                break
            slow.sendall(bytes([byte]))
        got = _read_until_closed(slow, 5)
        assert got.startswith(b"HTTP/1.1 408 "), got[:200]
        assert time.monotonic() - start < 4  # 1 s allowed; a per-read timeout never fires
    # An idle keep-alive connection is closed after its response.
    with socket.create_connection(("127.0.0.1", port), timeout=5) as idle:
        idle.sendall(f"GET /livez HTTP/1.1\r\n{host}\r\n".encode())
        got = _read_until_closed(idle, 6)
        assert got.startswith(b"HTTP/1.1 200 ") and got.count(b"HTTP/1.1") == 1, got[:200]
    # A complete request on a fresh connection is answered as usual.
    assert httpx.get(f"{guarded[0]}/v1/entries/a", timeout=5).status_code == 200


def test_requests_beyond_the_concurrency_bound_get_503(guarded: tuple[str, CacheEngine]) -> None:
    url, port = guarded[0], _port(guarded[0])
    holders = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(4)]
    try:
        time.sleep(0.2)  # the server has accepted them
        reply = httpx.get(f"{url}/v1/stats", timeout=5)
        assert reply.status_code == 503, reply.text[:200]
        assert reply.json()["code"] == "UNAVAILABLE" and reply.headers["retry-after"] == "1"
    finally:
        for sock in holders:
            sock.close()
    deadline = time.monotonic() + 5
    while (status := httpx.get(f"{url}/v1/stats", timeout=5).status_code) == 503:
        assert time.monotonic() < deadline, "the bound did not free up"
        time.sleep(0.05)
    assert status == 200


def test_allowed_hosts_and_origins_settings(shm_name: str) -> None:
    settings = Settings(host_pool_bytes="4MiB", page_bytes="64KiB", shm_name=shm_name,
                        device="cpu", http_allowed_hosts="cache.internal, tunnel:8080",
                        http_allowed_origins="https://dash.internal")  # fmt: skip
    with (
        CacheEngine(settings) as engine,
        serve_in_thread(create_app(engine, settings, Metrics(engine))) as url,
    ):
        for host, status in (("cache.internal:9999", 200), ("cache.internal", 200),
                             ("tunnel:8080", 200), ("tunnel:8081", 403), ("tunnel", 403),
                             ("other.internal", 403)):  # fmt: skip
            got = httpx.get(f"{url}/v1/stats", headers={"Host": host}, timeout=5).status_code
            assert got == status, host
        dash = {"Origin": "https://dash.internal"}
        assert httpx.post(f"{url}/v1/evict", json={"keys": []}, headers=dash).status_code == 200
        other = {"Origin": "https://dash.internal:8443"}
        assert httpx.post(f"{url}/v1/evict", json={"keys": []}, headers=other).status_code == 403
    for bad in ("http://x", "a b", "host:port", "*.internal"):
        with pytest.raises(ValidationError, match="http_allowed_hosts"):
            Settings(http_allowed_hosts=bad)
    with pytest.raises(ValidationError, match="http_allowed_origins"):
        Settings(http_allowed_origins="dash.internal")


def test_endless_request_head_is_refused(guarded: tuple[str, CacheEngine]) -> None:
    """Headers sent fast and without end: refused at the head bound (64 KiB), not buffered."""
    port = _port(guarded[0])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(f"GET /livez HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n".encode())
        sent = 0
        line = b"X-Filler: " + b"a" * 1000 + b"\r\n"
        try:
            while sent < 4 * 1024 * 1024:  # 4 MiB: a server without the bound takes it all
                sock.sendall(line)
                sent += len(line)
        except (BrokenPipeError, ConnectionResetError):
            pass
        try:
            got = _read_until_closed(sock, 5)
        except ConnectionResetError:
            got = b""
    assert sent < 4 * 1024 * 1024 or got.startswith(b"HTTP/1.1 431 "), (sent, got[:200])
    if got:
        assert got.startswith(b"HTTP/1.1 431 "), got[:200]
        assert json.loads(got.split(b"\r\n\r\n", 1)[1])["error"] == "InvalidArgument"
