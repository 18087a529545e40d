"""Framing that both ends write by hand, outside protobuf's message classes.

- **Put chunks.** Protobuf would copy each 1 MiB chunk twice (into a bytes object, then
  into the serialized message). A client writes the two or three header bytes of the
  ``PutRequest.chunk`` field in front of the payload instead, and the daemon hands a
  message that is exactly that one field to the put as a view of the received bytes. The
  bytes on the wire are those protobuf would write. ``GetBytesResponse.chunk`` is field 2
  too, so the daemon writes GetBytes chunks the same way (one copy, out of the pool) and
  the client reads them the same way (one copy, into its buffer).
- **The session socket.** Each message is its length (4 bytes, little-endian), then the
  serialized ``SessionRequest`` / ``SessionResponse``.
- **Inline puts on the session socket** (:class:`InlinePuts`). Python protobuf copies a
  ``bytes`` field each time a message is nested into another and again to serialize it:
  building a ``put_batch`` of 16 x 64 KiB cost the client about 2-6 ms on the CI machine,
  against about 0.15 ms for the daemon to parse it. So the client writes the frame of a
  ``SessionCall`` carrying ``put`` / ``put_batch`` itself: headers serialized by protobuf,
  the payloads joined in once. The daemon parses it as any other message.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from embcache.proto.embcache.v1 import embcache_pb2 as pb

# PutRequest.chunk and GetBytesResponse.chunk: field 2, wire type 2 (length-delimited)
CHUNK_TAG = (2 << 3) | 2
FRAME_HEADER = struct.Struct("<I")  # session socket: the length of the message that follows
# Field numbers of the messages an inline put's frame nests (session.proto, puts.proto).
_REQUEST_CALL, _CALL_ID, _CALL_PUT, _CALL_PUT_BATCH = 3, 1, 6, 7
_PUT_HEADER, _PUT_DATA, _BATCH_ITEMS = 1, 2, 1


def _len_field(number: int, length: int) -> bytes:
    """The tag and length of a length-delimited field ``number`` of ``length`` bytes."""
    return varint((number << 3) | 2) + varint(length)


def varint(value: int) -> bytes:
    """``value`` as a protobuf base-128 varint."""
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_chunk(data: Any) -> bytes:
    """A ``PutRequest`` (or ``GetBytesResponse``) holding only ``chunk = data``, serialized
    (one copy of ``data``)."""
    view = memoryview(data).cast("B")
    return b"".join((bytes((CHUNK_TAG,)), varint(view.nbytes), view))


def chunk_payload(data: bytes) -> memoryview | None:
    """The payload of a serialized ``PutRequest`` (or ``GetBytesResponse``) that is exactly
    one ``chunk`` field, as a view of ``data``; None for any other message (parse it as
    protobuf)."""
    if data[:1] != bytes((CHUNK_TAG,)):
        return None
    length, pos, shift = 0, 1, 0
    while pos < len(data) and pos <= 10:
        byte = data[pos]
        length |= (byte & 0x7F) << shift
        pos += 1
        shift += 7
        if not byte & 0x80:
            return memoryview(data)[pos:] if pos + length == len(data) else None
    return None


@dataclass(frozen=True, slots=True)
class InlinePuts:
    """Host puts sent inline in one session call: ``put`` (one item, ``batch`` False) or
    ``put_batch``; each item a ``PutHeader`` and its bytes (a view, not copied)."""

    items: Sequence[tuple[pb.PutHeader, memoryview]]
    batch: bool

    @property
    def kind(self) -> str:
        return "put_batch" if self.batch else "put"

    def message(self) -> pb.SessionPut | pb.SessionPutBatch:
        """As a protobuf message (a gRPC Session stream sends those)."""
        puts = [pb.SessionPut(header=h, data=d.tobytes()) for h, d in self.items]
        return pb.SessionPutBatch(items=puts) if self.batch else puts[0]

    def frame(self, call_id: int) -> bytes:
        """The session-socket frame of ``SessionRequest{call{call_id, put | put_batch}}``,
        the bytes protobuf would write, with each payload copied once."""
        pieces: list[Any] = []
        items_len = 0
        for header, data in self.items:
            head = header.SerializeToString()
            parts: tuple[bytes, ...] = (_len_field(_PUT_HEADER, len(head)), head)
            if data.nbytes:  # proto3 leaves an empty field out
                parts = (*parts, _len_field(_PUT_DATA, data.nbytes))
            item_len = sum(len(p) for p in parts) + data.nbytes
            if self.batch:
                prefix = _len_field(_BATCH_ITEMS, item_len)
                pieces.append(prefix)
                items_len += len(prefix)
            pieces.extend((*parts, data))
            items_len += item_len
        field = _CALL_PUT_BATCH if self.batch else _CALL_PUT
        call_head = varint(_CALL_ID << 3) + varint(call_id) + _len_field(field, items_len)
        call_len = len(call_head) + items_len
        request_head = _len_field(_REQUEST_CALL, call_len)
        size = len(request_head) + call_len
        return b"".join((FRAME_HEADER.pack(size), request_head, call_head, *pieces))


def call_message(call_id: int, request: dict[str, Any]) -> pb.SessionRequest:
    """``SessionRequest{call{call_id, **request}}``; an :class:`InlinePuts` value becomes
    its protobuf message (the gRPC Session stream's way)."""
    fields = {k: v.message() if isinstance(v, InlinePuts) else v for k, v in request.items()}
    return pb.SessionRequest(call=pb.SessionCall(call_id=call_id, **fields))


def call_frame(call_id: int, request: dict[str, Any]) -> bytes:
    """The session-socket frame of a call: an :class:`InlinePuts` framed by hand, any
    other request through protobuf."""
    if len(request) == 1:
        (value,) = request.values()
        if isinstance(value, InlinePuts):
            return value.frame(call_id)
    return frame(call_message(call_id, request))


def frame(message: Any) -> bytes:
    """A session-socket frame: the length prefix, then the serialized message."""
    body = message.SerializeToString()
    return FRAME_HEADER.pack(len(body)) + body
