"""The gRPC side of ``embcache.v1``: a client stub and server registration, read off the
service descriptor of the generated ``embcache_pb2``.

grpcio-tools' ``_pb2_grpc.py`` spells out every method three times (stub, servicer,
handler table) from what the descriptor already says: each method's name, its request and
response types and whether either side streams. Deriving them here keeps one source, the
.proto, and leaves nothing to regenerate when a method is added. Paths, serialization and
the registered-method fast path are those of the generated code, so the wire is the same.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.descriptor import MethodDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass

from embcache.proto.embcache.v1 import embcache_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["EmbeddingCache"]
SERVICE_NAME = SERVICE.full_name  # "embcache.v1.EmbeddingCache"

# The channel method and the server handler maker of each shape, keyed by
# (client_streaming, server_streaming).
_CHANNEL_CALLS = {
    (False, False): "unary_unary",
    (False, True): "unary_stream",
    (True, False): "stream_unary",
    (True, True): "stream_stream",
}
HANDLER_MAKERS: Mapping[tuple[bool, bool], Callable[..., grpc.RpcMethodHandler]] = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


@dataclass(frozen=True, slots=True)
class RpcMethod:
    """One method of the service: its wire path, message classes and streaming shape."""

    name: str  # "Get"
    path: str  # "/embcache.v1.EmbeddingCache/Get"
    request: type[Message]
    response: type[Message]
    client_streaming: bool
    server_streaming: bool

    @classmethod
    def of(cls, method: MethodDescriptor) -> RpcMethod:
        return cls(
            name=method.name,
            path=f"/{SERVICE_NAME}/{method.name}",
            request=GetMessageClass(method.input_type),
            response=GetMessageClass(method.output_type),
            client_streaming=method.client_streaming,
            server_streaming=method.server_streaming,
        )

    @property
    def shape(self) -> tuple[bool, bool]:
        """``(client_streaming, server_streaming)``: which call and handler kind it takes."""
        return (self.client_streaming, self.server_streaming)


METHODS: tuple[RpcMethod, ...] = tuple(RpcMethod.of(m) for m in SERVICE.methods)


class EmbeddingCacheStub:
    """Client stub of ``embcache.v1.EmbeddingCache``: one multicallable attribute per method
    (``stub.Get(request, metadata=...)``), on a ``grpc.Channel`` or a ``grpc.aio.Channel``."""

    def __init__(self, channel: Any) -> None:
        for method in METHODS:
            call = getattr(channel, _CHANNEL_CALLS[method.shape])
            multicallable = call(
                method.path,
                request_serializer=method.request.SerializeToString,
                response_deserializer=method.response.FromString,
                _registered_method=True,  # as the generated stub: the channel knows the path
            )
            setattr(self, method.name, multicallable)

    def __getattr__(self, name: str) -> Any:
        # Only reached for names __init__ did not set; also tells type checkers that the
        # methods are there.
        raise AttributeError(f"{SERVICE_NAME} has no method {name!r}")


def _unimplemented(name: str) -> Callable[[Any, Any, grpc.ServicerContext], Any]:
    def method(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        context.set_code(grpc.StatusCode.UNIMPLEMENTED)
        context.set_details("Method not implemented!")
        raise NotImplementedError("Method not implemented!")

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"``{name}``: UNIMPLEMENTED until a subclass serves it."
    return method


class EmbeddingCacheServicer:
    """Base of a servicer: every method answers UNIMPLEMENTED until a subclass defines it,
    as the generated base does, so a partial servicer still registers every path."""


for _method in METHODS:
    setattr(EmbeddingCacheServicer, _method.name, _unimplemented(_method.name))
del _method


def method_handlers(servicer: Any) -> dict[str, grpc.RpcMethodHandler]:
    """The handler of each method, by name: ``servicer``'s method of that name, messages
    parsed with ``FromString`` and replies serialized with ``SerializeToString``."""
    return {
        method.name: HANDLER_MAKERS[method.shape](
            getattr(servicer, method.name),
            request_deserializer=method.request.FromString,
            response_serializer=method.response.SerializeToString,
        )
        for method in METHODS
    }


def add_handlers(server: Any, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
    """Register ``handlers`` (by method name) on a ``grpc.Server`` or ``grpc.aio.Server``:
    as a generic handler, and as registered methods where the server takes them (grpcio
    1.63 and later), which skips a lookup per call."""
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    register = getattr(server, "add_registered_method_handlers", None)
    if register is not None:
        register(SERVICE_NAME, handlers)


def add_servicer_to_server(servicer: Any, server: Any) -> None:
    """Serve ``servicer`` (an :class:`EmbeddingCacheServicer`) on ``server``, as the
    generated ``add_EmbeddingCacheServicer_to_server`` does."""
    add_handlers(server, method_handlers(servicer))
