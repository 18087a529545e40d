"""The session service: opens the sessions that gRPC ``Session`` streams and the session
socket (``session_socket/server.py``) carry, so that a session's calls, leases and end are the same
whichever transport carries it, and ends them.

It owns what belongs to sessions: their touch budgets per client (``touches.py``) and the
wiring of each new session's calls (``calls.py``) to the daemon's handlers
(``call_kinds.DaemonHandlers``, which the gRPC servicer and the device plane provide); the
session registry it shares with the unary calls, which name sessions in their metadata.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

from embcache import build_info
from embcache.proto.constants import SESSION_SOCKET_LABEL
from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.service.config import Settings
from embcache.service.engine import CacheEngine
from embcache.service.host.admission import MAX_NDIM
from embcache.service.host.read_table import ReadTable
from embcache.service.transport.accounting import RpcMetrics
from embcache.service.transport.session.bytes_out import read_bytes
from embcache.service.transport.session.call_kinds import (
    DaemonHandlers,
    Send,
    SendBytes,
    SessionIO,
)
from embcache.service.transport.session.calls import SessionCalls
from embcache.service.transport.session.host_puts import (
    THREAD_CRC_BYTES,
    SessionPuts,
    may_write_segment,
)
from embcache.service.transport.session.inline_gets import inline_get
from embcache.service.transport.session.open import OpenSession
from embcache.service.transport.session.posted import PostedCommits
from embcache.service.transport.session.registry import PeerCreds, SessionRegistry
from embcache.service.transport.session.touches import ClientTouches, SessionTouches


class SessionService:
    """Opens and ends sessions (module docstring)."""

    def __init__(
        self,
        engine: CacheEngine,
        settings: Settings,
        metrics: RpcMetrics | None,
        sessions: SessionRegistry,
        host_pool: pb.PoolHandle,
        handlers: DaemonHandlers,
    ) -> None:
        self.metrics = metrics
        self.sessions = sessions
        self._engine = engine
        self._settings = settings
        self._host_pool = host_pool
        self._handlers = handlers
        self._touches = ClientTouches(self._new_touches)  # one touch budget per client
        self.posted = PostedCommits(engine.held)  # reads wait for the commits posted before

    def open_session(
        self,
        send: Send,
        transport: str,
        peer: PeerCreds | None = None,
        send_bytes: SendBytes | None = None,
        client: str = "unix",
    ) -> OpenSession:
        """A new session whose results go out through ``send`` (a gRPC Session stream's or
        a session-socket connection's, whose ``peer`` credentials its quota follows, and
        whose ``send_bytes`` carries raw bytes after a result); :meth:`OpenSession.end`
        ends it. ``client``: who it is without ``peer`` credentials (its address), whose
        touch budget it shares (``touches.py``)."""
        engine, settings, h = self._engine, self._settings, self._handlers
        record = self.sessions.open(transport, peer)
        session_id = record.session_id
        if peer is not None:
            engine.quarantine.bind(session_id, peer.pid)
        toucher = peer.client if peer is not None else client
        io = SessionIO(
            h,
            send,
            send_bytes,
            read_bytes=functools.partial(read_bytes, engine),
            inline_get=functools.partial(
                inline_get, engine, alive=self.sessions.alive, render=h.render
            ),
            touch=(
                self._touches.open(session_id, toucher) if engine.read_table is not None else None
            ),
            settle=self.posted.settle,
        )
        puts = SessionPuts(
            engine,
            self._host_pool,
            record.quota_owner,
            writable=transport == SESSION_SOCKET_LABEL and may_write_segment(peer, os.geteuid()),
            writer=session_id if peer is not None else None,
        )
        calls = SessionCalls(
            session_id,
            io,
            self.metrics,
            transport=transport,
            max_calls=settings.max_session_calls,
            quota_owner=record.quota_owner,
            host_puts=puts,
        )
        record.in_flight = lambda: calls.in_flight
        stash_puts = puts.writable and puts.writer is not None
        opened = pb.SessionOpened(
            session_id=session_id,
            lease_ttl_s=settings.lease_ttl_s,
            daemon_version=build_info.version(),
            calls=True,
            device_puts=True,
            host_puts=True,
            writable_puts=puts.writable,
            stash_puts=stash_puts,
            bytes_out=calls.serves_bytes,
            get_into=True,
            inline_gets=calls.serves_inline_gets,
            read_table=read_table_info(engine.read_table, self._host_pool, h.offered_pools()),
            # A posted commit is applied after its put returned, so a SIGKILL can lose it: not
            # offered where warm restart promises that every returned put survives one.
            posted_commits=self._posted_bounds()
            if stash_puts and not settings.warm_restart
            else None,
        )
        return OpenSession(calls, opened, self._end_session, record)

    def _posted_bounds(self) -> pb.PostedCommits:
        """What a posted commit must keep to (``posted.py``): a commit answered at once."""
        settings = self._settings
        return pb.PostedCommits(
            max_key_bytes=settings.max_key_bytes,
            max_entry_bytes=min(settings.max_entry_bytes, settings.host_pool_bytes),
            max_commit_bytes=THREAD_CRC_BYTES,
            max_ndim=MAX_NDIM,
        )

    def _new_touches(self) -> SessionTouches:
        """A new client's touch handler: its budget and window (``touches.py``)."""
        metrics = self.metrics
        return SessionTouches(
            self._engine.touch,
            self._settings.max_touch_keys_per_s,
            self._settings.touch_window_s,
            on_drop=metrics.observe_dropped_touch if metrics is not None else None,
        )

    def _end_session(self, session_id: str) -> int:
        """A session ended: forget its id, drop its leases and the client allocations
        opened for it; returns how many leases it held."""
        self.sessions.close(session_id)
        self._touches.close(session_id)
        dropped = self._engine.drop_owner(session_id)
        if self._handlers.drop_ipc is not None:
            self._handlers.drop_ipc(session_id)
        return dropped


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
