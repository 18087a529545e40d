"""Sessions open on this daemon, and whose a call is: its lease owner and its quota owner.

A client opens a ``Session`` stream (or a connection to the session socket); the server
names it and the client sends the name in ``x-embcache-session`` on later calls, so the
leases those calls take belong to the session. When the stream ends, the servicer drops
every lease of the owner. A call naming a session that is not open here (the daemon
restarted, or the stream already ended) fails with FAILED_PRECONDITION and error type
``UnknownSession``; the client opens a new one.

Leases belong to the session. A call without a session has no end that could release
them, so its leases belong to its client, ``anon:<client>`` (:func:`client_of`), never to its
connection: a client that opens more channels gets no more lease caps, and operators see
and end those leases by that name (``session/admin.py``). The client is the one the in-flight
put quota follows too: on the gRPC Unix socket one shared ``unix`` (gRPC exposes no peer
credentials), on TCP the token (every client of the one shared token is ``token``), without
a token ``tcp:<address>``, the peer's address without its port.

The in-flight put quota of a call in a session (:meth:`SessionRegistry.quota_owner_for`)
follows the session's client: on the session socket the peer's credentials
(``SO_PEERCRED``), so one process's sessions share one quota; on a gRPC stream the session.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

from embcache.errors import UnknownSession
from embcache.proto.constants import SESSION_KEY
from embcache.service.device.ipc.cache import ANON_PREFIX

_PREFIX = "session:"
REST_PREFIX = "rest:"  # owner of leases taken over REST: ``rest:<client address>``


@dataclass(frozen=True, slots=True)
class PeerCreds:
    """A Unix socket peer's credentials, from the kernel (``SO_PEERCRED``)."""

    pid: int
    uid: int
    gid: int

    @property
    def client(self) -> str:
        return f"uid:{self.uid}/pid:{self.pid}"


@dataclass(slots=True)
class SessionRecord:
    """One open session, as operators see it (``embcache sessions``)."""

    session_id: str
    transport: str  # "grpc" (a Session stream) or "lane" (the session socket)
    quota_owner: str  # whose in-flight put quota its calls count against
    peer: PeerCreds | None = None  # known on the session socket
    client_name: str = ""  # what its hello said
    hello_pid: int = 0  # the pid its hello claimed (the peer's is the kernel's)
    opened_at: float = field(default_factory=time.monotonic)
    end: Callable[[], object] | None = None  # closes its stream or connection (any thread)
    in_flight: Callable[[], int] = lambda: 0  # its calls running now

    @property
    def pid(self) -> int | None:
        """The peer's pid where the kernel told it, else the hello's (0: unknown)."""
        return self.peer.pid if self.peer is not None else (self.hello_pid or None)


class SessionRegistry:
    """The sessions open on this daemon (both transports share it). ``token``: the daemon
    has an auth token (its callers without a session are one client, ``token``)."""

    def __init__(self, token: bool = False) -> None:
        self._live: dict[str, SessionRecord] = {}
        self.token = token

    def __len__(self) -> int:
        return len(self._live)

    def open(self, transport: str = "grpc", peer: PeerCreds | None = None) -> SessionRecord:
        """A new session: on the session socket its quota follows ``peer``."""
        # Unguessable: knowing a session id lets a caller attach leases to it.
        session_id = _PREFIX + secrets.token_hex(16)
        quota = peer.client if peer is not None else session_id
        record = SessionRecord(session_id, transport, quota, peer)
        self._live[session_id] = record
        return record

    def close(self, session_id: str) -> None:
        """Forget an id (its session ended)."""
        self._live.pop(session_id, None)

    def get(self, session_id: str) -> SessionRecord | None:
        return self._live.get(session_id)

    def records(self) -> list[SessionRecord]:
        """Every open session, oldest first."""
        return sorted(self._live.values(), key=lambda r: r.opened_at)

    def alive(self, owner: str) -> bool:
        """False only for a session id that is not open (owners without one stay alive)."""
        return not owner.startswith(_PREFIX) or owner in self._live

    def _named(self, context: Any) -> SessionRecord | None:
        for key, value in context.invocation_metadata() or ():
            if key == SESSION_KEY:
                record = self._live.get(value)
                if record is None:
                    raise UnknownSession("session is not open on this server", session=value)
                return record
        return None

    def owner_for(self, context: Any) -> str:
        """The lease owner of a call: its session, or ``anon:<client>`` without one."""
        record = self._named(context)
        if record is not None:
            return record.session_id
        return ANON_PREFIX + client_of(str(context.peer()), self.token)

    def quota_owner_for(self, context: Any, token: bool | None = None) -> str:
        """Whose in-flight quota a call counts against (module docstring); ``token``: the
        daemon has an auth token (None: the registry's word)."""
        record = self._named(context)
        if record is not None:
            return record.quota_owner
        return client_of(str(context.peer()), self.token if token is None else token)


def client_of(peer: str, token: bool) -> str:
    """The client behind a gRPC peer (``context.peer()``) without a session: ``unix`` on
    the Unix socket, else :func:`tcp_client` of its address without the port."""
    if peer.startswith("unix"):
        return "unix"
    return tcp_client(peer_address(peer), token)


def peer_address(peer: str) -> str:
    """The address of a gRPC TCP peer, without scheme, port or brackets (``ipv4:1.2.3.4:5``,
    ``ipv6:[::1]:5`` or its URL-quoted form); an IPv4-mapped IPv6 address as IPv4, so one
    client is one name whichever way the listener saw it."""
    rest = unquote(peer.split(":", 1)[-1])
    address = rest.rsplit(":", 1)[0] if ":" in rest else rest
    address = address.strip("[]")
    if address.lower().startswith("::ffff:") and "." in address:
        address = address[len("::ffff:") :]
    return address


def tcp_client(address: str, token: bool) -> str:
    """The quota owner of a TCP client (gRPC or REST) at ``address`` without a session."""
    return "token" if token else f"tcp:{address}"
