"""get_bytes as a session call: an entry's bytes sent raw after the result's frame.

The gRPC GetBytes stream costs a message per MiB and gRPC's per-message work on the one event
loop; on a session socket the result is one small ``BytesOut`` frame (meta and length) and the
bytes follow as they are, so a remote reader pays a socket's cost, not gRPC's.

The bytes go to the transport as views of the pool, not copies, under a lease that lasts
until the transport has let go of them. asyncio sends what the socket takes at once and keeps
the rest (Python 3.11 copies it; 3.12 keeps the views themselves), so the lease ends only once
the connection's write buffer is empty or the connection is gone (``session_socket/connection.py``,
``_send_bytes``); ranges up to ``COPY_BYTES`` are copied instead and their lease ends before
anything is sent. A reader that leaves the bytes unread past ``drain_deadline`` has its
connection closed (which drops the views) before the lease would expire: no page is reused
while a view of it may still be sent. The bytes are read only once the connection's writes
have room, so a client that sends calls and reads nothing holds at most about one reply's
views.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

from embcache.errors import NotFound
from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.service.engine import CacheEngine

DRAIN_S = 30.0  # longest a reply's bytes may wait to be sent (less if the lease ends sooner)
COPY_BYTES = 256 << 10  # ranges up to this size are copied and their lease ends at once


@dataclass(slots=True, eq=False)  # identity: a connection keeps a set of those it sends
class BytesReply:
    """A get_bytes answer: its ``BytesOut``, the views of the pool to send after it, and what
    ends their lease once they are sent (``release``; idempotent)."""

    out: pb.BytesOut
    views: list[memoryview]
    release: Callable[[], None]
    drain_deadline: float  # time.monotonic() by which the views must be sent


def read_bytes(engine: CacheEngine, request: pb.GetBytesRequest, owner: str) -> BytesReply:
    """The answer to ``request``: views of the entry's bytes under a lease of ``owner`` that
    the caller ends (``release``) once the views are no longer referenced.

    Raises:
        NotFound: no such entry.
        InvalidArgument: the range lies outside the entry.
    """
    lease = engine.get([request.key], owner)[0]
    if lease is None:
        raise NotFound("no such entry", key=request.key)
    released = False

    def release() -> None:
        nonlocal released
        if not released:
            released = True
            engine.release([lease.lease_id])

    try:
        length = request.length if request.HasField("length") else None
        # One view per run (a chunk as long as the entry); InvalidArgument outside it.
        chunks = engine.iter_bytes(
            lease, request.offset, length, max(lease.nbytes, 1), copy=view_of
        )
        views = cast(list[memoryview], list(chunks))
        sent = sum(len(v) for v in views)
        meta = pb.TensorMeta(dtype=lease.dtype, shape=lease.shape, nbytes=lease.nbytes)
        if sent <= COPY_BYTES:  # a copy costs less than the wait: released before sent
            views = [memoryview(b"".join(views))]
            release()
        # Sent well before the lease could expire (the engine's clock is time.monotonic).
        deadline = min(time.monotonic() + DRAIN_S, lease.expires_at - 1.0)
        return BytesReply(pb.BytesOut(meta=meta, payload_bytes=sent), views, release, deadline)
    except BaseException:
        release()
        raise


# Each run's view as it is, not a copy (for ``iter_bytes``): get_bytes' lease lives until the
# transport let go of it; inline gets copy it at once (``inline_gets.py``).
view_of = cast(Callable[[memoryview], bytes], lambda view: view)
