"""The gRPC channel of a client: embcache's options, TLS, the stub, and the Put stream.

The options let messages reach the daemon's limit, notice a dead daemon on an idle Session
stream, and reconnect to a restarted one within a second (gRPC's own reconnect backoff grows
with the outage, longer than the client's retries wait).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc

from embcache.clients.core.payload import encode_put
from embcache.proto.constants import AUTH_KEY, MAX_MESSAGE_BYTES, SERVICE_PATH
from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.proto.embcache.v1 import services as pb_grpc

CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # Notice a dead daemon (or a cut link) on an idle Session stream within ~15 s.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # Reconnect to a restarted daemon within a second: gRPC's default backoff grows with the
    # outage (up to 120 s), longer than the client's own retries wait.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)


def connect(
    target: str,
    *,
    tls: bool,
    root_certificates: bytes | None,
    options: Sequence[tuple[str, Any]],
    aio: bool,
    private_key: bytes | None = None,
    certificate_chain: bytes | None = None,
) -> tuple[Any, Any, Any, Any]:
    """``(channel, stub, put, get_bytes)`` of a client: a channel (``grpc.aio`` with
    ``aio``) with embcache's options, TLS when asked for (with a client certificate for a
    daemon that verifies one: ``private_key`` and ``certificate_chain``); the service stub;
    the ``Put`` client stream, whose requests use :func:`encode_put` (chunks serialised
    without a copy); and the ``GetBytes`` server stream, whose replies stay serialized
    (``replies.BytesCollector`` copies a chunk's payload once, into its buffer)."""
    opts = [*CHANNEL_OPTIONS, *options]
    flavour: Any = grpc.aio if aio else grpc
    if (private_key is None) != (certificate_chain is None):
        raise ValueError("private_key and certificate_chain go together (a client certificate)")
    if tls or root_certificates is not None or certificate_chain is not None:
        creds = grpc.ssl_channel_credentials(root_certificates, private_key, certificate_chain)
        channel = flavour.secure_channel(target, creds, options=opts)
    else:
        channel = flavour.insecure_channel(target, options=opts)
    put = channel.stream_unary(
        SERVICE_PATH + "Put",
        request_serializer=encode_put,
        response_deserializer=pb.PutResponse.FromString,
    )
    get_bytes = channel.unary_stream(
        SERVICE_PATH + "GetBytes",
        request_serializer=pb.GetBytesRequest.SerializeToString,
        response_deserializer=bytes,
    )
    return channel, pb_grpc.EmbeddingCacheStub(channel), put, get_bytes


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The metadata every call carries: the bearer token, when the daemon wants one."""
    return ((AUTH_KEY, f"Bearer {token}"),) if token else ()
