"""When a failed call is tried again, and how long the client waits first.

UNAVAILABLE means the daemon is restarting or draining: the call is retried with jittered
exponential backoff (puts are idempotent, so that is safe for them too). A call that names a
session the daemon forgot (it restarted) is tried once more on a new session.
"""

from __future__ import annotations

import random

import grpc

from embcache.clients.core.errors import error_type, from_call_error
from embcache.proto.embcache.v1 import embcache_pb2 as pb

RETRY_CODES = frozenset({grpc.StatusCode.UNAVAILABLE})


def is_unknown_session(err: grpc.RpcError) -> bool:
    """The call named a session the daemon does not have (it ended, or the daemon restarted)."""
    return error_type(err) == "UnknownSession"


def should_retry(err: grpc.RpcError) -> bool:
    """A status worth another attempt (after :func:`backoff_s`)."""
    return callable(getattr(err, "code", None)) and err.code() in RETRY_CODES


def backoff_s(attempt: int, base: float = 0.1, cap: float = 1.0) -> float:
    """Exponential backoff with equal jitter: attempt ``n`` waits between half of and all of
    ``min(cap, base * 2**n)``. The default five retries then wait at least 1.25 s in all,
    longer than the channel's own reconnect backoff (at most 1 s, and 20% jitter), so a
    call made just as a daemon restarts reaches the new one instead of failing fast on the
    channel's last connection error."""
    delay = min(cap, base * (2**attempt))
    return _JITTER.uniform(delay / 2, delay)


# The client's own generator: a retry in a background thread (a views pump) leaves the
# program's ``random`` state alone (a seeded caller's sequence, hypothesis' checks).
_JITTER = random.Random()


def retry_step(result: pb.SessionResult, attempt: int, retries: int) -> str:
    """After a session call that failed: ``"new_session"`` (the daemon forgot the session)
    or ``"backoff"`` (UNAVAILABLE) while ``attempt < retries``; otherwise raise its typed
    error, as an RPC would."""
    if attempt < retries:
        if result.error.error_type == "UnknownSession":
            return "new_session"
        if result.error.code == "UNAVAILABLE":
            return "backoff"
    raise from_call_error(result.error)
