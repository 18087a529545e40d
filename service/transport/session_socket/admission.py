"""What the session socket lets a connection do before its session opens.

Anyone who can reach the session socket (its Unix socket's group, or the TCP port) can
connect, and until its hello is accepted the daemon knows nothing of it: no token checked, no
process it answers for. So a connection costs the daemon as little as possible until then:

- **a cap on connections** (``max_session_connections``, never more than half the process's
  open-file limit), so idle connections can neither take every file descriptor (gRPC and
  HTTP need some to accept) nor grow without bound. At the cap, a new connection takes the
  place of the one that has waited longest for its hello (answered ``QuotaExceeded`` and
  closed): connections that never say hello, re-opened faster than the deadline, would
  otherwise keep every new client out, whereas now they only push each other out while a
  real client's hello arrives in far less time than it takes to open the cap's worth of
  them. Sessions (a hello accepted) are never closed to make room; with the cap full of
  them a new connection is refused.
- **a hello deadline** (``session_hello_timeout_s``): a connection whose hello has not been
  accepted by then is closed.
- **a small first message** (``session_hello_max_bytes``, at least the token's length plus
  1 KiB): a frame larger than a hello can be closes the connection as soon as its length is
  read, before its bytes are buffered (after the hello, frames up to a gRPC message are read
  as before; the client sends at most 256 characters of its name).

Each refusal is counted by listener and reason (``embcache_session_socket_refusals_total``)
and logged, the first of each reason at info level and the rest at debug level (a flood of
connections must not flood the log too); the client of a refused connection falls back to a
gRPC Session stream.
"""

from __future__ import annotations

import logging
import resource
from dataclasses import dataclass, field

from embcache.service.config import Settings
from embcache.service.transport.accounting import RpcMetrics

log = logging.getLogger("embcache.session_socket")

# Reasons a connection is refused before its session opens (the metric's label).
CONNECTIONS = "connections"
DISPLACED = "displaced"  # waited longest for its hello when the cap was full
HELLO_TIMEOUT = "hello_timeout"
HELLO_TOO_LARGE = "hello_too_large"
UNAUTHENTICATED = "unauthenticated"
BAD_HELLO = "bad_hello"


def fd_share(limit: int) -> int:
    """``limit``, but at most half the process's open-file limit (the rest stays for the
    gRPC and HTTP listeners, the pools and the logs)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft <= 0:
        return limit
    return max(1, min(limit, soft // 2))


@dataclass(slots=True)
class Admission:
    """The bounds on connections whose session has not opened (module docstring)."""

    max_connections: int
    hello_timeout_s: float
    hello_max_bytes: int
    metrics: RpcMetrics | None = None
    _logged: set[str] = field(default_factory=set)  # reasons already logged at info level

    @classmethod
    def of(cls, settings: Settings, metrics: RpcMetrics | None = None) -> Admission:
        return cls(
            max_connections=fd_share(settings.max_session_connections),
            hello_timeout_s=settings.session_hello_timeout_s,
            # A hello carries the token: a long token still fits, with room for the rest.
            hello_max_bytes=max(
                settings.session_hello_max_bytes, len(settings.auth_token or "") + 1024
            ),
            metrics=metrics,
        )

    def refused(self, listener: str, reason: str, detail: str) -> None:
        """Log and count one connection refused before its session opened."""
        level = logging.DEBUG if reason in self._logged else logging.INFO
        self._logged.add(reason)
        msg = "session socket (%s): refused a connection (%s): %s%s"
        more = "" if level == logging.DEBUG else " (more of these are logged at debug level)"
        log.log(level, msg, listener, reason, detail, more)
        if self.metrics is not None:
            self.metrics.observe_refusal(listener, reason)
