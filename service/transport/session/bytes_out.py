"""get_bytes as a session call: an entry's bytes sent raw after the result's frame.

The gRPC GetBytes stream costs a message per MiB and gRPC's per-message work on the one event
loop; on a session socket the result is one small ``BytesOut`` frame (meta and length) and the
bytes follow as they are, in one write, so a remote reader pays a socket's cost, not gRPC's.

The bytes are copied out of the pool (once: the views of its runs, joined) under a lease, and
the lease ends at once: the transport
may keep what it could not send yet (Python 3.12's asyncio keeps a reference rather than a
copy), and pages of the pool must not be reachable from there once the lease is gone. The
copy is made only once the connection's writes have room (the transport's gate), so a client
that does not read holds at most one reply's bytes in the daemon. Ranges above
``IN_THREAD_BYTES`` are copied in a worker thread, off the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import cast

from embcache.errors import InvalidArgument, LeaseExpired, NotFound
from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.service.engine import CacheEngine
from embcache.service.host.leases import Lease

CHUNK = 8 << 20  # bytes copied between two checks that the lease lives
IN_THREAD_BYTES = 8 << 20


async def read_bytes(
    engine: CacheEngine, request: pb.GetBytesRequest, owner: str
) -> tuple[pb.BytesOut, bytes]:
    """The ``BytesOut`` answer to ``request`` and its payload, read under a lease of ``owner``
    that ends before this returns.

    Raises:
        NotFound: no such entry.
        InvalidArgument: the range lies outside the entry.
    """
    lease = engine.get([request.key], owner)[0]
    if lease is None:
        raise NotFound("no such entry", key=request.key)
    try:
        offset, nbytes = request.offset, lease.nbytes
        length = request.length if request.HasField("length") else nbytes - offset
        if offset > nbytes or length < 0 or offset + length > nbytes:  # before allocating
            raise InvalidArgument(
                "byte range outside the entry", offset=offset, length=length, nbytes=nbytes
            )
        if length > IN_THREAD_BYTES:
            out = await asyncio.to_thread(_copy, engine, lease, request.offset, length)
        else:
            out = _copy(engine, lease, request.offset, length)
        meta = pb.TensorMeta(dtype=lease.dtype, shape=lease.shape, nbytes=nbytes)
        return pb.BytesOut(meta=meta, payload_bytes=len(out)), out
    finally:
        engine.release([lease.lease_id])


def _copy(engine: CacheEngine, lease: Lease, offset: int, length: int) -> bytes:
    """``[offset, offset+length)`` of the leased entry, copied once (views of its runs,
    joined), and checked to be still leased after the copy (LeaseExpired otherwise)."""
    chunks = engine.iter_bytes(lease, offset, length, CHUNK, copy=_view)
    views = cast(list[memoryview], list(chunks))
    out = views[0].tobytes() if len(views) == 1 else b"".join(views)
    if not engine.lease_alive(lease):  # ended by force meanwhile: pages may be reused
        raise LeaseExpired("lease has ended", lease_id=lease.lease_id, key=lease.key)
    return out


# Each run's view as it is, not a copy: _copy joins them before the lease ends.
_view = cast(Callable[[memoryview], bytes], lambda view: view)
