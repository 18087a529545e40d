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
``PATH.lane``, same permissions) and checks the daemon's auth token in the hello. Until the
hello is accepted a connection is bounded (``admission.py``: a cap on connections, a hello
deadline, a small first message). A message that cannot be decoded or is larger than a gRPC
message closes the connection (which ends the session and drops whatever it held). The
kernel tells who connected (``SO_PEERCRED``): the session's in-flight quota follows that
process, and operators see its pid and uid.

Reading stops while the client does not read its results (the transport's writes back up)
and while the session has ``max_session_calls`` calls in flight; the messages already
received wait in the buffer and are handled once a call ends.

The same framing also listens on TCP (``start_tcp``; setting ``session_socket_tcp``) for
clients that reach gRPC over TCP: no peer credentials there (no quarantine tie, no writable
puts), TCP keepalive finds a peer that vanished, and the token is checked the same way. On either, a
get_bytes result is followed by the entry's bytes raw (``session/bytes_out.py``).
"""

from __future__ import annotations

import asyncio
import hmac
from pathlib import Path

from embcache.proto.constants import SESSION_SOCKET_SUFFIX
from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.service.transport.session.service import SessionService
from embcache.service.transport.session_socket.admission import Admission
from embcache.service.transport.session_socket.connection import SessionConnection


def session_socket_path(grpc_socket: Path) -> Path:
    """Where the session socket listens for a gRPC Unix socket at ``grpc_socket``."""
    return grpc_socket.with_name(grpc_socket.name + SESSION_SOCKET_SUFFIX)


class SessionSocketServer:
    """The session socket's listener and its open connections."""

    def __init__(
        self,
        service: SessionService,
        path: Path | None,
        token: str | None,
        limits: Admission,
    ) -> None:
        self.service = service  # opens the sessions (the gRPC streams' too: one registry)
        self.path = path
        self._token = token.encode() if token else None
        self.limits = limits  # the bounds before a hello is accepted
        self._server: asyncio.AbstractServer | None = None
        self._tcp: asyncio.AbstractServer | None = None
        self._conns: set[SessionConnection] = set()  # open ones (each a session)
        self._waiting: dict[SessionConnection, None] = {}  # no hello accepted yet, oldest first

    async def start(self) -> None:
        """Listen on ``path`` (which the caller prepared: no stale socket there)."""
        assert self.path is not None
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(
            lambda: SessionConnection(self), str(self.path)
        )

    async def start_tcp(self, host: str, port: int) -> int:
        """Listen on TCP ``host:port`` too (0: a free port); returns the port."""
        loop = asyncio.get_running_loop()
        self._tcp = await loop.create_server(
            lambda: SessionConnection(self, tcp=True), host.strip("[]"), port
        )
        return int(self._tcp.sockets[0].getsockname()[1])

    @property
    def connections(self) -> int:
        """Connections open now (each a session)."""
        return len(self._conns)

    def track(self, conn: SessionConnection) -> None:
        self._conns.add(conn)
        self._waiting[conn] = None

    def opened(self, conn: SessionConnection) -> None:
        """``conn``'s hello was accepted: it no longer gives way to new connections."""
        self._waiting.pop(conn, None)

    def forget(self, conn: SessionConnection) -> None:
        self._conns.discard(conn)
        self._waiting.pop(conn, None)

    def longest_waiting(self) -> SessionConnection | None:
        """The open connection that has waited longest for its hello (None: none waits)."""
        return next(iter(self._waiting), None)

    def authorized(self, hello: pb.SessionHello) -> bool:
        """Whether a hello carries the daemon's token (always, without one)."""
        if self._token is None:
            return True
        return hmac.compare_digest(hello.auth_token.encode(), self._token)

    async def stop(self) -> None:
        """Stop accepting and close every connection (which ends their sessions)."""
        servers = [s for s in (self._server, self._tcp) if s is not None]
        for server in servers:
            server.close()
        for conn in list(self._conns):
            conn.close()
        for server in servers:
            await server.wait_closed()
