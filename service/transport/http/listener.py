"""The HTTP listener's uvicorn configuration and its connection guards.

uvicorn closes a keep-alive connection that stays idle after a response
(``timeout_keep_alive``), but it has no deadline for a request's head: a connection that
opens and sends nothing, or sends ``GET / HT`` and stops, or trickles one header byte a
second, holds a socket and a slot forever (slowloris). :class:`GuardedHttpProtocol` adds
that deadline: from the moment a connection opens, and again from the end of each response,
the client has ``http_header_timeout_s`` to complete the next request head, however it
spreads the bytes. Past it the connection is closed, with a 408 in the API's error shape when
part of a head had arrived. A request whose head is complete is never timed by it: its body
has the put's own idle timeout, and a slow handler is the app's business.

A head larger than ``http_max_head_bytes`` is answered 431 and the connection closed:
httptools itself keeps every header line it is sent, without a bound.

At ``http_max_concurrency`` open connections (or requests in progress) a new request is
answered 503 in the API's error shape at once, as uvicorn's ``limit_concurrency`` would
answer it in plain text. uvicorn checks that bound only once a head is complete, so
connections that send nothing would each hold a file descriptor until the header timeout,
without bound: past twice the bound (and never more than a quarter of the process's
open-file limit, which the gRPC listener, the session socket and the pools share) a new
connection is closed as soon as it opens.
"""

from __future__ import annotations

import asyncio
import json
import resource
from typing import Any, ClassVar

import httptools
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from embcache.errors import EmbCacheError, IdleTimeout, InvalidArgument
from embcache.service.config import Settings
from embcache.service.transport.status import error_body


def _error_bytes(status: int, reason: str, body: dict[str, Any], *extra: str) -> bytes:
    payload = json.dumps(body).encode()
    head = [
        f"HTTP/1.1 {status} {reason}",
        "content-type: application/json",
        f"content-length: {len(payload)}",
        "connection: close",
        *extra,
    ]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + payload


_UNAVAILABLE = {
    "error": "Unavailable",
    "code": "UNAVAILABLE",
    "message": "too many HTTP connections or requests at once; retry shortly",
    "details": {},
}


