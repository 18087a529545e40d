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
"""

from __future__ import annotations

import struct
from typing import Any

# PutRequest.chunk and GetBytesResponse.chunk: field 2, wire type 2 (length-delimited)
CHUNK_TAG = (2 << 3) | 2
FRAME_HEADER = struct.Struct("<I")  # session socket: the length of the message that follows


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


def frame(message: Any) -> bytes:
    """A session-socket frame: the length prefix, then the serialized message."""
    body = message.SerializeToString()
    return FRAME_HEADER.pack(len(body)) + body
