"""The daemon's typed errors, rebuilt in the client from the status it sent.

The daemon names the error type in the trailing metadata ``embcache-error`` (or in a session
call's ``CallError``); the client raises the same class from ``embcache.errors``, so
``except EntryLeased`` works on both sides, with ``grpc_status`` set. Failures without a type
(the daemon unreachable, a deadline passed) raise :class:`RpcFailed`.
"""

from __future__ import annotations

from typing import Any

import grpc

from embcache import errors as _errors
from embcache.errors import EmbCacheError
from embcache.proto.constants import ERROR_TYPE_KEY


class RpcFailed(EmbCacheError):
    """A call failed with a status the daemon did not attach a typed error to; ``code`` is
    the status name (``"UNAVAILABLE"``, ``"DEADLINE_EXCEEDED"``, ...)."""

    def __init__(self, message: str, code: str, **details: Any) -> None:
        super().__init__(message, **details)
        self.code = code


def error_type(err: grpc.RpcError) -> str | None:
    """The error type the daemon named in a failed call's trailing metadata, if any."""
    trailing = getattr(err, "trailing_metadata", None)
    for key, value in (trailing() if callable(trailing) else None) or ():
        if key == ERROR_TYPE_KEY:
            return str(value)
    return None


def translate(err: grpc.RpcError) -> EmbCacheError:
    """The exception to raise for a failed call."""
    code = err.code() if callable(getattr(err, "code", None)) else grpc.StatusCode.UNKNOWN
    details = (err.details() if callable(getattr(err, "details", None)) else None) or ""
    return _typed(error_type(err), details, code)


def _typed(name: str | None, details: str, code: grpc.StatusCode) -> EmbCacheError:
    """The daemon's error class called ``name`` (RpcFailed for an unknown or absent name),
    carrying ``details`` and ``grpc_status``."""
    cls = getattr(_errors, name, None) if name else None
    exc: EmbCacheError
    if isinstance(cls, type) and issubclass(cls, EmbCacheError):
        exc = cls(details)
    else:
        exc = RpcFailed(details or code.name, code.name, error_type=name)
    exc.grpc_status = code  # type: ignore[attr-defined]
    return exc


def from_call_error(err: Any) -> EmbCacheError:
    """The exception for a failed session call (a ``CallError``), as :func:`translate`
    builds it for a failed RPC."""
    code = getattr(grpc.StatusCode, err.code, grpc.StatusCode.UNKNOWN)
    return _typed(err.error_type or None, err.message, code)
