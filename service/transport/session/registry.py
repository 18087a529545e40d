"""Lease owners for gRPC calls: live Session streams, or ``anon:<peer>``.

A client opens a ``Session`` stream; the server names it and the client sends the name in
``x-embcache-session`` on later calls, so the leases those calls take belong to the
session. When the stream ends, the servicer drops every lease of the owner. A call naming a
session that is not open here (the daemon restarted, or the stream already ended) fails with
FAILED_PRECONDITION and error type ``UnknownSession``; the client opens a new one.
"""

from __future__ import annotations

import secrets
from typing import Any

from embcache.errors import UnknownSession
from embcache.proto.constants import SESSION_KEY
from embcache.service.device.ipc.cache import ANON_PREFIX

_PREFIX = "session:"


class SessionRegistry:
    """The ids of the sessions open on this daemon (both transports share it)."""

    def __init__(self) -> None:
        self._live: set[str] = set()

    def __len__(self) -> int:
        return len(self._live)

    def open(self) -> str:
        """A new session id."""
        # Unguessable: knowing a session id lets a caller attach leases to it.
        session_id = _PREFIX + secrets.token_hex(16)
        self._live.add(session_id)
        return session_id

    def close(self, session_id: str) -> None:
        """Forget an id (its session ended)."""
        self._live.discard(session_id)

    def alive(self, owner: str) -> bool:
        """False only for a session id that is not open (owners without one stay alive)."""
        return not owner.startswith(_PREFIX) or owner in self._live

    def owner_for(self, context: Any) -> str:
        """The lease owner of a call: its session, or ``anon:<peer>`` without one."""
        for key, value in context.invocation_metadata() or ():
            if key == SESSION_KEY:
                if value not in self._live:
                    raise UnknownSession("session is not open on this server", session=value)
                return str(value)
        return f"{ANON_PREFIX}{context.peer()}"
