"""Sessions of the asyncio client: what both transports share, and the gRPC Session stream.

A session's calls and results are those of the blocking client's (``sync_session``): the
daemon names the session when it opens, each call has an id, and the result of a call whose
caller gave up has its leases released. Here a task reads the results and futures wait for
them; ``async_socket_session`` carries the same over the session socket.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import itertools
import os
from typing import Any

import grpc

from embcache.clients.core.errors import RpcFailed
from embcache.clients.core.session_calls import SessionLost, note_posted_failure, unclaimed_release
from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.proto.embcache.v1 import services as pb_grpc
from embcache.proto.framing import call_message


class AsyncCalls(abc.ABC):
    """An asyncio session of either transport (a gRPC Session stream here, the session
    socket in ``async_socket_session.py``): the task that reads results, the call ids and the
    futures that wait for them, the deadline, and the leases of results nobody waits for. A
    subclass reads and sends messages, ends its transport and names the errors of that
    transport."""

    transport_errors: tuple[type[BaseException], ...] = ()
    what = "the session"

    def __init__(self) -> None:
        self.session_id: str | None = None
        self.serves_calls = False
        self.serves_device_puts = False
        self.serves_host_puts = False  # put / put_batch with the bytes inline
        self.serves_stash_puts = False  # stash_refill / stash_commit (same uid)
        self.posted_commits: pb.PostedCommits | None = None  # stash commits may be posted
        self.serves_bytes_out = False  # get_bytes, its bytes raw after the result (sockets)
        self.serves_get_into = False  # get_into as a session call
        self.serves_inline_gets = False  # host gets with small entries copied after the result
        self.read_table: pb.ReadTableInfo | None = None  # where same-node gets may copy from
        self.lease_ttl_s = 0.0  # the daemon's default lease lifetime (0: not said)
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[pb.SessionResult]] = {}
        self._payloads: dict[int, bytearray] = {}  # call id -> raw bytes after its result
        self._reader: asyncio.Task[None] | None = None

    @abc.abstractmethod
    async def _read(self) -> pb.SessionResponse | None:
        """The next message; None at the end of the stream."""

    @abc.abstractmethod
    async def _send(self, msg: pb.SessionRequest) -> None: ...

    async def _send_call(self, call_id: int, request: dict[str, Any]) -> None:
        """Send a call (the session socket frames inline puts by hand: ``framing.py``)."""
        await self._send(call_message(call_id, request))

    @abc.abstractmethod
    def _end_transport(self) -> None:
        """Cancel the stream or close the socket (which ends the session in the daemon)."""

    def _opened(self, opened: pb.SessionOpened) -> None:
        """The daemon's first message: start reading results."""
        self.session_id = opened.session_id
        self.serves_calls = opened.calls
        self.serves_device_puts = opened.device_puts
        self.serves_host_puts = opened.host_puts
        self.serves_stash_puts = opened.stash_puts
        self.serves_bytes_out = opened.bytes_out
        self.serves_get_into = opened.get_into
        self.serves_inline_gets = opened.inline_gets
        self.read_table = opened.read_table if opened.HasField("read_table") else None
        self.posted_commits = opened.posted_commits if opened.HasField("posted_commits") else None
        self.lease_ttl_s = opened.lease_ttl_s
        self._reader = asyncio.get_running_loop().create_task(self._drain())

    @property
    def alive(self) -> bool:
        return self._reader is not None and not self._reader.done()

    async def _drain(self) -> None:
        try:
            with contextlib.suppress(*self.transport_errors, asyncio.CancelledError):
                while (msg := await self._read()) is not None:
                    if msg.WhichOneof("kind") == "result":
                        await self._deliver(msg.result)
        finally:
            waiting, self._waiting = self._waiting, {}
            for fut in waiting.values():
                if not fut.done():
                    fut.set_exception(SessionLost(f"{self.what} ended during the call"))

    async def _deliver(self, result: pb.SessionResult) -> None:
        fut = self._waiting.pop(result.call_id, None)
        if fut is not None and not fut.done():
            fut.set_result(result)
            return
        self._payloads.pop(result.call_id, None)  # nobody waits for it
        note_posted_failure(result)
        if (release := unclaimed_release(result)) is not None:  # its caller gave up
            with contextlib.suppress(*self.transport_errors):  # gone: so are the leases
                await self._send(release)

    async def call(self, timeout: float, **request: Any) -> pb.SessionResult:
        """Send a call (``get=``, ``release=``, ``put_from_device=``...) and wait for its
        result. RpcFailed(DEADLINE_EXCEEDED) after ``timeout``; SessionLost if the session
        ends first."""
        return (await self.call_with_payload(timeout, **request))[0]

    async def call_with_payload(
        self, timeout: float, **request: Any
    ) -> tuple[pb.SessionResult, bytearray | None]:
        """:meth:`call`, and the raw bytes that followed its result (a get_bytes'), if any."""
        if not self.alive:
            raise SessionLost(f"{self.what} has ended")
        call_id = next(self._ids)
        fut: asyncio.Future[pb.SessionResult] = asyncio.get_running_loop().create_future()
        self._waiting[call_id] = fut
        try:
            await self._send_call(call_id, request)
            result = await asyncio.wait_for(asyncio.shield(fut), timeout)
            return result, self._payloads.pop(call_id, None)
        except TimeoutError:
            raise RpcFailed(
                "deadline exceeded waiting for a session call", "DEADLINE_EXCEEDED"
            ) from None
        except self.transport_errors as err:
            raise SessionLost(f"{self.what} failed: {err}") from err
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self._waiting.pop(call_id, None)
                await asyncio.shield(self._deliver(fut.result()))  # unread: release its leases
            raise
        finally:
            self._waiting.pop(call_id, None)
            self._payloads.pop(call_id, None)

    async def post(self, now: bool = False, **request: Any) -> None:
        """Send a call without waiting for its result (a release: nothing to wait for);
        the result is read and dropped. SessionLost if the session has ended. (A stream
        sends it at once: ``now`` is for the session socket, which holds posts back.)"""
        if not self.alive:
            raise SessionLost(f"{self.what} has ended")
        try:
            await self._send(pb.SessionRequest(call=pb.SessionCall(call_id=0, **request)))
        except self.transport_errors as err:
            raise SessionLost(f"{self.what} failed: {err}") from err

    async def close(self) -> None:
        self._end_transport()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader


