"""The asyncio client's session on the daemon's session socket (``PATH.lane``).

The messages of a gRPC Session stream, each after its 4-byte length
(``embcache.proto.framing``); a task reads the results (``async_session.AsyncCalls``).
Closing the connection ends the session: the daemon releases its leases.
"""

from __future__ import annotations

import asyncio
import contextlib
import os

from google.protobuf.message import DecodeError

from embcache.clients._backends.async_session import AsyncCalls
from embcache.clients.core.errors import RpcFailed, from_call_error
from embcache.proto.constants import MAX_MESSAGE_BYTES
from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.proto.framing import FRAME_HEADER as HEADER
from embcache.proto.framing import frame


class AsyncUdsSession(AsyncCalls):
    """The asyncio twin of :class:`UdsSession`: a task reads the results."""

    transport_errors = (OSError, DecodeError)
    what = "the session socket"

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        super().__init__()
        self._stream = reader
        self._writer = writer

    @classmethod
    async def open(cls, path: str, token: str | None, name: str, timeout: float) -> AsyncUdsSession:
        reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(path), timeout)
        session = cls(reader, writer)
        try:
            hello = pb.SessionHello(client_name=name, pid=os.getpid(), auth_token=token or "")
            await session._send(pb.SessionRequest(hello=hello))
            first = await asyncio.wait_for(session._read(), timeout)
        except BaseException:
            writer.close()
            raise
        if first is None or first.WhichOneof("kind") != "opened":
            writer.close()
            if first is not None and first.WhichOneof("kind") == "result":
                raise from_call_error(first.result.error)
            raise RpcFailed("the session socket closed at once", "UNAVAILABLE")
        session._opened(first.opened)
        return session

    async def _read(self) -> pb.SessionResponse | None:
        try:
            head = await self._stream.readexactly(HEADER.size)
            (size,) = HEADER.unpack(head)
            if size > MAX_MESSAGE_BYTES:
                raise OSError(f"the session socket sent a message of {size} bytes")
            return pb.SessionResponse.FromString(await self._stream.readexactly(size))
        except asyncio.IncompleteReadError:
            return None

    async def _send(self, msg: pb.SessionRequest) -> None:
        self._writer.write(frame(msg))
        await self._writer.drain()

    def _end_transport(self) -> None:
        self._writer.close()

    async def close(self) -> None:
        await super().close()
        with contextlib.suppress(OSError):
            await self._writer.wait_closed()
