"""The errors embcache raises, on the daemon and in the client alike.

One family, rooted at :class:`EmbCacheError`. Each error names what failed in its message
and carries the offending values in ``details``; none knows a status code. The transports
map error types to gRPC codes and HTTP statuses in one table (``service/transport/status.py``),
and the client rebuilds the same class from the type name the daemon sends, so
``except EntryLeased`` works on both sides of the wire.
"""

from __future__ import annotations

from typing import Any


class EmbCacheError(Exception):
    """Base of every expected error: a message, and the values that explain it."""

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def describe(self) -> str:
        """The message followed by its details, for logs and status messages."""
        if not self.details:
            return self.message
        extras = ", ".join(f"{k}={v!r}" for k, v in self.details.items())
        return f"{self.message} ({extras})"


class InvalidArgument(EmbCacheError):
    """A malformed request: bad key, dtype, shape, nbytes, chunk order, ..."""


class ChecksumMismatch(InvalidArgument):
    """The bytes of a put do not match the checksum its header declared."""


class NotFound(EmbCacheError):
    """No such entry (or no copy of it where the request looked)."""


class MetadataConflict(EmbCacheError):
    """A put of an existing key with a different dtype or shape."""


class EntryLeased(EmbCacheError):
    """An explicit evict of an entry that has live leases (never forced)."""


class LeaseExpired(EmbCacheError):
    """The lease is gone: released, expired, or its owner was dropped."""


class UnknownSession(EmbCacheError):
    """The call named a session this daemon does not have (it ended, or the daemon
    restarted); the client opens a new one."""


class EntryTooLarge(EmbCacheError):
    """An entry larger than the daemon's per-entry limit."""


class PoolExhausted(EmbCacheError):
    """No room even after evicting every unleased entry."""


class QuotaExceeded(EmbCacheError):
    """A client's in-flight bytes would pass its limit."""


class LeaseLimitExceeded(QuotaExceeded):
    """A get would take an owner past its cap on leases or leased bytes; nothing was
    leased for that call."""


class ReplyTooLarge(EmbCacheError):
    """A reply would exceed the message limit; its leases were given back (ask for fewer
    keys per call)."""


class IdleTimeout(EmbCacheError):
    """A put received no bytes for the daemon's idle timeout; it was aborted and its pages
    freed."""


class BodyTooLarge(EmbCacheError):
    """A request body larger than the daemon accepts on that route."""


class Draining(EmbCacheError):
    """The daemon is shutting down (or closed) and takes no new work."""


class Unauthenticated(EmbCacheError):
    """The call carried no valid credentials."""


class PermissionDenied(EmbCacheError):
    """The caller may not do this."""


class DeviceUnavailable(EmbCacheError):
    """The operation needs a device (pool) that this daemon does not have or has taken
    out of service."""


__all__ = [
    "BodyTooLarge",
    "ChecksumMismatch",
    "DeviceUnavailable",
    "Draining",
    "EmbCacheError",
    "EntryLeased",
    "EntryTooLarge",
    "IdleTimeout",
    "InvalidArgument",
    "LeaseExpired",
    "LeaseLimitExceeded",
    "MetadataConflict",
    "NotFound",
    "PermissionDenied",
    "PoolExhausted",
    "QuotaExceeded",
    "ReplyTooLarge",
    "Unauthenticated",
    "UnknownSession",
]
