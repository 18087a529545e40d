"""One connection to the session socket: one session, opened by the client's hello
(``server.py`` says what the socket carries). It reads length-prefixed ``SessionRequest``
frames, hands calls to its session, and writes results (with raw bytes after them where a
call has any), holding reading back while the client does not read or the session is at its
bound of calls in flight.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from google.protobuf.message import DecodeError

from embcache.errors import EmbCacheError, QuotaExceeded, Unauthenticated
from embcache.proto.constants import MAX_MESSAGE_BYTES, SESSION_SOCKET_LABEL
from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.proto.framing import FRAME_HEADER as HEADER
from embcache.proto.framing import frame
from embcache.service.transport.session.bytes_out import BytesReply
from embcache.service.transport.session.call_kinds import Produce
from embcache.service.transport.session.open import OpenSession
from embcache.service.transport.session.registry import PeerCreds, peer_address
from embcache.service.transport.session.service import SessionService
from embcache.service.transport.session.waiters import Gate
from embcache.service.transport.session_socket import admission
from embcache.service.transport.session_socket.admission import Admission
from embcache.service.transport.sockets import keepalive, peer_credentials, unread_bytes
from embcache.service.transport.status import status_for

log = logging.getLogger("embcache.session_socket")
SMALL_WRITE = 256 << 10  # a result and raw bytes up to this size go out in one write


class Listener(Protocol):
    """What a connection needs of the listener that accepted it (``server.SessionSocketServer``)."""

    service: SessionService
    limits: Admission
    path: Path | None

    @property
    def connections(self) -> int: ...
    def track(self, conn: SessionConnection) -> None: ...
    def opened(self, conn: SessionConnection) -> None: ...
    def forget(self, conn: SessionConnection) -> None: ...
    def longest_waiting(self) -> SessionConnection | None: ...
    def authorized(self, hello: pb.SessionHello) -> bool: ...


class SessionConnection(asyncio.Protocol):
    """One client connection: one session, opened by the client's hello."""

    def __init__(self, server: Listener, tcp: bool = False) -> None:
        self.server = server
        self.tcp = tcp
        self.transport: asyncio.Transport | None = None
        self.session: OpenSession | None = None
        self.peer: PeerCreds | None = None
        self._hello_timer: asyncio.TimerHandle | None = None  # closes it if no hello in time
        self._refused = False  # refused before its session opened: counted once, no place
        self._buf = bytearray()
        self._writable = Gate()  # shut while the client does not read (writes back up)
        self._sending: set[BytesReply] = set()  # replies whose views may still be buffered
        self._at_bound = False  # reading stopped: the session has max_session_calls running
        self.received = 0  # bytes read from the client so far
        self._posting = False  # its client has posted a commit (``session/posted.py``)

    # -- asyncio.Protocol ------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        sock = transport.get_extra_info("socket")
        creds = peer_credentials(sock)
        self.peer = PeerCreds(*creds) if creds is not None else None
        if self.tcp and sock is not None:
            keepalive(sock)
        # Paused as soon as anything waits in the buffer, resumed once it is empty: a
        # client that does not read is held back at once, and resume_writing tells when a
        # get_bytes reply's views have all been sent.
        transport.set_write_buffer_limits(high=0, low=0)
        limits = self.server.limits
        if self.server.connections >= limits.max_connections:
            waited = self.server.longest_waiting()
            if waited is None:  # every place is a session: never closed to make room
                self._refuse_early(
                    admission.CONNECTIONS,
                    QuotaExceeded("too many session-socket connections; use gRPC",
                                  limit=limits.max_connections),
                )  # fmt: skip
                return
            waited.give_way()
        self.server.track(self)
        loop = asyncio.get_running_loop()
        self._hello_timer = loop.call_later(limits.hello_timeout_s, self._hello_overdue)

    def data_received(self, data: bytes) -> None:
        self.received += len(data)
        self._buf += data
        self._handle_buffered()

    def _handle_buffered(self) -> None:
        buf = self._buf
        at = 0
        while len(buf) - at >= HEADER.size:
            if self.session is not None and self.session.calls.full:
                self._at_bound = True  # read on once a call ends (_on_room)
                self._update_reading()
                break
            (size,) = HEADER.unpack_from(buf, at)
            if self.session is None and size > self.server.limits.hello_max_bytes:
                limit = self.server.limits.hello_max_bytes
                self._refuse_early(admission.HELLO_TOO_LARGE, f"{size} bytes (limit {limit})")
                return
            if size > MAX_MESSAGE_BYTES:
                self._drop(f"message of {size} bytes (limit {MAX_MESSAGE_BYTES})")
                return
            end = at + HEADER.size + size
            if len(buf) < end:
                break
            try:
                with memoryview(buf) as view:  # parsed in place, not copied first
                    msg = pb.SessionRequest.FromString(view[at + HEADER.size : end])
            except DecodeError:
                self._drop("undecodable message")
                return
            at = end
            self._on_message(msg)
            if self.transport is None or self.transport.is_closing():
                return
        del buf[:at]

    def pause_writing(self) -> None:
        # A client that sends calls but does not read their results: stop reading its
        # calls too (backpressure, as HTTP/2 flow control gives a gRPC stream).
        self._writable.shut()
        self._update_reading()

    def resume_writing(self) -> None:
        # The write buffer is empty (low-water mark 0): called inside the transport's last
        # send, before the loop runs anything else, so a reply's lease ends before its
        # reader can have the last of its bytes (and, say, evict the entry).
        self._release_sent()
        self._writable.open()
        self._update_reading()

    def _release_sent(self) -> None:
        """End the leases of replies whose bytes have all left (the buffer is empty)."""
        transport = self.transport
        if self._sending and transport is not None and transport.get_write_buffer_size() == 0:
            sending, self._sending = self._sending, set()
            for reply in sending:
                reply.release()

    def _on_room(self) -> None:
        """A call ended below the bound: handle what is buffered, read on."""
        if self._at_bound and self.transport is not None and not self.transport.is_closing():
            self._at_bound = False
            self._update_reading()
            self._handle_buffered()

    def _update_reading(self) -> None:
        """Read while the client reads its results and the session is below its bound."""
        if self.transport is None or self.transport.is_closing():
            return
        if self._at_bound or not self._writable.is_open:
            self.transport.pause_reading()
        else:
            self.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        # The buffer is gone: the replies' leases end first, as released, so that the
        # session's end below does not take them for forced ends (and quarantine them).
        sending, self._sending = self._sending, set()
        for reply in sending:
            reply.release()
        self.server.forget(self)
        self._stop_hello_timer()
        self._writable.open()  # waiting writers find the connection closed
        self.server.service.posted.discard(self)
        if self.session is not None:
            self.session.end()  # cancels its calls, releases its leases

    # -- messages --------------------------------------------------------------------------
    def _on_message(self, msg: pb.SessionRequest) -> None:
        kind = msg.WhichOneof("kind")
        if self.session is None:
            if kind != "hello":
                self._refuse_early(admission.BAD_HELLO, "the first message must be a hello")
            elif not self.server.authorized(msg.hello):
                why = Unauthenticated("missing or invalid auth token")
                self._refuse_early(admission.UNAUTHENTICATED, why)
            else:
                self._stop_hello_timer()
                self.server.opened(self)
                self.session = self.server.service.open_session(
                    self._send,
                    SESSION_SOCKET_LABEL,
                    self.peer,
                    self._send_bytes,
                    client=self._client(),
                )
                self.session.calls.on_room = self._on_room
                self.session.calls.send_now = self._send_now
                self.session.calls.on_posted = self._posted
                if self.session.record is not None:  # an operator's drop (from any thread)
                    loop = asyncio.get_running_loop()
                    self.session.record.end = functools.partial(
                        loop.call_soon_threadsafe, self.abort
                    )
                self.session.handle(msg, self._peer())
                self._write(pb.SessionResponse(opened=self.session.opened))
        elif kind == "ping":
            self._write(pb.SessionResponse(pong=msg.ping))
        elif kind is None:
            self._drop("empty message")
        else:
            self.session.handle(msg, self._peer())

    # -- posted commits (``session/posted.py``) --------------------------------------------
    def _posted(self) -> None:
        if not self._posting:
            self._posting = True
            self.server.service.posted.add(self)

    def written(self) -> int:
        """Bytes the client has written so far: read, or queued in the kernel."""
        sock = self.transport.get_extra_info("socket") if self.transport is not None else None
        return self.received + unread_bytes(sock)

    def handled_through(self, mark: int) -> bool:
        """Whether every whole message within the first ``mark`` bytes is handled."""
        if self.transport is None or self.transport.is_closing():
            return True
        buf = self._buf
        whole = len(buf) >= HEADER.size and len(buf) >= HEADER.size + HEADER.unpack_from(buf)[0]
        return self.received >= mark and not whole

    def _send_now(self, produce: Callable[[], pb.SessionResponse]) -> bool:
        """Write ``produce()`` now if the client reads its results (the gate is open); False,
        nothing produced, if not (``SessionCalls.send_now``)."""
        if not self._writable.is_open or self.transport is None or self.transport.is_closing():
            return False
        self._write(produce())
        return True

    async def _send(self, msg: pb.SessionResponse) -> None:
        """A call's result (SessionCalls); waits while the client is not reading."""
        await self._writable.wait()
        if self.transport is None or self.transport.is_closing():
            raise ConnectionResetError("the session socket connection closed")
        self._write(msg)

    async def _send_bytes(self, produce: Produce) -> None:
        """A get_bytes result and its bytes (``bytes_out.py``): read once writes have room,
        then written back to back (nothing else can come between on the loop); the reply's
        lease ends once the transport holds none of its views."""
        await self._writable.wait()
        transport = self.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the session socket connection closed")
        response, reply = produce()
        if reply is None:
            self._write(response)
            return
        if sum(len(v) for v in reply.views) <= SMALL_WRITE:  # one send: cheaper than two
            transport.write(b"".join((frame(response), *reply.views)))
        else:
            self._write(response)
            for view in reply.views:
                transport.write(view)
        if transport.get_write_buffer_size() == 0:  # the socket took it all at once
            reply.release()
            return
        # What is left may be the views themselves: the lease ends in resume_writing (the
        # buffer is empty) or connection_lost (the buffer is gone), unless the reader is
        # still too slow at the drain deadline.
        self._sending.add(reply)
        wait_s = max(reply.drain_deadline - time.monotonic(), 0.0)
        asyncio.get_running_loop().call_later(wait_s, self._overdue, reply)

    def _overdue(self, reply: BytesReply) -> None:
        """``reply``'s bytes are still unsent at its drain deadline: close the connection
        (its buffer goes, views included; ``connection_lost`` ends the lease)."""
        if reply in self._sending and self.transport is not None:
            log.info("session socket: a reader left %d bytes unread; closing it",
                     self.transport.get_write_buffer_size())  # fmt: skip
            self.transport.abort()

    def _write(self, msg: pb.SessionResponse) -> None:
        assert self.transport is not None
        self.transport.write(frame(msg))

    def _refuse(self, err: EmbCacheError, quiet: bool = False) -> None:
        """Answer ``err`` as a failed call (code from the one error table) and close
        (``quiet``: logged by the caller)."""
        code = status_for(err).grpc_code
        if not quiet:
            log.info("session socket: refused a session: %s", err)
        self._count(code)
        error = pb.CallError(code=code, message=err.describe(), error_type=type(err).__name__)
        self._write(pb.SessionResponse(result=pb.SessionResult(call_id=0, error=error)))
        self.close()

    @property
    def _listener(self) -> str:
        return "tcp" if self.tcp else "unix"

    def _refuse_early(self, reason: str, why: EmbCacheError | str) -> None:
        """Close a connection whose session has not opened, counted by ``reason``: ``why``
        an error is answered first (a client that reads learns why), a string is logged."""
        if self._refused:  # one refusal per connection (it may still be closing)
            return
        self._refused = True
        self.server.forget(self)  # its place is free at once: never displaced once refused
        self.server.limits.refused(self._listener, reason, str(why))
        self._stop_hello_timer()
        if isinstance(why, EmbCacheError):
            self._refuse(why, quiet=True)
        else:
            self._drop(why, quiet=True)

    def give_way(self) -> None:
        """Close this connection, which waited longest for its hello, to make room for a new
        one at the cap (``admission.py``); its place is free at once."""
        limit = self.server.limits.max_connections
        err = QuotaExceeded("too many session-socket connections waiting for a hello; this "
                            "one waited longest", limit=limit)  # fmt: skip
        self._refuse_early(admission.DISPLACED, err)

    def _hello_overdue(self) -> None:
        self._hello_timer = None
        if self.session is None and self.transport is not None:
            limit = self.server.limits.hello_timeout_s
            self._refuse_early(admission.HELLO_TIMEOUT, f"no hello within {limit} s")

    def _stop_hello_timer(self) -> None:
        if self._hello_timer is not None:
            self._hello_timer.cancel()
            self._hello_timer = None

    def _drop(self, reason: str, quiet: bool = False) -> None:
        if not quiet:
            log.info("session socket: closing a connection: %s", reason)
        self._count("INVALID_ARGUMENT")
        assert self.transport is not None
        self.transport.abort()

    def _count(self, code: str) -> None:
        """A connection refused or dropped, in the metrics as a failed Session call."""
        metrics = self.server.service.metrics
        if metrics is not None:
            metrics.observe_rpc(SESSION_SOCKET_LABEL, "Session", code, 0.0)

    def close(self) -> None:
        """Close after what is buffered is sent; that ends the session."""
        if self.transport is not None:
            self.transport.close()  # after what is buffered; connection_lost ends the session

    def abort(self) -> None:
        """Close now, dropping what is buffered (an operator dropped the session)."""
        if self.transport is not None:
            self.transport.abort()

    def _client(self) -> str:
        """Who this is without peer credentials: on TCP its address, without the port."""
        if self.tcp and self.transport is not None:
            peername = self.transport.get_extra_info("peername")
            if isinstance(peername, tuple) and peername:
                return f"tcp:{peer_address(f'ipv6:[{peername[0]}]:0')}"
        return "unix"

    def _peer(self) -> str:
        if self.tcp and self.transport is not None:
            return f"{SESSION_SOCKET_LABEL}-tcp:{self.transport.get_extra_info('peername')}"
        return f"{SESSION_SOCKET_LABEL}:{self.server.path}"