async def _unavailable(scope: Any, receive: Any, send: Any) -> None:
    """The ASGI app that answers a request beyond the concurrency bound."""
    payload = json.dumps(_UNAVAILABLE).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(payload)).encode()),
        (b"connection", b"close"),
        (b"retry-after", b"1"),
    ]
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": payload, "more_body": False})


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a deadline for each request head and an error-shaped
    503 at the concurrency bound (module docstring). Subclassed per settings by
    :func:`guarded_protocol`, which sets the two class attributes."""

    header_timeout_s: ClassVar[float] = 5.0
    max_head_bytes: ClassVar[int] = 64 * 1024
    max_concurrency: ClassVar[int | None] = None
    max_connections: ClassVar[int | None] = None  # open at all, head or not

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0  # bytes of the head being waited for
        self._in_message = False  # a request's head was parsed, its body is still coming

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self.max_connections is not None and len(self.connections) > self.max_connections:
            transport.abort()  # counted itself, hence ">"; connection_lost forgets it
            return
        self._watch_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._awaiting_head():
            self._head_bytes += len(data)
        super().data_received(data)
        # Still no complete head after all of it: every byte so far was head. httptools
        # keeps every header line it is sent, so an endless head would grow without bound.
        if self._head_bytes > self.max_head_bytes and self._awaiting_head():
            self._refuse_head(
                431,
                "Request Header Fields Too Large",
                InvalidArgument(
                    f"the request head is larger than {self.max_head_bytes} bytes",
                    max_head_bytes=self.max_head_bytes,
                ),
            )
            return
        self._watch_head()

    def on_message_complete(self) -> None:
        self._in_message = False
        super().on_message_complete()

    def on_headers_complete(self) -> None:
        self._in_message = True
        self._target_names_host()
        limit = self.max_concurrency
        if limit is not None and (len(self.connections) > limit or len(self.tasks) >= limit):
            # This connection counts itself, hence ">": the bound is on the others.
            app, self.app = self.app, _unavailable
            try:
                super().on_headers_complete()
            finally:
                self.app = app
        else:
            super().on_headers_complete()

    def _target_names_host(self) -> None:
        """An absolute-form target (``GET http://name:port/path``) names the request's host,
        and the server must use it and ignore ``Host`` (RFC 9112, 3.2.2): it replaces the
        ``Host`` headers, so that the app's Host check sees the name the client asked for."""
        url = bytes(self.url)
        if url.startswith(b"/") or url == b"*" or b"://" not in url[:16]:
            return
        try:
            parsed = httptools.parse_url(url)
        except httptools.HttpParserInvalidURLError:
            return  # the parser refuses it too
        name = parsed.host or b""
        if b":" in name:  # IPv6, which the authority writes in brackets
            name = b"[" + name + b"]"
        authority = name + (b":%d" % parsed.port if parsed.port is not None else b"")
        self.headers[:] = [(k, v) for k, v in self.headers if k != b"host"]
        self.headers.append((b"host", authority))

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._head_bytes = 0
        self._watch_head()

    def _awaiting_head(self) -> bool:
        """Whether the connection is between requests (or before its first). A body that
        is still arriving after its response was sent (a put refused before its bytes were
        read) is not the next request's head."""
        if self._in_message:
            return False
        return self.cycle is None or (self.cycle.response_complete and not self.pipeline)

    def _watch_head(self) -> None:
        if self.transport is None or self.transport.is_closing():
            self._cancel_head_timer()
        elif not self._awaiting_head():
            self._cancel_head_timer()
            self._head_bytes = 0
        elif self._head_timer is None:
            self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_overdue)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_overdue(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or not self._awaiting_head():
            return
        if not self._head_bytes:
            self.transport.close()  # an idle connection: nothing to answer
            return
        err = IdleTimeout(
            f"the request head did not arrive within {self.header_timeout_s:g} s",
            timeout_s=self.header_timeout_s,
        )
        self._refuse_head(408, "Request Timeout", err)

    def _refuse_head(self, status: int, reason: str, err: EmbCacheError) -> None:
        """Answer a head that will not be served, in the error shape, and close."""
        self._cancel_head_timer()
        if not self.transport.is_closing():
            self.transport.write(_error_bytes(status, reason, error_body(err)))
            self.transport.close()


def guarded_protocol(settings: Settings) -> type[GuardedHttpProtocol]:
    """The protocol class for ``settings``' header timeout and concurrency bound."""
    return type(
        "GuardedHttpProtocol",
        (GuardedHttpProtocol,),
        {
            "header_timeout_s": settings.http_header_timeout_s,
            "max_head_bytes": settings.http_max_head_bytes,
            "max_concurrency": settings.http_max_concurrency,
            "max_connections": _connection_cap(settings.http_max_concurrency),
        },
    )


def _connection_cap(max_concurrency: int) -> int:
    """Connections the listener keeps open at all: twice the concurrency bound (those past
    it get their 503), at most a quarter of the open-file limit."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    cap = 2 * max_concurrency
    if soft != resource.RLIM_INFINITY and soft > 0:
        cap = min(cap, max(soft // 4, max_concurrency + 1))
    return cap


def uvicorn_config(app: Any, settings: Settings, **options: Any) -> uvicorn.Config:
    """uvicorn's configuration for the HTTP plane with ``settings``' connection guards;
    ``options`` (log level, TLS, ...) go to ``uvicorn.Config`` as they are."""
    return uvicorn.Config(
        app,
        http=guarded_protocol(settings),
        timeout_keep_alive=settings.http_keepalive_timeout_s,  # type: ignore[arg-type]
        limit_concurrency=None,  # the protocol applies http_max_concurrency itself
        # No route speaks WebSocket: an upgrade request stays a plain request, which the
        # guards and the Host check see, instead of reaching a second protocol stack.
        ws="none",
        **options,
    )
