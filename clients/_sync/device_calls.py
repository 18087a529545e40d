# GENERATED from clients/_async/device_calls.py by scripts/unasync.py: do not edit.
# Change the asyncio source, then run `python scripts/unasync.py`.
"""The one shape of a call on a device path: a session call where the session serves it,
else its RPC; where the daemon cannot serve this device, the fallback is remembered and the
caller takes the next path (the host's) instead of failing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from embcache.clients._sync.connection import Connection
from embcache.clients.core.errors import RpcFailed
from embcache.errors import DeviceUnavailable

# ``fallback(exc)``: True when ``exc`` means "take another path" (and it was remembered).
Fallback = Callable[[Exception], bool]


def device_call(
    conn: Connection, kind: str, request: Any, rpc: Any, fallback: Fallback
) -> Any | None:
    """``request`` as a ``kind`` session call, or the RPC ``rpc`` (a stub method); None
    where ``fallback`` took the daemon's refusal (the caller goes another way)."""
    try:
        return conn.session_call(
            kind, request, lambda md, to: rpc(request, timeout=to, metadata=md)
        )
    except (DeviceUnavailable, RpcFailed) as exc:
        if fallback(exc):
            return None
        raise


def when_unavailable(remember: Callable[[DeviceUnavailable], object]) -> Fallback:
    """A fallback for DeviceUnavailable only (``remember(exc)`` first); others are raised."""

    def fallback(exc: Exception) -> bool:
        if not isinstance(exc, DeviceUnavailable):
            return False
        remember(exc)
        return True

    return fallback
