"""Bearer-token check for every gRPC call (``authorization: Bearer <token>``).

Installed on the server when the daemon has an auth token; it then applies to every
listener, the Unix socket included. Health checks stay open so that orchestrators (which
cannot send metadata) can probe the daemon; they reveal only the serving status.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from embcache.errors import Unauthenticated
from embcache.proto.constants import AUTH_KEY, ERROR_TYPE_KEY
from embcache.service.transport.accounting import RpcMetrics
from embcache.service.transport.status import status_for

OPEN_PREFIXES = ("/grpc.health.v1.Health/",)


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call without the bearer token (module docstring); counts refusals."""

    def __init__(self, token: str, metrics: RpcMetrics | None = None) -> None:
        if not token:
            raise ValueError("token must not be empty")
        self._expected = f"Bearer {token}".encode()
        self._metrics = metrics

    def _authorized(self, metadata: Any) -> bool:
        for key, value in metadata or ():
            if key == AUTH_KEY:
                got = value.encode() if isinstance(value, str) else bytes(value)
                return hmac.compare_digest(got, self._expected)
        return False

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        """The method's handler when the call may pass, else one that answers UNAUTHENTICATED
        (the token is compared in constant time)."""
        method = handler_call_details.method
        if method.startswith(OPEN_PREFIXES) or self._authorized(
            handler_call_details.invocation_metadata
        ):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is None:  # unknown method: let gRPC answer UNIMPLEMENTED
            return handler
        if self._metrics is not None:
            self._metrics.observe_rpc("grpc", method.rsplit("/", 1)[-1], "UNAUTHENTICATED", 0.0)
        return _denying(handler)


def _denying(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that fails with UNAUTHENTICATED."""
    error = Unauthenticated("missing or invalid bearer token")
    code = grpc.StatusCode[status_for(error).grpc_code]

    async def deny(request: Any, context: grpc.aio.ServicerContext) -> None:
        context.set_trailing_metadata(((ERROR_TYPE_KEY, type(error).__name__),))
        await context.abort(code, error.message)

    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    make = kinds[(bool(handler.request_streaming), bool(handler.response_streaming))]
    return make(
        deny,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
