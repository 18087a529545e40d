"""ASGI middleware of the operator plane: Host and Origin checks (hosts.py), bearer-token
auth and request latency.

Latency is labelled by the route template (``GET /v1/entries/{key:path}``), never by the
raw path, so keys cannot reach metric labels; paths that match no route share one label.
"""

from __future__ import annotations

import hmac
import json
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import unquote_to_bytes

from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from embcache.errors import EmbCacheError, InvalidArgument, PermissionDenied, Unauthenticated
from embcache.service.observability.metrics import Metrics
from embcache.service.transport.http.hosts import WRITE_METHODS, HostPolicy
from embcache.service.transport.status import error_body

# Reachable without a token. Probes must work for kubelets without secrets; the page,
# its assets and the API description hold no cache data (the page sends the token itself
# on every data request it makes).
PUBLIC_PATHS = frozenset(
    {"/livez", "/readyz", "/", "/docs", "/docs/oauth2-redirect", "/openapi.json"}
)
PUBLIC_PREFIXES = ("/static/", "/docs/assets/")


def is_public(path: str) -> bool:
    """Whether ``path`` is served without the token (probes, the page, the API description)."""
    return path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES)


def route_label(scope: Scope) -> str:
    """``METHOD /template`` of the route that served (or would serve) this request.

    After routing, Starlette leaves the route in ``scope["route"]``. A request refused
    before routing (401) is matched here; anything that matches no route is ``unmatched``.
    """
    method = scope.get("method", "GET")
    path = scope.get("path", "")
    if path.startswith(PUBLIC_PREFIXES):  # mounts do not record themselves in the scope
        return f"{method} {'/docs/assets' if path.startswith('/docs/') else '/static'}"
    route = scope.get("route")
    if route is None:
        router = getattr(scope.get("app"), "router", None)
        for candidate in getattr(router, "routes", ()):
            match, child = candidate.matches(scope)
            if match is Match.FULL:
                route = child.get("route", candidate)
                break
    path = getattr(route, "path", None)
    return f"{method} {path}" if isinstance(path, str) else "unmatched"


class OperatorMiddleware:
    """Refuses Hosts and Origins the daemon does not serve, checks the bearer token (when the
    daemon has one) and times every HTTP request."""

    def __init__(
        self, app: ASGIApp, *, metrics: Metrics, token: str | None, hosts: HostPolicy | None
    ) -> None:
        self.app = app
        self.metrics = metrics
        self._token = token.encode() if token else None
        self._hosts = hosts

    def _misdirected(self, scope: Scope) -> EmbCacheError | None:
        """PermissionDenied for a Host we do not serve, or a write from a foreign Origin."""
        if self._hosts is None:
            return None
        hosts = [v for n, v in scope.get("headers", ()) if n == b"host"]
        origins = [v for n, v in scope.get("headers", ()) if n == b"origin"]
        scheme = str(scope.get("scheme", "http"))
        host = hosts[0].decode("latin-1") if len(hosts) == 1 else None
        if not hosts and scope.get("http_version", "1.1") not in ("1.0", "0.9"):
            # HTTP/1.1 requires it (RFC 9112, 3.2): served without one, the request would
            # pass as if it named the daemon.
            return InvalidArgument("an HTTP/1.1 request needs a Host header")
        if len(hosts) > 1 or not self._hosts.host_allowed(host, scheme, scope.get("server")):
            shown = b", ".join(hosts).decode("latin-1")[:300]
            return PermissionDenied(
                f"Host {shown!r} is not a name this daemon serves (DNS rebinding?); an "
                "operator can allow it with --http-allowed-hosts",
                host=shown,
            )
        if scope.get("method") in WRITE_METHODS and origins:
            origin = origins[0].decode("latin-1")[:300]
            if len(origins) > 1 or not self._hosts.origin_allowed(origin, host, scheme):
                return PermissionDenied(
                    f"Origin {origin!r} may not change this daemon's state (a page of "
                    "another site?); an operator can allow it with --http-allowed-origins",
                    origin=origin,
                )
        elif (site := _foreign_site(scope)) is not None:
            listed = len(origins) == 1 and self._hosts.origin_listed(origins[0].decode("latin-1"))
            if not listed:
                return PermissionDenied(
                    f"a request from a page of another site (Sec-Fetch-Site: {site}) is served "
                    "only as a top-level navigation; an operator can allow its origin with "
                    "--http-allowed-origins",
                    fetch_site=site,
                )
        return None

    def _authorized(self, scope: Scope) -> bool:
        if self._token is None or is_public(scope.get("path", "")):
            return True
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, credential = value.partition(b" ")
                if scheme.lower() == b"bearer":
                    return hmac.compare_digest(credential.strip(), self._token)
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500  # what the client sees if the app raises before responding

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            if (refused := self._misdirected(scope)) is not None:
                code = 400 if isinstance(refused, InvalidArgument) else 403
                await _answer(send_wrapper, code, refused)
            elif not self._authorized(scope):
                await _unauthorized(send_wrapper)
            elif not _utf8_path(scope):
                # The server decodes such bytes to U+FFFD, so %FF and %FE would name the
                # same key: refuse them before any route sees the path.
                err = InvalidArgument("the path is not valid UTF-8 once percent-decoded")
                await _answer(send_wrapper, 400, err)
            else:
                await self.app(scope, receive, send_wrapper)
        finally:
            seconds = time.perf_counter() - start
            self.metrics.observe_rpc("http", route_label(scope), str(status), seconds)


async def _unauthorized(send: Send) -> None:
    err = Unauthenticated("missing or invalid bearer token")
    await _answer(send, 401, err, [(b"www-authenticate", b'Bearer realm="embcache"')])


async def _answer(
    send: Send, status: int, err: EmbCacheError, extra: Sequence[tuple[bytes, bytes]] = ()
) -> None:
    body = json.dumps(error_body(err)).encode()
    headers: list[tuple[bytes, bytes]] = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *extra,
    ]
    start: dict[str, Any] = {"type": "http.response.start", "status": status, "headers": headers}
    await send(start)
    await send({"type": "http.response.body", "body": body})


def _header(scope: Scope, name: bytes) -> str:
    """The value of header ``name`` (lower case), lower-cased; "" when absent."""
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1").strip().lower()
    return ""


def _foreign_site(scope: Scope) -> str | None:
    """The ``Sec-Fetch-Site`` of a browser request made by a page of another site (another
    port of localhost is ``same-site``), unless it is a top-level navigation that only reads
    (a link followed, a URL typed); None for everything else.

    Such a page cannot read the reply, but an ``<img>`` or a ``no-cors`` fetch still runs the
    request: it would count hits, move entries in the LRU and take leases. Browsers send the
    header on every request; clients that are not browsers send none.
    """
    site = _header(scope, b"sec-fetch-site")
    if site in ("", "same-origin", "none"):
        return None
    navigation = (
        _header(scope, b"sec-fetch-mode") == "navigate"
        and _header(scope, b"sec-fetch-dest") == "document"
        and scope.get("method") in ("GET", "HEAD")
    )
    return None if navigation else site[:40]


def _utf8_path(scope: Scope) -> bool:
    """Whether the request's raw path, percent-decoded, is valid UTF-8."""
    raw = scope.get("raw_path") or scope.get("path", "").encode()
    if b"%" not in raw:
        return True
    try:
        unquote_to_bytes(raw).decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
