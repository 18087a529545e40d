"""Session streams of the clients: they anchor a client's leases in the daemon.

The daemon names the session in its first reply; the client sends the name as
``x-embcache-session`` on later calls. When the stream ends (``close()``, the process dies,
the connection drops) the daemon releases every lease of the session and closes the client
allocations it opened through IPC for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import threading
from collections.abc import Iterator
from typing import Any

import grpc

from ..proto.embcache.v1 import embcache_pb2 as pb
from ..proto.embcache.v1 import embcache_pb2_grpc as pb_grpc
from .errors import RpcFailed


class Session:
    """One Session stream, read by a daemon thread; closing it releases its leases."""

    def __init__(self, stub: pb_grpc.EmbeddingCacheStub, metadata: Any, name: str, timeout: float):
        self._queue: queue.SimpleQueue[pb.SessionRequest | None] = queue.SimpleQueue()
        self._opened = threading.Event()
        self.session_id: str | None = None
        self.error: BaseException | None = None
        self.alive = True
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
                if msg.WhichOneof("kind") == "opened":
                    self.session_id = msg.opened.session_id
                    self._opened.set()
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.CANCELLED:
                self.error = err
        finally:
            self.alive = False
            self._opened.set()

    def close(self) -> None:
        self.alive = False
        self._queue.put(None)
        self._call.cancel()
        self._thread.join(timeout=5.0)


class AsyncSession:
    def __init__(self, call: Any) -> None:
        self._call = call
        self.session_id: str | None = None
        self._reader: asyncio.Task[None] | None = None

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
        session.session_id = first.opened.session_id
        session._reader = asyncio.get_running_loop().create_task(session._drain())
        return session

    async def _drain(self) -> None:
        with contextlib.suppress(grpc.RpcError, asyncio.CancelledError):
            while await self._call.read() is not grpc.aio.EOF:
                pass

    @property
    def alive(self) -> bool:
        return self._reader is not None and not self._reader.done()

    async def close(self) -> None:
        self._call.cancel()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
