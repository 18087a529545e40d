"""What both clients share: channel options, tensor <-> wire encoding, Put requests.

Put chunks are framed by hand (``embcache.proto.framing``), so each is copied once.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import torch

from embcache.proto.checksum import crc32
from embcache.proto.constants import (
    AUTH_KEY,
    CHUNK_BYTES,
    MAX_MESSAGE_BYTES,
    SERVICE_PATH,
)
from embcache.proto.dtypes import torch_dtype
from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.proto.embcache.v1 import embcache_pb2_grpc as pb_grpc
from embcache.proto.framing import encode_chunk

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


def normalize_target(target: str) -> str:
    """``unix:/path`` and ``host:port`` pass through; a bare absolute path is a Unix socket."""
    if target.startswith("/"):
        return f"unix:{target}"
    return target


def connect(
    target: str,
    *,
    tls: bool,
    root_certificates: bytes | None,
    options: Sequence[tuple[str, Any]],
    aio: bool,
) -> tuple[Any, Any, Any]:
    """``(channel, stub, put)`` of a client: a channel (``grpc.aio`` with ``aio``) with
    embcache's options, TLS when asked for; the service stub; and the ``Put`` client
    stream, whose requests use :func:`encode_put` (chunks serialised without a copy)."""
    opts = [*CHANNEL_OPTIONS, *options]
    flavour: Any = grpc.aio if aio else grpc
    if tls or root_certificates is not None:
        creds = grpc.ssl_channel_credentials(root_certificates)
        channel = flavour.secure_channel(target, creds, options=opts)
    else:
        channel = flavour.insecure_channel(target, options=opts)
    put = channel.stream_unary(
        SERVICE_PATH + "Put",
        request_serializer=encode_put,
        response_deserializer=pb.PutResponse.FromString,
    )
    return channel, pb_grpc.EmbeddingCacheStub(channel), put


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return ((AUTH_KEY, f"Bearer {token}"),) if token else ()


@dataclass(frozen=True, slots=True)
class Payload:
    """A tensor flattened for a Put: wire dtype name, shape, and its bytes (no copy)."""

    dtype: str
    shape: tuple[int, ...]
    data: memoryview

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def header(self, key: str, *, checksum: bool = True) -> pb.PutHeader:
        header = pb.PutHeader(key=key, dtype=self.dtype, shape=self.shape, nbytes=self.nbytes)
        if checksum:
            header.checksum = crc32(self.data)
        return header

    def messages(self, key: str, *, checksum: bool = True) -> Iterator[Any]:
        """The Put stream: a header message, then 1 MiB memoryview chunks (see encode_put)."""
        yield pb.PutRequest(header=self.header(key, checksum=checksum))
        for start in range(0, self.nbytes, CHUNK_BYTES):
            yield self.data[start : start + CHUNK_BYTES]


def payload_of(tensor: Any) -> Payload:
    """Flatten a torch tensor or numpy array (any device; CUDA is copied to the host)."""
    if isinstance(tensor, torch.Tensor):
        t = tensor.detach()
        if t.device.type != "cpu":
            # PutFromDevice (the daemon reading the CUDA tensor over IPC) needs the device
            # pool; until then device tensors travel as bytes like any other.
            t = t.cpu()
        t = t.contiguous()
        dtype = str(t.dtype).removeprefix("torch.")
        flat = t.reshape(-1).view(torch.uint8).numpy()
        return Payload(dtype, tuple(t.shape), flat.data)
    if isinstance(tensor, np.ndarray):
        arr = np.ascontiguousarray(tensor)
        flat = arr.reshape(-1).view(np.uint8)
        return Payload(arr.dtype.name, tuple(arr.shape), flat.data)
    raise TypeError(f"put takes a torch.Tensor or numpy.ndarray, not {type(tensor).__name__}")


def encode_put(message: Any) -> bytes:
    """Request serializer of Put: protobuf for the header, hand-framed ``chunk`` fields."""
    if isinstance(message, pb.PutRequest):
        return message.SerializeToString()
    return encode_chunk(message)


def as_keys(keys: str | Sequence[str]) -> tuple[list[str], bool]:
    """(list of keys, whether a single key was given)."""
    if isinstance(keys, str):
        return [keys], True
    keys = list(keys)
    for key in keys:
        if not isinstance(key, str):
            raise TypeError(f"keys must be strings, not {type(key).__name__}")
    return keys, False


@dataclass(slots=True)
class EntryBytes:
    """An entry fetched as bytes (``get_bytes``): works from any machine."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    data: bytearray

    def tensor(self) -> torch.Tensor:
        """The bytes as a tensor (shares memory with ``data``)."""
        flat = (
            torch.frombuffer(self.data, dtype=torch.uint8)
            if self.data
            else torch.empty(0, dtype=torch.uint8)
        )
        return flat.view(torch_dtype(self.dtype)).view(self.shape)


class BytesCollector:
    """Assembles a GetBytes stream into one preallocated buffer."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.meta: pb.TensorMeta | None = None
        self.buf = bytearray()
        self.pos = 0

    def add(self, message: pb.GetBytesResponse, length: int | None, offset: int) -> None:
        kind = message.WhichOneof("kind")
        if kind == "meta":
            self.meta = message.meta
            want = message.meta.nbytes - offset if length is None else length
            self.buf = bytearray(max(want, 0))
        elif kind == "chunk":
            chunk = message.chunk
            if self.meta is None or self.pos + len(chunk) > len(self.buf):
                raise ValueError("GetBytes stream out of order or longer than announced")
            self.buf[self.pos : self.pos + len(chunk)] = chunk
            self.pos += len(chunk)

    def result(self) -> EntryBytes:
        if self.meta is None or self.pos != len(self.buf):
            raise ValueError("GetBytes stream ended early")
        return EntryBytes(self.key, self.meta.dtype, tuple(self.meta.shape), self.buf)


def evict_request(keys: list[str], device: Any = None) -> pb.EvictRequest:
    """An Evict request; ``device`` (``"cuda"``, ``"cuda:N"``, an index) limits it to the
    keys' copies on that GPU (their host copies stay)."""
    request = pb.EvictRequest(keys=keys)
    if device is not None:
        from embcache.clients.device import resolve_device

        request.gpu_uuid = resolve_device(device)[1]
    return request


def prefetch_request(keys: Sequence[str], device: Any = None) -> pb.PrefetchRequest:
    """A Prefetch request; ``device`` (``"cuda"``, ``"cuda:N"``, an index) also warms that GPU."""
    request = pb.PrefetchRequest(keys=list(keys))
    if device is not None:
        from embcache.clients.device import resolve_device

        request.gpu_uuid = resolve_device(device)[1]
    return request


def prefetch_dict(reply: pb.PrefetchResponse) -> dict[str, int]:
    return {
        f: int(getattr(reply, f)) for f in ("requested", "local", "fetched", "missing", "resident")
    }
