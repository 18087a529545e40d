"""An entry's bytes as an HTTP response body: streamed under a lease that ends with the
response, and the headers that describe the entry."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from embcache.proto.constants import (
    CHECKSUM_HEADER,
    CHUNK_BYTES,
    DTYPE_HEADER,
    NBYTES_HEADER,
    SHAPE_HEADER,
)
from embcache.service.engine import CacheEngine
from embcache.service.host.leases import Lease


class LeasedStream(StreamingResponse):
    """A streamed body read under a lease; the lease ends when the response does, however
    it ends (sent, client gone, cancelled)."""

    def __init__(self, engine: CacheEngine, lease: Lease, start: int, stop: int, **kw: Any):
        self._engine = engine
        self._lease = lease
        super().__init__(self._chunks(start, stop), media_type="application/octet-stream", **kw)

    async def _chunks(self, start: int, stop: int) -> AsyncIterator[bytes]:
        engine, lease = self._engine, self._lease
        renew_every = engine.settings.lease_ttl_s / 2
        renewed = time.monotonic()
        chunks = engine.iter_bytes(lease, start, stop - start, CHUNK_BYTES)
        last = next(chunks, None)
        for chunk in chunks:
            yield last  # type: ignore[misc]
            last = chunk
            if time.monotonic() - renewed > renew_every:  # a slow reader keeps its lease
                engine.renew([lease.lease_id])
                renewed = time.monotonic()
        # Every byte is copied out: end the lease before the last send, so a client that
        # has the whole body never finds the entry still leased.
        engine.release([lease.lease_id])
        if last is not None:
            yield last

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._engine.release([self._lease.lease_id])


def entry_headers(lease: Lease) -> dict[str, str]:
    """The response headers that describe an entry (dtype, shape, size, CRC32 if known)."""
    headers = {
        DTYPE_HEADER: lease.dtype,
        SHAPE_HEADER: ",".join(str(d) for d in lease.shape),
        NBYTES_HEADER: str(lease.nbytes),
        "Accept-Ranges": "bytes",
    }
    if lease.entry.checksum is not None:
        headers[CHECKSUM_HEADER] = str(lease.entry.checksum)
    return headers
