"""The asyncio client's session on the daemon's session socket (``PATH.lane``, or its TCP
port for a client that reached gRPC over TCP).

The messages of a gRPC Session stream, each after its 4-byte length
(``embcache.proto.framing``); a task reads the results (``async_session.AsyncCalls``).
Closing the connection ends the session: the daemon releases its leases. A posted release
rides in front of the next call, in one write (``sync_socket_session``). The reading task
also reads the raw bytes after a get_bytes result, for ``call_with_payload``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from typing import Any

from google.protobuf.message import DecodeError

from embcache.clients._backends.async_session import AsyncCalls
from embcache.clients._backends.sync_socket_session import Address, payload_size
from embcache.clients.core.errors import RpcFailed, from_call_error
from embcache.clients.core.session_calls import SessionLost
from embcache.proto.constants import MAX_MESSAGE_BYTES
from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.proto.framing import FRAME_HEADER as HEADER
from embcache.proto.framing import call_frame, frame

_LIMIT = 1 << 20  # the stream reader's buffer: large payloads are read in big pieces


class AsyncSocketSession(AsyncCalls):
    """The asyncio twin of :class:`SocketSession`: a task reads the results."""

    transport_errors = (OSError, DecodeError)
    what = "the session socket"

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        super().__init__()
        self._stream = reader
        self._writer = writer
        self._posted: list[bytes] = []  # frames of posted calls, sent before the next call

    @classmethod
    async def open(
        cls, address: Address, token: str | None, name: str, timeout: float, spin_s: float = 0.0
    ) -> AsyncSocketSession:
        """Connect and open a session (``spin_s`` is the blocking twin's; a task reads here)."""
        if isinstance(address, tuple):
            connecting = asyncio.open_connection(*address, limit=_LIMIT)
        else:
            connecting = asyncio.open_unix_connection(address, limit=_LIMIT)
        reader, writer = await asyncio.wait_for(connecting, timeout)
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
            msg = pb.SessionResponse.FromString(await self._stream.readexactly(size))
            if payload := payload_size(msg):
                self._payloads[msg.result.call_id] = bytearray(
                    await self._stream.readexactly(payload)
                )
            return msg
        except asyncio.IncompleteReadError:
            return None

    async def post(self, now: bool = False, **request: Any) -> None:
        """Queue a release (call id 0: no result) for the next call's write
        (``sync_socket_session``); ``now``: write it (and any queued) at once."""
        if not self.alive:
            raise SessionLost(f"{self.what} has ended")
        data = frame(pb.SessionRequest(call=pb.SessionCall(call_id=0, **request)))
        if now:
            await self._send_frame(data)  # with whatever was posted before it, in one write
        else:
            self._posted.append(data)

    async def _send_call(self, call_id: int, request: dict[str, Any]) -> None:
        await self._send_frame(call_frame(call_id, request))

    async def _send(self, msg: pb.SessionRequest) -> None:
        await self._send_frame(frame(msg))

    async def _send_frame(self, data: bytes) -> None:
        if self._posted:
            data = b"".join((*self._posted, data))
            self._posted.clear()
        self._writer.write(data)
        await self._writer.drain()

    def _end_transport(self) -> None:
        if self._posted:  # before the end of the session (a quarantine otherwise)
            with contextlib.suppress(OSError):
                self._writer.write(b"".join(self._posted))
            self._posted.clear()
        self._writer.close()

    async def close(self) -> None:
        await super().close()
        with contextlib.suppress(OSError):
            await self._writer.wait_closed()