class AsyncSession(AsyncCalls):
    """One gRPC Session stream of the asyncio client."""

    transport_errors = (grpc.RpcError,)
    what = "the Session stream"

    def __init__(self, call: Any) -> None:
        super().__init__()
        self._call = call
        self._writing = asyncio.Lock()

    @classmethod
    async def open(
        cls, stub: pb_grpc.EmbeddingCacheStub, metadata: Any, name: str, timeout: float
    ) -> AsyncSession:
        hello = pb.SessionRequest(hello=pb.SessionHello(client_name=name, pid=os.getpid()))
        session = cls(stub.Session(metadata=metadata))
        try:
            await asyncio.wait_for(session._call.write(hello), timeout)
            first = await asyncio.wait_for(session._call.read(), timeout)
        except BaseException:
            session._call.cancel()
            raise
        if first is grpc.aio.EOF or first.WhichOneof("kind") != "opened":
            session._call.cancel()
            raise RpcFailed("the Session stream ended at once", "UNAVAILABLE")
        session._opened(first.opened)
        return session

    async def _read(self) -> pb.SessionResponse | None:
        msg = await self._call.read()
        return None if msg is grpc.aio.EOF else msg

    async def _send(self, msg: pb.SessionRequest) -> None:
        async with self._writing:
            await self._call.write(msg)

    def _end_transport(self) -> None:
        self._call.cancel()
