"""Session streams of the clients: they anchor a client's leases in the daemon.

The daemon names the session in its first reply; the client sends the name as
``x-embcache-session`` on later calls. When the stream ends (``close()``, the process dies,
the connection drops) the daemon releases every lease of the session and closes the client
allocations it opened through IPC for it.

The stream also carries Get and Release calls (``SessionCall``) when the daemon says it
serves them: a message on an open stream costs about half a unary RPC. Each call has a
client-chosen id; its result wakes the caller waiting on that id. A result that arrives
after its caller gave up (deadline) hands out leases nobody holds: they are released.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import itertools
import os
import queue
import threading
from collections.abc import Iterator
from typing import Any

import grpc

from embcache.clients.core.errors import RpcFailed
from embcache.clients.core.session_calls import SessionLost, unclaimed_release
from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.proto.embcache.v1 import embcache_pb2_grpc as pb_grpc


class _Waiter:
    __slots__ = ("done", "result")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.result: pb.SessionResult | None = None


class Session:
    """One Session stream, read by a daemon thread; closing it releases its leases."""

    def __init__(self, stub: pb_grpc.EmbeddingCacheStub, metadata: Any, name: str, timeout: float):
        self._queue: queue.SimpleQueue[pb.SessionRequest | None] = queue.SimpleQueue()
        self._opened = threading.Event()
        self.session_id: str | None = None
        self.serves_calls = False  # the daemon runs SessionCall (it said so when opening)
        self.serves_device_puts = False  # ... including the device puts
        self.error: BaseException | None = None
        self.alive = True
        self._ids = itertools.count(1)
        self._waiting: dict[int, _Waiter] = {}
        self._waiting_lock = threading.Lock()
        hello = pb.SessionRequest(hello=pb.SessionHello(client_name=name, pid=os.getpid()))
        self._call = stub.Session(self._requests(hello), metadata=metadata)
        self._thread = threading.Thread(target=self._read, name="embcache-session", daemon=True)
        self._thread.start()
        if not self._opened.wait(timeout):
            self.close()
            raise RpcFailed("the Session stream did not open in time", "DEADLINE_EXCEEDED")
        if self.session_id is None:
            raise self.error or RpcFailed("the Session stream ended at once", "UNAVAILABLE")

    def _requests(self, hello: pb.SessionRequest) -> Iterator[pb.SessionRequest]:
        yield hello
        while (item := self._queue.get()) is not None:
            yield item

    def _read(self) -> None:
        try:
            for msg in self._call:
                kind = msg.WhichOneof("kind")
                if kind == "result":
                    self._deliver(msg.result)
                elif kind == "opened":
                    self.session_id = msg.opened.session_id
                    self.serves_calls = msg.opened.calls
                    self.serves_device_puts = msg.opened.device_puts
                    self._opened.set()
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.CANCELLED:
                self.error = err
        finally:
            self.alive = False
            self._opened.set()
            with self._waiting_lock:
                waiting, self._waiting = self._waiting, {}
            for waiter in waiting.values():
                waiter.done.set()  # no result: the caller raises SessionLost

    def _deliver(self, result: pb.SessionResult) -> None:
        with self._waiting_lock:  # a caller that times out checks the result under it
            waiter = self._waiting.pop(result.call_id, None)
            if waiter is not None:
                waiter.result = result
        if waiter is not None:
            waiter.done.set()
        elif (release := unclaimed_release(result)) is not None:  # its caller gave up
            self._queue.put(release)

    def call(self, timeout: float, **request: Any) -> pb.SessionResult:
        """Send a call (``get=``, ``release=``, ``put_from_device=``...) on the stream and
        wait for its result.
        RpcFailed(DEADLINE_EXCEEDED) after ``timeout``; SessionLost if the stream ends."""
        call_id = next(self._ids)
        waiter = _Waiter()
        with self._waiting_lock:
            if not self.alive:
                raise SessionLost("the Session stream has ended")
            self._waiting[call_id] = waiter
        self._queue.put(pb.SessionRequest(call=pb.SessionCall(call_id=call_id, **request)))
        if not waiter.done.wait(timeout):
            with self._waiting_lock:
                self._waiting.pop(call_id, None)
                late = waiter.result  # delivered just now: still ours
            if late is None:
                raise RpcFailed("deadline exceeded waiting for a session call", "DEADLINE_EXCEEDED")
        if waiter.result is None:
            raise SessionLost()
        return waiter.result

    def close(self) -> None:
        self.alive = False
        self._queue.put(None)
        self._call.cancel()
        self._thread.join(timeout=5.0)


class AsyncCalls(abc.ABC):
    """An asyncio session of either transport (a gRPC Session stream here, the session lane in
    ``lane.py``): the task that reads results, the call ids and the futures that wait for
    them, the deadline, and the leases of results nobody waits for. A subclass reads and
    sends messages, ends its transport and names the errors of that transport."""

    transport_errors: tuple[type[BaseException], ...] = ()
    what = "the session"

    def __init__(self) -> None:
        self.session_id: str | None = None
        self.serves_calls = False
        self.serves_device_puts = False
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[pb.SessionResult]] = {}
        self._reader: asyncio.Task[None] | None = None

    @abc.abstractmethod
    async def _read(self) -> pb.SessionResponse | None:
        """The next message; None at the end of the stream."""

    @abc.abstractmethod
    async def _send(self, msg: pb.SessionRequest) -> None: ...

    @abc.abstractmethod
    def _end_transport(self) -> None:
        """Cancel the stream or close the socket (which ends the session in the daemon)."""

    def _opened(self, opened: pb.SessionOpened) -> None:
        """The daemon's first message: start reading results."""
        self.session_id = opened.session_id
        self.serves_calls = opened.calls
        self.serves_device_puts = opened.device_puts
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
        elif (release := unclaimed_release(result)) is not None:  # its caller gave up
            with contextlib.suppress(*self.transport_errors):  # gone: so are the leases
                await self._send(release)

    async def call(self, timeout: float, **request: Any) -> pb.SessionResult:
        """Send a call (``get=``, ``release=``, ``put_from_device=``...) and wait for its
        result. RpcFailed(DEADLINE_EXCEEDED) after ``timeout``; SessionLost if the session
        ends first."""
        if not self.alive:
            raise SessionLost(f"{self.what} has ended")
        call_id = next(self._ids)
        fut: asyncio.Future[pb.SessionResult] = asyncio.get_running_loop().create_future()
        self._waiting[call_id] = fut
        try:
            await self._send(pb.SessionRequest(call=pb.SessionCall(call_id=call_id, **request)))
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
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
