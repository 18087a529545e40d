"""Bounded JSON bodies for the control routes (``POST /v1/get``, ``/release``, ``/renew``,
``/evict``, ``/prefetch``).

REST shares its event loop with gRPC, and FastAPI reads and parses a JSON body on that loop
before any handler runs, so one large body stalled every gRPC call. A route of this class
refuses a body over ``max_request_body_bytes`` with ``BodyTooLarge`` (413, the error body)
before reading it when it declares its length, and as soon as it passes the limit
otherwise; a body above :data:`INLINE_PARSE_BYTES` is parsed in a worker thread. (Put data
bodies are no JSON: ``PUT /v1/entries/{key}`` streams them into the reserved pages.)
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.types import Message, Scope

from embcache.errors import BodyTooLarge, InvalidArgument

INLINE_PARSE_BYTES = 64 * 1024  # smaller bodies parse on the loop (a thread hop costs more)


class JsonBodyRoute(APIRoute):
    """A route whose JSON body, if it has one, is bounded and parsed as above."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        if self.body_field is None:
            return handler

        async def bounded(request: Request) -> Response:
            limit = request.app.state.settings.max_request_body_bytes
            body = await read_bounded(request, limit)
            return await handler(_ReadRequest(request.scope, body))

        return bounded


async def read_bounded(request: Request, limit: int) -> bytes:
    """The whole body, or BodyTooLarge once it is known to pass ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isascii() and declared.isdigit():
        if int(declared) > limit:
            raise BodyTooLarge("request body too large", content_length=int(declared), limit=limit)
    elif declared is not None:
        raise InvalidArgument("bad Content-Length", content_length=declared)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge("request body too large", received=size, limit=limit)
        chunks.append(chunk)
    return b"".join(chunks)


class _ReadRequest(Request):
    """The request, its body read already: large bodies parse off the loop."""

    def __init__(self, scope: Scope, body: bytes) -> None:
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if sent:
                return {"type": "http.disconnect"}
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        super().__init__(scope, replay)
        self.raw_body = body

    async def body(self) -> bytes:
        return self.raw_body

    async def json(self) -> Any:
        if len(self.raw_body) > INLINE_PARSE_BYTES:
            return await asyncio.to_thread(json.loads, self.raw_body)
        return json.loads(self.raw_body)
