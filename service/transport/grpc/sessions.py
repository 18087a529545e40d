"""The gRPC side of sessions: the ``Session`` stream, which carries one session of the
session service (``session/service.py``) for as long as the stream lives."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from embcache import build_info
from embcache.errors import InvalidArgument
from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.service.transport.session.admin import StreamDrop, dropped_error
from embcache.service.transport.session.registry import client_of
from embcache.service.transport.session.service import SessionService
from embcache.service.transport.session.waiters import FifoLock

# Initial metadata of the Session stream and of Stats: which daemon build answers. The
# data-path unary calls leave it out (it would cost them a write of its own).
VERSION_METADATA = (("embcache-version", build_info.describe()),)


async def serve_stream(
    service: SessionService,
    request_iterator: AsyncIterator[pb.SessionRequest],
    context: grpc.aio.ServicerContext,
) -> None:
    """One ``Session`` stream: a session opened for it, its calls, and its end with the
    stream, whatever ends it (close, cancel, a lost connection, the server stopping, an
    operator's drop)."""
    writing = FifoLock()  # calls finish concurrently; one write at a time

    async def send(msg: pb.SessionResponse) -> None:
        async with writing:
            await context.write(msg)

    session = service.open_session(send, "grpc", client=client_of(context.peer(), False))
    drop = StreamDrop()  # an operator's drop (embcache drop-session) ends this stream
    if session.record is not None:
        session.record.end = drop
    try:
        await context.send_initial_metadata(VERSION_METADATA)
        await send(pb.SessionResponse(opened=session.opened))
        async for msg in request_iterator:
            if not isinstance(msg, pb.SessionRequest):
                raise InvalidArgument("undecodable Session message")
            if msg.WhichOneof("kind") == "ping":
                await send(pb.SessionResponse(pong=msg.ping))
            else:
                session.handle(msg, context.peer())
                await session.calls.room()  # at the bound: read on once a call ends
    except asyncio.CancelledError:
        if not drop.absorb():
            raise
        raise dropped_error(session.session_id) from None
    finally:
        # Ended for any reason: closed, cancelled, connection lost, server stopping.
        # Nothing here awaits: a second cancellation must not skip the lease drop.
        session.end()
