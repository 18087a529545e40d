"""A client's touches: the hits it served itself from the read table, as it reports them.

A touch costs the daemon a lookup per key under the engine's lock, and nothing checks what
it claims, so each client's touches are bounded twice. The bounds belong to the client, not
to the session (:class:`ClientTouches`), so a client that opens more sessions gets no more
of either: on the session socket the peer's process (``SO_PEERCRED``, as its put quota;
each process of a node's decoders counts its own reads), else the address it connects from
(every gRPC caller on the Unix socket is the one client ``unix``, which shows no peer
credentials). A process that forks more processes gets more, as with its put quota.

- **a budget in keys** (``max_touch_keys_per_s``, a token bucket that holds one second's
  worth): a touch that does not fit is dropped whole, counted
  (``embcache_touches_dropped_total``; logged once per client), and the session goes on. A
  touch sent as a call with an id is answered ``QuotaExceeded`` instead.
- **a window per key** (``touch_window_s``, ``engine.reads.TouchWindow``): each key counts as
  a hit, and moves to the LRU's recent end, at most once per window.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from embcache.service.engine import TouchWindow

log = logging.getLogger("embcache.session")

Touch = Callable[[list[str], TouchWindow], int]  # engine.touch


class SessionTouches:
    """The touch handler of one session (module docstring): ``touches(keys)`` returns how
    many keys are still cached, or None when the touch was dropped over the budget."""

    def __init__(
        self,
        touch: Touch,
        keys_per_s: int,
        window_s: float,
        on_drop: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._touch = touch
        self._rate = float(keys_per_s)
        self._tokens = self._rate
        self._clock = clock
        self._at = clock()
        self._window = TouchWindow(window_s)
        self._on_drop = on_drop
        self.dropped = 0  # touches dropped over the budget

    def __call__(self, keys: list[str]) -> int | None:
        now = self._clock()
        self._tokens = min(self._rate, self._tokens + (now - self._at) * self._rate)
        self._at = now
        cost = max(1, len(keys))  # an empty touch still costs a message's handling
        if cost > self._tokens:
            self._drop(len(keys))
            return None
        self._tokens -= cost
        return self._touch(keys, self._window)

    def _drop(self, nkeys: int) -> None:
        if not self.dropped:
            log.info(
                "a client sends touches faster than %d keys/s: dropping the excess "
                "(first: %d keys)", int(self._rate), nkeys,
            )  # fmt: skip
        self.dropped += 1
        if self._on_drop is not None:
            self._on_drop()


class ClientTouches:
    """The touch handlers of the clients with open sessions, one per client, shared by its
    sessions; a client's goes when its last session ends. Used on the event loop."""

    def __init__(self, make: Callable[[], SessionTouches]) -> None:
        self._make = make
        self._handlers: dict[str, tuple[SessionTouches, int]] = {}  # and its open sessions
        self._client_of: dict[str, str] = {}  # session id -> its client

    def open(self, session_id: str, client: str) -> SessionTouches:
        """The handler of ``client``, for its new session ``session_id``."""
        self._client_of[session_id] = client
        handler, sessions = self._handlers.get(client) or (self._make(), 0)
        self._handlers[client] = handler, sessions + 1
        return handler

    def close(self, session_id: str) -> None:
        """Session ``session_id`` ended: its client's handler goes with its last session."""
        client = self._client_of.pop(session_id, None)
        if client is None:
            return
        handler, sessions = self._handlers[client]
        if sessions > 1:
            self._handlers[client] = handler, sessions - 1
        else:
            del self._handlers[client]

    def __len__(self) -> int:
        return len(self._handlers)
