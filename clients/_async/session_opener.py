"""Opening a client's session: on the daemon's session socket where it has one, else on a
gRPC Session stream.

The socket is a Unix one when the target is, or a TCP one (without TLS) whose port the
daemon names in the Lanes RPC. Each new session looks for the socket again, so a client
that outlives a daemon restart returns to it.
"""

from __future__ import annotations

import logging
from typing import Any

import grpc

from embcache.clients._backends.async_session import AsyncSession
from embcache.clients._backends.async_socket_session import AsyncSocketSession
from embcache.clients._backends.sync_socket_session import Address
from embcache.clients.core.targets import session_socket_path, tcp_address
from embcache.errors import QuotaExceeded
from embcache.proto.embcache.v1 import embcache_pb2 as pb

log = logging.getLogger("embcache.client")

TCP_CONNECT_S = 2.0  # at most this long to reach a session socket on TCP (else gRPC)


class AsyncSessionOpener:
    """Opens the sessions of one client, and remembers a TCP session socket that failed."""

    def __init__(
        self,
        stub: Any,
        target: str,
        token: str | None,
        client_name: str,
        *,
        session_socket: bool,
        secure: bool,
        spin_s: float,
    ) -> None:
        self._stub = stub
        self._target = target
        self._token = token
        self._client_name = client_name
        self._socket_path = session_socket_path(target) if session_socket else None
        self._spin_s = spin_s
        # The session socket on TCP speaks no TLS: a client that asked for TLS never uses it.
        # Turned off once the socket proved unreachable or the daemon has no Lanes RPC.
        self.socket_over_tcp = session_socket and not secure and tcp_address(target, 0) is not None

    async def open(
        self, metadata: Any, timeout: float, call_timeout: float
    ) -> AsyncSession | AsyncSocketSession:
        """A session on the daemon's session socket if it has one, else a gRPC Session
        stream; ``timeout`` bounds the opening, ``call_timeout`` is the client's deadline."""
        opened = await self._open_socket(metadata, timeout, call_timeout)
        return opened or await AsyncSession.open(self._stub, metadata, self._client_name, timeout)

    async def _open_socket(
        self, metadata: Any, timeout: float, call_timeout: float
    ) -> AsyncSocketSession | None:
        """A session on the daemon's session socket; None if it has none (this session uses
        gRPC; the next one looks for the socket again, e.g. after the daemon restarted)."""
        address = self._socket_path or await self._socket_tcp_address(metadata, timeout)
        if address is None:
            return None
        tcp = isinstance(address, tuple)
        try:
            return await AsyncSocketSession.open(
                address,
                self._token,
                self._client_name,
                min(call_timeout, TCP_CONNECT_S) if tcp else call_timeout,
                spin_s=0.0 if tcp else self._spin_s,  # a network's round trip: no spin
            )
        except (OSError, TimeoutError) as err:
            if tcp:  # unreachable (a firewall, another network): gRPC from now on
                self.socket_over_tcp = False
            log.debug("no session socket at %s (%s): this session uses gRPC", address, err)
            return None
        except QuotaExceeded as err:  # the socket is at its connection cap: gRPC this time
            log.info("session socket at %s is full (%s): this session uses gRPC", address, err)
            return None

    async def _socket_tcp_address(self, metadata: Any, timeout: float) -> Address | None:
        """Where the daemon's session socket listens on TCP (the Lanes RPC), if it does."""
        if not self.socket_over_tcp:
            return None
        try:
            reply = await self._stub.Lanes(pb.LanesRequest(), timeout=timeout, metadata=metadata)
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise  # retried by the caller's loop (UNAVAILABLE) or translated
            self.socket_over_tcp = False  # an older daemon
            return None
        return tcp_address(self._target, reply.tcp_port) if reply.tcp_port else None
