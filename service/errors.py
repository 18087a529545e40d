"""Typed engine errors and the one table that maps them to gRPC codes and HTTP statuses.

The engine raises these; transports translate them with :data:`ERROR_TABLE`, never by
inspecting messages. Each error carries the offending values in ``details``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class EmbCacheError(Exception):
    """Base of every expected error. ``code`` is the gRPC status code name."""

    code = "INTERNAL"

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def to_dict(self) -> dict[str, Any]:
        return {
            "error": type(self).__name__,
            "code": self.code,
            "message": self.message,
            "details": {k: _jsonable(v) for k, v in self.details.items()},
        }


def _jsonable(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return str(value)


class InvalidArgument(EmbCacheError):
    """Malformed request: bad key, dtype, shape, nbytes, chunk order, ..."""

    code = "INVALID_ARGUMENT"


class ChecksumMismatch(InvalidArgument):
    """The bytes of a put do not match the checksum its header declared."""


class NotFound(EmbCacheError):
    code = "NOT_FOUND"


class MetadataConflict(EmbCacheError):
    """Same key, different (dtype, shape)."""

    code = "FAILED_PRECONDITION"


class EntryLeased(EmbCacheError):
    """Explicit evict of an entry that has live leases."""

    code = "FAILED_PRECONDITION"


class LeaseExpired(EmbCacheError):
    """The lease is gone (released, expired, or its owner was dropped)."""

    code = "FAILED_PRECONDITION"


class EntryTooLarge(EmbCacheError):
    code = "RESOURCE_EXHAUSTED"


class PoolExhausted(EmbCacheError):
    """No room even after evicting every unleased entry."""

    code = "RESOURCE_EXHAUSTED"


class QuotaExceeded(EmbCacheError):
    """A client's in-flight bytes would pass its limit."""

    code = "RESOURCE_EXHAUSTED"


class Draining(EmbCacheError):
    code = "UNAVAILABLE"


class Unauthenticated(EmbCacheError):
    code = "UNAUTHENTICATED"


class PermissionDenied(EmbCacheError):
    code = "PERMISSION_DENIED"


class DeviceUnavailable(EmbCacheError):
    """The operation needs a device tier that this daemon does not have."""

    code = "FAILED_PRECONDITION"


@dataclass(frozen=True, slots=True)
class StatusMapping:
    grpc_code: str  # name of a grpc.StatusCode member
    http_status: int


# The one table. Keys are gRPC code names so subclasses inherit their parent's row.
ERROR_TABLE: dict[str, StatusMapping] = {
    "INVALID_ARGUMENT": StatusMapping("INVALID_ARGUMENT", 400),
    "NOT_FOUND": StatusMapping("NOT_FOUND", 404),
    "FAILED_PRECONDITION": StatusMapping("FAILED_PRECONDITION", 409),
    "RESOURCE_EXHAUSTED": StatusMapping("RESOURCE_EXHAUSTED", 507),
    "UNAVAILABLE": StatusMapping("UNAVAILABLE", 503),
    "UNAUTHENTICATED": StatusMapping("UNAUTHENTICATED", 401),
    "PERMISSION_DENIED": StatusMapping("PERMISSION_DENIED", 403),
    "DEADLINE_EXCEEDED": StatusMapping("DEADLINE_EXCEEDED", 504),
    "CANCELLED": StatusMapping("CANCELLED", 499),
    "INTERNAL": StatusMapping("INTERNAL", 500),
}

# Finer HTTP statuses where REST has a better word than the gRPC code's default.
_HTTP_OVERRIDES: dict[type[EmbCacheError], int] = {
    EntryTooLarge: 413,
    QuotaExceeded: 429,
}


def status_for(error: EmbCacheError) -> StatusMapping:
    """Row of :data:`ERROR_TABLE` for an error (with the REST refinements applied)."""
    row = ERROR_TABLE[error.code]
    for cls, http in _HTTP_OVERRIDES.items():
        if isinstance(error, cls):
            return StatusMapping(row.grpc_code, http)
    return row
