"""Error translation and per-call accounting for the gRPC servicer.

Every handler is wrapped by :func:`rpc`: typed engine errors become the status code of the
one error table (``status.py``) plus a trailing metadata entry
naming the error type; anything unexpected becomes INTERNAL with a logged stack trace.
Each finished call is reported to ``Metrics.observe_rpc`` with its code.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

import grpc

from embcache.errors import EmbCacheError, InvalidArgument
from embcache.proto.constants import ERROR_TYPE_KEY
from embcache.service.transport.accounting import RpcMetrics
from embcache.service.transport.grpc.busy_poll import BusyPoll
from embcache.service.transport.grpc.decoding import Undecodable
from embcache.service.transport.status import status_for

log = logging.getLogger("embcache.grpc")


class HasMetrics(Protocol):
    """What :func:`rpc` needs of the servicer it wraps."""

    metrics: RpcMetrics | None
    busy: BusyPoll


def grpc_code(error: EmbCacheError) -> grpc.StatusCode:
    """The status code of a typed error, from the one table."""
    return grpc.StatusCode[status_for(error).grpc_code]


S = TypeVar("S", bound=HasMetrics)
Handler = Callable[[S, Any, grpc.aio.ServicerContext], Awaitable[Any]]


def rpc(name: str) -> Callable[[Handler[S]], Handler[S]]:
    """Decorate a servicer method: map errors to status codes and record the call (and
    keep the loop polling for a while: ``busy_poll.py``)."""

    def decorate(method: Handler[S]) -> Handler[S]:
        @functools.wraps(method)
        async def wrapper(self: S, request: Any, context: grpc.aio.ServicerContext) -> Any:
            start = time.perf_counter()
            code = "OK"
            self.busy.poke()
            try:
                if isinstance(request, Undecodable):
                    raise InvalidArgument("request is not a valid message", reason=request.reason)
                return await method(self, request, context)
            except EmbCacheError as err:
                code = status_for(err).grpc_code
                log.info("%s -> %s: %s", name, code, err.describe())
                context.set_trailing_metadata(((ERROR_TYPE_KEY, type(err).__name__),))
                await context.abort(grpc_code(err), err.describe())
            except asyncio.CancelledError:
                code = "CANCELLED"
                raise
            except grpc.aio.AbortError:
                code = _code_name(context)
                raise
            except Exception:
                code = "INTERNAL"
                log.exception("%s failed unexpectedly", name)
                await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {name}")
            finally:
                metrics = self.metrics
                if metrics is not None:
                    metrics.observe_rpc("grpc", name, code, time.perf_counter() - start)

        return wrapper

    return decorate


def _code_name(context: grpc.aio.ServicerContext) -> str:
    code = context.code()
    return code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"
