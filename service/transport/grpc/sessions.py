"""The servicer's sessions: the ``Session`` stream, the ``Lanes`` RPC, and ``open_session``,
which the stream and the session socket (``uds/server.py``) both call, so that a session's
calls, leases and end are the same whichever transport carries it."""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import AsyncIterator, Sequence

import grpc

from embcache import build_info
from embcache.errors import InvalidArgument
from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.service.config import Settings
from embcache.service.engine import CacheEngine
from embcache.service.host.read_table import ReadTable
from embcache.service.transport.accounting import RpcMetrics
from embcache.service.transport.grpc.busy_poll import BusyPoll
from embcache.service.transport.grpc.errors import rpc
from embcache.service.transport.handlers.device import DevicePlane
from embcache.service.transport.session.admin import StreamDrop, dropped_error
from embcache.service.transport.session.bytes_out import read_bytes
from embcache.service.transport.session.calls import (
    GetHandler,
    ReleaseHandler,
    Send,
    SendBytes,
    SessionCalls,
)
from embcache.service.transport.session.host_puts import SessionPuts, may_write_segment
from embcache.service.transport.session.inline_gets import Render, inline_get
from embcache.service.transport.session.open import OpenSession
from embcache.service.transport.session.registry import PeerCreds, SessionRegistry, client_of
from embcache.service.transport.session.touches import ClientTouches, SessionTouches
from embcache.service.transport.session.waiters import FifoLock

# Initial metadata of the Session stream and of Stats: which daemon build answers. The
# data-path unary calls leave it out (it would cost them a write of its own).
VERSION_METADATA = (("embcache-version", build_info.describe()),)


class SessionRpcs:
    """The session half of :class:`~.servicer.EmbeddingCacheServicer` (which sets these)."""

    engine: CacheEngine
    settings: Settings
    metrics: RpcMetrics | None
    sessions: SessionRegistry
    device: DevicePlane
    busy: BusyPoll
    touch_clients: ClientTouches  # the touch budget and window of each client
    host_pool: pb.PoolHandle
    tcp_lane_port: int  # the session socket's TCP port, once it listens (serving.py)
    _get: GetHandler
    _release: ReleaseHandler
    _checked_reply: Render  # a host get's reply, ReplyTooLarge if it exceeds a message

    @rpc("Lanes")
    async def Lanes(
        self, request: pb.LanesRequest, context: grpc.aio.ServicerContext
    ) -> pb.LanesResponse:
        return pb.LanesResponse(tcp_port=self.tcp_lane_port)

    @rpc("Session")
    async def Session(
        self,
        request_iterator: AsyncIterator[pb.SessionRequest],
        context: grpc.aio.ServicerContext,
    ) -> None:
        writing = FifoLock()  # calls finish concurrently; one write at a time

        async def send(msg: pb.SessionResponse) -> None:
            async with writing:
                await context.write(msg)

        session = self.open_session(send, "grpc", client=client_of(context.peer(), False))
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

    def open_session(
        self,
        send: Send,
        transport: str,
        peer: PeerCreds | None = None,
        send_bytes: SendBytes | None = None,
        client: str = "unix",
    ) -> OpenSession:
        """A new session whose results go out through ``send`` (a gRPC Session stream's or
        a session-socket connection's, ``uds/server.py``, whose ``peer`` credentials its
        quota follows, and whose ``send_bytes`` carries get_bytes' raw bytes);
        :meth:`OpenSession.end` ends it. ``client``: who it is without ``peer`` credentials
        (its address), whose touch budget it shares (``session/touches.py``)."""
        record = self.sessions.open(transport, peer)
        session_id = record.session_id
        toucher = peer.client if peer is not None else client
        if peer is not None:
            self.engine.quarantine.bind(session_id, peer.pid)
        calls = SessionCalls(
            session_id,
            send,
            self._get,
            self._release,
            self.metrics,
            put=self.device.put_from_device,
            put_batch=self.device.put_from_device_batch,
            on_call=self.busy.poke,
            transport=transport,
            max_calls=self.settings.max_session_calls,
            quota_owner=record.quota_owner,
            host_puts=SessionPuts(
                self.engine,
                self.host_pool,
                record.quota_owner,
                writable=transport == "lane" and may_write_segment(peer, os.geteuid()),
                idle_s=self.settings.put_idle_timeout_s,
                writer=session_id if peer is not None else None,
            ),
            read_bytes=functools.partial(read_bytes, self.engine),
            send_bytes=send_bytes,
            get_into=self.device.get_into,
            inline_get=functools.partial(
                inline_get, self.engine, alive=self.sessions.alive, render=self._checked_reply
            ),
            touch=(
                self.touch_clients.open(session_id, toucher)
                if self.engine.read_table is not None
                else None
            ),
        )
        record.in_flight = lambda: calls.in_flight
        opened = pb.SessionOpened(
            session_id=session_id,
            lease_ttl_s=self.settings.lease_ttl_s,
            daemon_version=version(),
            calls=True,
            device_puts=True,
            host_puts=True,
            writable_puts=calls.host_puts is not None and calls.host_puts.writable,
            bytes_out=calls.serves_bytes,
            get_into=True,
            inline_gets=calls.serves_inline_gets,
            read_table=read_table_info(
                self.engine.read_table, self.host_pool, self.device.offered_pools()
            ),
        )
        return OpenSession(calls, opened, self._end_session, record)

    def new_touches(self) -> SessionTouches:
        """A new client's touch handler: its budget and window (``session/touches.py``)."""
        metrics = self.metrics
        return SessionTouches(
            self.engine.touch,
            self.settings.max_touch_keys_per_s,
            self.settings.touch_window_s,
            on_drop=metrics.observe_dropped_touch if metrics is not None else None,
        )

    def _end_session(self, session_id: str) -> int:
        """A session ended: forget its id, drop its leases and the client allocations
        opened for it; returns how many leases it held."""
        self.sessions.close(session_id)
        self.touch_clients.close(session_id)
        dropped = self.engine.drop_owner(session_id)
        self.device.ipc.drop_owner(session_id)
        return dropped


def version() -> str:
    return build_info.version()


def read_table_info(
    table: ReadTable | None, pool: pb.PoolHandle, device_pools: Sequence[pb.PoolHandle] = ()
) -> pb.ReadTableInfo | None:
    """Where a client on the node finds the read table (None: none, or it is shut), and
    the device pools its slots name, by index (``DevicePlane.offered_pools``)."""
    if table is None or table.closed:
        return None
    st_dev, st_ino, size = table.identity
    return pb.ReadTableInfo(
        name=table.path.name,
        size=size,
        st_dev=st_dev,
        st_ino=st_ino,
        pool=pool,
        device_pools=device_pools,
    )
