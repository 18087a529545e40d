"""Method handlers of ``embcache.v1.EmbeddingCache`` with forgiving request parsing.

The plain registration (``services.add_servicer_to_server``) parses requests with
``FromString``; bytes that are not a valid message then fail inside gRPC as INTERNAL. Here a
parse failure becomes an :class:`Undecodable` value that the servicer rejects with
INVALID_ARGUMENT, like any other malformed request.

Put chunks skip protobuf: a message that is exactly one ``chunk`` field is handed to the
servicer as a memoryview of the received bytes, so each chunk is copied once, into the pool.
GetBytes chunks skip it on the way out: the servicer writes them already serialized
(``proto.framing.encode_chunk``), and such ``bytes`` are sent as they are.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.proto.embcache.v1.services import HANDLER_MAKERS, METHODS, add_handlers
from embcache.proto.framing import chunk_payload


@dataclass(frozen=True, slots=True)
class Undecodable:
    """A request whose bytes are not a valid message of the method's type."""

    nbytes: int
    reason: str


def _parser(message_cls: Any) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return message_cls.FromString(data)
        except (DecodeError, ValueError) as exc:
            return Undecodable(len(data), str(exc) or type(exc).__name__)

    return parse


_parse_put = _parser(pb.PutRequest)


def decode_put_request(data: bytes) -> pb.PutRequest | memoryview | Undecodable:
    """A chunk-only message as a memoryview of its payload; anything else parsed."""
    payload = chunk_payload(data)
    return payload if payload is not None else _parse_put(data)


async def _single_request(context: grpc.aio.ServicerContext) -> Any:
    """The request message of a unary-request method, read from the stream.

    One read: a unary client sends its message and the end of the stream together, so
    waiting for the end as well would cost every call another trip through the loop
    (docs/grpc.md, "Server"). Messages after the first are not read.
    """
    message = await context.read()
    if message is grpc.aio.EOF:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no request message")
    return message


def _unary_request(method: Callable[..., Any]) -> Callable[..., Any]:
    """Serve a unary-request method as a streaming-request one on the wire.

    The bytes on the wire are the same; but a call whose stream ends before its request
    message (which a unary handler would wait on forever) now gets INVALID_ARGUMENT.
    """

    async def handler(_requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
        return await method(await _single_request(context), context)

    return handler


def _serialized_or(message: Any) -> bytes:
    """A message serialized, or ``bytes`` that already are one (GetBytes chunks)."""
    return message if isinstance(message, bytes) else message.SerializeToString()


def add_servicer(servicer: Any, server: grpc.aio.Server) -> None:
    """Register ``servicer`` (an EmbeddingCacheServicer) on ``server``."""
    handlers: dict[str, grpc.RpcMethodHandler] = {}
    for method in METHODS:
        parse = decode_put_request if method.name == "Put" else _parser(method.request)
        behaviour = getattr(servicer, method.name)
        if not method.client_streaming:
            behaviour = _unary_request(behaviour)
        make = HANDLER_MAKERS[(True, method.server_streaming)]
        serialize = method.response.SerializeToString
        if method.name == "GetBytes":
            serialize = _serialized_or
        handlers[method.name] = make(
            behaviour,
            request_deserializer=parse,
            response_serializer=serialize,
        )
    add_handlers(server, handlers)  # also as registered methods: skips a lookup per call
