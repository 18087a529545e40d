"""The operators' view of the sessions: what each holds, and dropping one.

``embcache sessions`` and ``GET /v1/sessions`` list them; ``embcache drop-session ID`` and
``DELETE /v1/sessions/{id}`` end one: the id is closed first (a call naming it from then on
gets ``UnknownSession``, and a call that was taking leases gives them back), its leases end
through :func:`end_session_leases`, and its stream or connection is closed, so the client
sees its session end and opens a new one. Every call here is safe from any thread.

Leases taken without a session are listed too, one row per client that holds some
(``anon:<client>`` over gRPC, ``rest:<address>`` over REST; ``anonymous`` set), so that every
lease has an owner an operator can see; dropping such a row ends that client's leases (it
has no stream to close, and its next call takes new ones).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from embcache.errors import NotFound, UnknownSession
from embcache.proto.records import doc
from embcache.service.device.ipc.cache import ANON_PREFIX
from embcache.service.engine import CacheEngine
from embcache.service.transport.session.registry import (
    REST_PREFIX,
    SessionRecord,
    SessionRegistry,
)

ANONYMOUS = (ANON_PREFIX, REST_PREFIX)  # owners of leases taken without a session


def dropped_error(session_id: str) -> UnknownSession:
    """What the client of a dropped session is told (it opens a new session)."""
    return UnknownSession("an operator dropped this session", session=session_id)


def end_session_leases(engine: CacheEngine, session_id: str) -> int:
    """End every lease of a session an operator drops; returns how many.

    The one place a forced end of a session's leases goes through: today the engine's
    ``drop_owner``, which lets their pages be reused at once (a view the client still holds
    may then show other bytes; issue 28 item 3 replaces this with an end that keeps them out
    of reuse until the owner's views are gone)."""
    return engine.drop_owner(session_id)


class StreamDrop:
    """How an operator's drop ends a gRPC Session stream: made in the stream's handler, it
    cancels that handler's task from any thread and remembers why, so the handler can answer
    the client with an error (its session ended) instead of vanishing."""

    def __init__(self) -> None:
        self.dropped = False
        self._task = asyncio.current_task()
        self._loop = asyncio.get_running_loop()

    def __call__(self) -> None:
        self._loop.call_soon_threadsafe(self._cancel)

    def _cancel(self) -> None:
        self.dropped = True
        if self._task is not None:
            self._task.cancel()

    def absorb(self) -> bool:
        """In the handler, on CancelledError: True (the cancellation taken back) when it was
        the drop's; False: a real cancellation, to be raised on."""
        if self.dropped and self._task is not None:
            self._task.uncancel()
            return True
        return False


@dataclass(frozen=True, slots=True)
class SessionView:
    """One session as operators see it (JSON-ready with :meth:`to_dict`); the REST model
    derives from these fields and their descriptions."""

    session_id: str = field(
        metadata=doc("The session's id, or anon:<client> / rest:<address> for a client's "
        "leases taken without a session.")
    )  # fmt: skip
    transport: str = field(
        metadata=doc("grpc (a Session stream, or gRPC calls without one), lane (the session "
        "socket) or rest.")
    )  # fmt: skip
    client_name: str = field(metadata=doc("What the client's hello said."))
    pid: int | None = field(
        metadata=doc("The client's pid: the kernel's on the session socket, else its hello's.")
    )
    uid: int | None = field(metadata=doc("The client's uid (the session socket only)."))
    leases: int
    leased_bytes: int = field(metadata=doc("Bytes of the distinct entries its leases hold."))
    calls_in_flight: int
    age_s: float
    anonymous: bool = field(
        default=False,
        metadata=doc("A client's leases taken without a session (anon:<client> over gRPC, "
        "rest:<address> over REST): dropping it ends them; it has no stream to close."),
    )  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class SessionAdmin:
    """Lists and drops the sessions of one registry (module docstring)."""

    def __init__(self, registry: SessionRegistry, engine: CacheEngine) -> None:
        self._registry = registry
        self._engine = engine

    def views(self) -> list[SessionView]:
        """Every open session, oldest first, then the clients holding leases without one."""
        anonymous = self._engine.lease_owners(ANONYMOUS)
        return [self._view(r) for r in self._registry.records()] + [
            _anonymous_view(owner, usage) for owner, usage in sorted(anonymous.items())
        ]

    def drop(self, session_id: str) -> tuple[SessionView, int]:
        """End session ``session_id``, or the leases of the client without a session it
        names: ``(what it was, how many leases ended)``. NotFound when no such session is
        open and no such client holds a lease."""
        record = self._registry.get(session_id)
        if record is None and session_id.startswith(ANONYMOUS):
            usage = self._engine.lease_usage(session_id)
            if usage[0]:
                return _anonymous_view(session_id, usage), end_session_leases(
                    self._engine, session_id
                )
        if record is None:
            raise NotFound("no such session", session=session_id)
        view = self._view(record)
        self._registry.close(session_id)  # no new leases attach to it from now on
        ended = end_session_leases(self._engine, session_id)
        if record.end is not None:
            record.end()  # its stream or connection closes; the client opens a new session
        return view, ended

    def _view(self, record: SessionRecord) -> SessionView:
        leases, nbytes = self._engine.lease_usage(record.session_id)
        return SessionView(
            session_id=record.session_id,
            transport=record.transport,
            client_name=record.client_name,
            pid=record.pid,
            uid=record.peer.uid if record.peer is not None else None,
            leases=leases,
            leased_bytes=nbytes,
            calls_in_flight=record.in_flight(),
            age_s=round(time.monotonic() - record.opened_at, 3),
        )


def _anonymous_view(owner: str, usage: tuple[int, int]) -> SessionView:
    """The row of a client holding leases without a session (``anon:unix``, say)."""
    prefix = ANON_PREFIX if owner.startswith(ANON_PREFIX) else REST_PREFIX
    return SessionView(
        session_id=owner,
        transport="grpc" if prefix == ANON_PREFIX else "rest",
        client_name=owner[len(prefix) :],
        pid=None,
        uid=None,
        leases=usage[0],
        leased_bytes=usage[1],
        calls_in_flight=0,
        age_s=0.0,
        anonymous=True,
    )
