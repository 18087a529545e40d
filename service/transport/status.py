"""The one table from embcache's errors to gRPC status codes and HTTP statuses.

This is the only place the two vocabularies meet: the engine raises errors from
``embcache.errors``, which know no status codes, and every transport (gRPC, the session
socket, REST) answers with the row this table gives. A subclass without a row of its own
takes its nearest parent's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from embcache import errors as e


@dataclass(frozen=True, slots=True)
class Status:
    """One row of the table: the gRPC code and the HTTP status of an error class."""

    grpc_code: str  # the name of a grpc.StatusCode member
    http_status: int


_TABLE: dict[type[e.EmbCacheError], Status] = {
    e.InvalidArgument: Status("INVALID_ARGUMENT", 400),
    e.NotFound: Status("NOT_FOUND", 404),
    e.MetadataConflict: Status("FAILED_PRECONDITION", 409),
    e.EntryLeased: Status("FAILED_PRECONDITION", 409),
    e.LeaseExpired: Status("FAILED_PRECONDITION", 409),
    e.UnknownSession: Status("FAILED_PRECONDITION", 409),
    e.DeviceUnavailable: Status("FAILED_PRECONDITION", 409),
    e.EntryTooLarge: Status("RESOURCE_EXHAUSTED", 413),
    e.QuotaExceeded: Status("RESOURCE_EXHAUSTED", 429),
    e.ReplyTooLarge: Status("RESOURCE_EXHAUSTED", 413),
    e.BodyTooLarge: Status("RESOURCE_EXHAUSTED", 413),
    e.IdleTimeout: Status("DEADLINE_EXCEEDED", 408),
    e.PoolExhausted: Status("RESOURCE_EXHAUSTED", 507),
    e.Draining: Status("UNAVAILABLE", 503),
    e.Unauthenticated: Status("UNAUTHENTICATED", 401),
    e.PermissionDenied: Status("PERMISSION_DENIED", 403),
    e.EmbCacheError: Status("INTERNAL", 500),
}

# The gRPC code REST reports for an HTTP status that no embcache error produced (a route
# that does not exist, a body FastAPI could not parse, ...).
HTTP_CODE_NAMES: dict[int, str] = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    405: "INVALID_ARGUMENT",
    408: "DEADLINE_EXCEEDED",
    409: "FAILED_PRECONDITION",
    413: "RESOURCE_EXHAUSTED",
    422: "INVALID_ARGUMENT",
    503: "UNAVAILABLE",
}


def status_for(error: e.EmbCacheError) -> Status:
    """The row of the table for ``error``: its class's, or its nearest parent's."""
    for cls in type(error).__mro__:
        row = _TABLE.get(cls)
        if row is not None:
            return row
    raise AssertionError(f"{type(error).__name__} is not an EmbCacheError")


def error_body(error: e.EmbCacheError) -> dict[str, Any]:
    """The JSON body REST answers ``error`` with: type, code, message and details."""
    return {
        "error": type(error).__name__,
        "code": status_for(error).grpc_code,
        "message": error.message,
        "details": {k: _jsonable(v) for k, v in error.details.items()},
    }


def _jsonable(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return str(value)
