"""The blocking client's session on the daemon's session socket (``PATH.lane``, or its TCP
port for a client that reached gRPC over TCP).

Same calls and results as a gRPC Session stream (``sync_session``), framed by a 4-byte length
(``embcache.proto.framing``), and no thread of its own: the caller writes its call and reads
the socket itself. With several callers in flight, one of them at a time reads; each result
it reads wakes the caller it belongs to, and the reading passes to whoever still waits, so no
result waits for a thread hop. Closing the connection ends the session: the daemon releases
its leases. A posted release is not sent on its own: it rides in front of the next call (one
write, one wake-up of the daemon), or goes out when the session closes. A get_bytes result is
followed by the entry's bytes raw; whoever reads the result reads them too, straight into the
buffer the caller gets (``call_with_payload``).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import select
import socket
import threading
import time
from typing import Any

from google.protobuf.message import DecodeError

from embcache.clients.core.errors import RpcFailed, from_call_error
from embcache.clients.core.session_calls import (
    SessionLost,
    expected_work_s,
    note_posted_failure,
    unclaimed_release,
)
from embcache.proto.constants import MAX_MESSAGE_BYTES
from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.proto.framing import FRAME_HEADER as HEADER
from embcache.proto.framing import call_frame, frame

_TIMEOUT = object()  # _read_one: nothing complete arrived before the deadline
PAYLOAD_STALL_S = 60.0  # a payload that makes no progress this long: the connection is lost
Address = str | tuple[str, int]  # a Unix socket's path, or a TCP (host, port)


def connect_socket(address: Address, timeout: float) -> socket.socket:
    """A connected blocking socket to a session socket at ``address``."""
    if isinstance(address, tuple):
        sock = socket.create_connection(address, timeout=timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    else:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            sock.connect(address)
        except BaseException:
            sock.close()
            raise
    sock.settimeout(None)  # blocking sends; reads wait in poll() with a deadline
    return sock


def payload_size(msg: pb.SessionResponse) -> int:
    """How many raw bytes follow ``msg`` (a get_bytes result's, or a get's inline copies),
    0 for any other."""
    if msg.WhichOneof("kind") != "result":
        return 0
    outcome = msg.result.WhichOneof("outcome")
    if outcome == "get_bytes":
        return int(msg.result.get_bytes.payload_bytes)
    if outcome == "get":
        return int(msg.result.get.inline_bytes)
    return 0


class _Waiter:
    __slots__ = ("done", "result")

    def __init__(self) -> None:
        self.done = False
        self.result: pb.SessionResult | None = None


class SocketSession:
    """One session on the session socket; the interface of :class:`~.sync_session.Session`."""

    def __init__(
        self, address: Address, token: str | None, name: str, timeout: float, spin_s: float = 0.0
    ) -> None:
        """Connect, say hello (with the token) and wait up to ``timeout`` for the session;
        later results are polled for ``spin_s`` without sleeping before the reader sleeps."""
        sock = connect_socket(address, timeout)
        self._sock = sock
        self._spin_s = spin_s
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN)
        self._buf = bytearray()
        self._send_lock = threading.Lock()
        self._posted: list[bytes] = []  # frames of posted calls, sent before the next call
        self._cond = threading.Condition()
        self._reading = False  # a caller is reading the socket
        self._waiting: dict[int, _Waiter] = {}
        self._payloads: dict[int, bytearray] = {}  # call id -> the raw bytes after its result
        self._ids = itertools.count(1)
        self._alive = True
        self.error: BaseException | None = None
        self.session_id: str | None = None
        self.serves_calls = False
        self.serves_device_puts = False
        self.serves_host_puts = False  # put / put_batch with the bytes inline
        self.serves_stash_puts = False  # stash_refill / stash_commit (same uid)
        self.serves_bytes_out = False  # get_bytes, its bytes raw after the result
        self.serves_get_into = False  # get_into as a session call
        self.serves_inline_gets = False  # host gets with small entries copied after the result
        self.read_table: pb.ReadTableInfo | None = None  # where same-node gets may copy from
        self.posted_commits: pb.PostedCommits | None = None  # stash commits may be posted
        self.lease_ttl_s = 0.0  # the daemon's default lease lifetime (0: not said)
        try:
            hello = pb.SessionHello(client_name=name, pid=os.getpid(), auth_token=token or "")
            self._send(pb.SessionRequest(hello=hello))
            first = self._read_one(time.monotonic() + timeout)
        except BaseException:
            self.close()
            raise
        if first is _TIMEOUT or first is None:
            self.close()
            why = "did not open in time" if first is _TIMEOUT else "closed at once"
            raise RpcFailed(f"the session socket {why}", "UNAVAILABLE")
        assert isinstance(first, pb.SessionResponse)
        if first.WhichOneof("kind") != "opened":
            self.close()
            if first.WhichOneof("kind") == "result" and first.result.HasField("error"):
                raise from_call_error(first.result.error)
            raise RpcFailed("the session socket did not open", "UNKNOWN")
        self.session_id = first.opened.session_id
        self.serves_calls = first.opened.calls
        self.serves_device_puts = first.opened.device_puts
        self.serves_host_puts = first.opened.host_puts
        self.serves_stash_puts = first.opened.stash_puts
        self.serves_bytes_out = first.opened.bytes_out
        self.serves_get_into = first.opened.get_into
        self.serves_inline_gets = first.opened.inline_gets
        if first.opened.HasField("read_table"):
            self.read_table = first.opened.read_table
        if first.opened.HasField("posted_commits"):
            self.posted_commits = first.opened.posted_commits
        self.lease_ttl_s = first.opened.lease_ttl_s

    @classmethod
    def open(
        cls, address: Address, token: str | None, name: str, timeout: float, spin_s: float = 0.0
    ) -> SocketSession:
        """A new session (the constructor; named as the asyncio twin's, which must await)."""
        return cls(address, token, name, timeout, spin_s)

    # -- calls -----------------------------------------------------------------------------
    def call(self, timeout: float, **request: Any) -> pb.SessionResult:
        """Send a call (``get=``, ``release=``, ``put_from_device=``...) and wait for its
        result. RpcFailed(DEADLINE_EXCEEDED) after ``timeout``; SessionLost if the socket
        closes first."""
        return self.call_with_payload(timeout, **request)[0]

    def call_with_payload(
        self, timeout: float, **request: Any
    ) -> tuple[pb.SessionResult, bytearray | None]:
        """:meth:`call`, and the raw bytes that followed its result (a get_bytes'), if any.

        A session that spins spins longer for a call whose copies take long (a GetInto, a
        device put: ``expected_work_s``), so that the result does not come just after the
        reader went to sleep."""
        call_id = next(self._ids)
        waiter = _Waiter()
        with self._cond:
            if not self._alive:
                raise SessionLost("the session socket has closed")
            self._waiting[call_id] = waiter
        try:
            self._send_frame(call_frame(call_id, request))
        except OSError as err:
            self._lost(err)
        spin_s = self._spin_s + expected_work_s(request) if self._spin_s else 0.0
        self._wait(waiter, time.monotonic() + timeout, spin_s)
        with self._cond:
            if waiter.done:
                assert waiter.result is not None
                return waiter.result, self._payloads.pop(call_id, None)
            self._waiting.pop(call_id, None)
            if not self._alive:
                raise SessionLost("the session socket closed during the call")
        raise RpcFailed("deadline exceeded waiting for a session call", "DEADLINE_EXCEEDED")

    def post(self, now: bool = False, **request: Any) -> None:
        """Queue a call whose result nobody waits for (a release: call id 0, which the daemon
        answers with nothing, older daemons with a result the next reader drops). It goes out
        in one write with the next call, so post only before a call of one's own; a close
        sends it first. ``now``: write it (and any queued) at once. SessionLost if closed."""
        if not self._alive:
            raise SessionLost("the session socket has closed")
        data = frame(pb.SessionRequest(call=pb.SessionCall(call_id=0, **request)))
        if not now:
            with self._send_lock:
                self._posted.append(data)
            return
        try:
            self._send_frame(data)  # with whatever was posted before it, in one write
        except OSError as exc:
            raise SessionLost(f"the session socket failed: {exc}") from exc

    def _wait(self, waiter: _Waiter, deadline: float, spin_s: float | None = None) -> None:
        """Until ``waiter`` has its result, the socket closes or the deadline passes: wait
        while another caller reads, else read one message and look again."""
        cond = self._cond
        while True:
            with cond:
                while self._reading and not waiter.done and self._alive:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return
                    cond.wait(left)
                if waiter.done or not self._alive or time.monotonic() >= deadline:
                    return
                self._reading = True
            try:
                try:
                    msg = self._read_one(deadline, spin_s)
                except (OSError, DecodeError) as err:
                    msg = None
                    self.error = err
                # Delivered before the reading passes on: a caller that took over the
                # reading first would sit in poll() while its own result waited here.
                if msg is None:
                    self._lost(None)
                elif msg is not _TIMEOUT:
                    assert isinstance(msg, pb.SessionResponse)
                    self._dispatch(msg)
            finally:
                with cond:
                    self._reading = False
                    cond.notify_all()

    def _dispatch(self, msg: pb.SessionResponse) -> None:
        if msg.WhichOneof("kind") == "result":
            self._deliver(msg.result)
        # else a pong

    def _deliver(self, result: pb.SessionResult) -> None:
        """Wake the caller of ``result``; if none waits (it gave up), free its leases."""
        with self._cond:
            waiter = self._waiting.pop(result.call_id, None)
            if waiter is not None:
                waiter.result = result
                waiter.done = True
                self._cond.notify_all()
                return
        self._payloads.pop(result.call_id, None)  # nobody waits for it
        note_posted_failure(result)
        if (release := unclaimed_release(result)) is not None:  # its caller gave up
            with contextlib.suppress(OSError):  # if the socket is gone, so are the leases
                self._send(release)

    # -- the socket ------------------------------------------------------------------------
    def _send(self, msg: pb.SessionRequest) -> None:
        self._send_frame(frame(msg))

    def _send_frame(self, data: bytes) -> None:
        with self._send_lock:
            if self._posted:  # posted releases first, in the same write
                data = b"".join((*self._posted, data))
                self._posted.clear()
            self._sock.sendall(data)

    def _read_one(
        self, deadline: float, spin_s: float | None = None
    ) -> pb.SessionResponse | object | None:
        """The next message; None at end of stream; ``_TIMEOUT`` at the deadline (a partial
        message stays buffered for the next reader). Spins ``spin_s`` (default: the
        session's) before it sleeps."""
        spin = self._spin_s if spin_s is None else spin_s
        buf = self._buf
        while True:
            if len(buf) >= HEADER.size:
                (size,) = HEADER.unpack_from(buf)
                if size > MAX_MESSAGE_BYTES:
                    raise OSError(f"the session socket sent a message of {size} bytes")
                end = HEADER.size + size
                if len(buf) >= end:
                    with memoryview(buf) as view:  # parsed in place, not copied first
                        msg = pb.SessionResponse.FromString(view[HEADER.size : end])
                    del buf[:end]
                    if size := payload_size(msg):
                        self._payloads[msg.result.call_id] = self._read_payload(size)
                    return msg
            data = self._spin_recv(spin) if spin else None
            if data is None:
                left = deadline - time.monotonic()
                if left <= 0 or not self._poll.poll(max(1, int(left * 1000) + 1)):
                    return _TIMEOUT
                data = self._sock.recv(1 << 16)
            if not data:
                return None
            buf += data

    def _spin_recv(self, spin_s: float) -> bytes | None:
        """What the socket has within ``spin_s``, read without sleeping (b"" at its end);
        None when nothing came: the caller sleeps in poll() then."""
        give_up = time.perf_counter() + spin_s
        while True:
            try:
                return self._sock.recv(1 << 16, socket.MSG_DONTWAIT)
            except BlockingIOError:
                if time.perf_counter() >= give_up:
                    return None

    def _read_payload(self, size: int) -> bytearray:
        """The ``size`` raw bytes after a result: what is buffered, then straight from the
        socket into the buffer. Read whole whatever the caller's deadline (the stream would
        be out of step otherwise); a payload that stalls loses the connection."""
        out = bytearray(size)
        have = min(size, len(self._buf))
        out[:have] = self._buf[:have]
        del self._buf[:have]
        with memoryview(out) as view:
            while have < size:
                if not self._poll.poll(int(PAYLOAD_STALL_S * 1000)):
                    raise OSError(f"the session socket stalled {size - have} bytes into a payload")
                n = self._sock.recv_into(view[have:], size - have)
                if n == 0:
                    raise OSError("the session socket closed inside a payload")
                have += n
        return out

    @property
    def alive(self) -> bool:
        """Whether the session is open. Nothing reads the socket between calls, so this
        looks (without taking a byte) whether the daemon has closed it meanwhile: an
        operator's drop-session, a daemon that stopped."""
        if self._alive:
            try:
                peeked = self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except BlockingIOError:
                peeked = b"-"
            except OSError as err:
                self._lost(err)
                return False
            if not peeked:
                self._lost(None)
        return self._alive

    def _lost(self, err: BaseException | None) -> None:
        with self._cond:
            self._alive = False
            if err is not None and self.error is None:
                self.error = err
            self._cond.notify_all()

    def close(self) -> None:
        """End the session (the daemon releases its leases) and close the socket. Posted
        releases go first: a lease the daemon saw end with the session while this process
        lives would stay quarantined until it exits."""
        with self._send_lock, contextlib.suppress(OSError):
            if self._posted and self._alive:
                self._sock.sendall(b"".join(self._posted))
            self._posted.clear()
        self._lost(None)
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes a caller reading it
        self._sock.close()
