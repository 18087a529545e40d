"""The session socket: Session calls over a plain Unix socket next to the gRPC socket.

A same-node client (a decoder pulling device gets) pays for gRPC's HTTP/2 machinery twice per
call, once on each side: a round trip on an open gRPC stream costs several times what the
same messages cost over a Unix socket with a length prefix (docs/grpc.md, "Session
socket"). It carries exactly the Session stream's messages (``SessionRequest`` /
``SessionResponse``, framing in the .proto): the same calls, handlers, error table and
metrics (transport ``lane``), and the same session registry, so its session id also works in
``x-embcache-session`` on gRPC calls. The connection is the session: when it closes (the
client closes it or dies; the kernel closes its sockets), the session ends and its leases
are released at once, with no keepalive needed.

It runs on the gRPC server's event loop, listens where the gRPC Unix socket is (``PATH`` ->
``PATH.lane``, same permissions) and checks the daemon's auth token in the hello. A message
that cannot be decoded or is larger than a gRPC message closes the connection (which ends the
session and drops whatever it held).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from pathlib import Path

from google.protobuf.message import DecodeError

from embcache.errors import EmbCacheError, Unauthenticated
from embcache.proto.constants import MAX_MESSAGE_BYTES, UDS_SUFFIX
from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.proto.framing import FRAME_HEADER as HEADER
from embcache.proto.framing import frame
from embcache.service.transport.session.open import OpenSession, SessionHost
from embcache.service.transport.sockets import PeerCredentials, peer_credentials
from embcache.service.transport.status import status_for

log = logging.getLogger("embcache.uds")


def uds_path(grpc_socket: Path) -> Path:
    """Where the session socket listens for a gRPC Unix socket at ``grpc_socket``."""
    return grpc_socket.with_name(grpc_socket.name + UDS_SUFFIX)


class UdsServer:
    """The session socket's listener and its open connections."""

    def __init__(self, host: SessionHost, path: Path, token: str | None) -> None:
        self.host = host  # opens the sessions (the gRPC servicer: same registry and calls)
        self.path = path
        self._token = token.encode() if token else None
        self._server: asyncio.AbstractServer | None = None
        self._conns: set[_Connection] = set()  # open ones (each a session)

    async def start(self) -> None:
        """Listen on ``path`` (which the caller prepared: no stale socket there)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(lambda: _Connection(self), str(self.path))

    @property
    def connections(self) -> int:
        """Connections open now (each a session)."""
        return len(self._conns)

    def track(self, conn: _Connection) -> None:
        self._conns.add(conn)

    def forget(self, conn: _Connection) -> None:
        self._conns.discard(conn)

    def authorized(self, hello: pb.SessionHello) -> bool:
        """Whether a hello carries the daemon's token (always, without one)."""
        if self._token is None:
            return True
        return hmac.compare_digest(hello.auth_token.encode(), self._token)

    async def stop(self) -> None:
        """Stop accepting and close every connection (which ends their sessions)."""
        if self._server is not None:
            self._server.close()
        for conn in list(self._conns):
            conn.close()
        if self._server is not None:
            await self._server.wait_closed()


class _Connection(asyncio.Protocol):
    """One client connection: one session, opened by the client's hello."""

    def __init__(self, server: UdsServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.session: OpenSession | None = None
        self.peer: PeerCredentials | None = None  # the client process, from the kernel
        self._buf = bytearray()
        self._writable: asyncio.Future[None] | None = None  # set while writing is paused

    # -- asyncio.Protocol ------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.peer = peer_credentials(transport.get_extra_info("socket"))
        self.server.track(self)

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        at = 0
        while len(buf) - at >= HEADER.size:
            (size,) = HEADER.unpack_from(buf, at)
            if size > MAX_MESSAGE_BYTES:
                self._drop(f"message of {size} bytes (limit {MAX_MESSAGE_BYTES})")
                return
            end = at + HEADER.size + size
            if len(buf) < end:
                break
            try:
                with memoryview(buf) as view:  # parsed in place, not copied first
                    msg = pb.SessionRequest.FromString(view[at + HEADER.size : end])
            except DecodeError:
                self._drop("undecodable message")
                return
            at = end
            self._on_message(msg)
            if self.transport is None or self.transport.is_closing():
                return
        del buf[:at]

    def pause_writing(self) -> None:
        # A client that sends calls but does not read their results: stop reading its
        # calls too (backpressure, as HTTP/2 flow control gives a gRPC stream).
        self._writable = asyncio.get_running_loop().create_future()
        if self.transport is not None and not self.transport.is_closing():
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        waiter, self._writable = self._writable, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        if waiter is not None and self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.forget(self)
        self.resume_writing()
        if self.session is not None:
            self.session.end()  # cancels its calls, releases its leases

    # -- messages --------------------------------------------------------------------------
    def _on_message(self, msg: pb.SessionRequest) -> None:
        kind = msg.WhichOneof("kind")
        if self.session is None:
            if kind != "hello":
                self._drop("the first message must be a hello")
            elif not self.server.authorized(msg.hello):
                self._refuse(Unauthenticated("missing or invalid auth token"))
            else:
                pid = self.peer.pid if self.peer is not None else None
                self.session = self.server.host.open_session(self._send, "lane", pid)
                self.session.handle(msg, self._peer())
                self._write(pb.SessionResponse(opened=self.session.opened))
        elif kind == "ping":
            self._write(pb.SessionResponse(pong=msg.ping))
        elif kind is None:
            self._drop("empty message")
        else:
            self.session.handle(msg, self._peer())

    async def _send(self, msg: pb.SessionResponse) -> None:
        """A call's result (SessionCalls); waits while the client is not reading."""
        while self._writable is not None:
            await self._writable
        if self.transport is None or self.transport.is_closing():
            raise ConnectionResetError("the session socket connection closed")
        self._write(msg)

    def _write(self, msg: pb.SessionResponse) -> None:
        assert self.transport is not None
        self.transport.write(frame(msg))

    def _refuse(self, err: EmbCacheError) -> None:
        """Answer ``err`` as a failed call (code from the one error table) and close."""
        code = status_for(err).grpc_code
        log.info("session socket: refused a session: %s", err)
        self._count(code)
        error = pb.CallError(code=code, message=err.describe(), error_type=type(err).__name__)
        self._write(pb.SessionResponse(result=pb.SessionResult(call_id=0, error=error)))
        self.close()

    def _drop(self, reason: str) -> None:
        log.info("session socket: closing a connection: %s", reason)
        self._count("INVALID_ARGUMENT")
        assert self.transport is not None
        self.transport.abort()

    def _count(self, code: str) -> None:
        """A connection refused or dropped, in the metrics as a failed Session call."""
        metrics = self.server.host.metrics
        if metrics is not None:
            metrics.observe_rpc("lane", "Session", code, 0.0)

    def close(self) -> None:
        """Close after what is buffered is sent; that ends the session."""
        if self.transport is not None:
            self.transport.close()  # after what is buffered; connection_lost ends the session

    def _peer(self) -> str:
        return f"lane:{self.server.path}"
