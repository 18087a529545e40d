"""A gRPC Session stream of the blocking client, read by a thread of its own.

A session anchors the client's leases in the daemon. The daemon names it in its first reply;
the client sends the name as ``x-embcache-session`` on later calls. When the stream ends
(``close()``, the process dies, the connection drops) the daemon releases every lease of the
session and closes the client allocations it opened through IPC for it. The stream also
carries calls (``SessionCall``) when the daemon says it serves them, cheaper than an RPC each;
the reader thread hands each result to the caller waiting on its id.
"""

from __future__ import annotations

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
from embcache.proto.embcache.v1 import services as pb_grpc
from embcache.proto.framing import call_message


class _Waiter:
    __slots__ = ("done", "result")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.result: pb.SessionResult | None = None


class Session:
    """One Session stream, read by a daemon thread; closing it releases its leases."""

    def __init__(self, stub: pb_grpc.EmbeddingCacheStub, metadata: Any, name: str, timeout: float):
        """Open the stream and wait (up to ``timeout``) for the daemon to name the session."""
        self._queue: queue.SimpleQueue[pb.SessionRequest | None] = queue.SimpleQueue()
        self._opened = threading.Event()
        self.session_id: str | None = None
        self.serves_calls = False  # the daemon runs SessionCall (it said so when opening)
        self.serves_device_puts = False  # ... including the device puts
        self.serves_host_puts = False  # ... and put / put_batch with the bytes inline
        self.serves_stash_puts = False  # likewise
        self.serves_bytes_out = False  # never on a gRPC stream (its frames are messages)
        self.serves_get_into = False  # ... get_into in the session (opened.get_into)
        self.serves_inline_gets = False  # never on a gRPC stream (no raw bytes follow)
        self.read_table: pb.ReadTableInfo | None = None  # where same-node gets may copy from
        self.lease_ttl_s = 0.0  # the daemon's default lease lifetime (0: not said)
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

    @classmethod
    def open(
        cls, stub: pb_grpc.EmbeddingCacheStub, metadata: Any, name: str, timeout: float
    ) -> Session:
        """A new session (the constructor; named as the asyncio twin's, which must await)."""
        return cls(stub, metadata, name, timeout)

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
                    self.serves_host_puts = msg.opened.host_puts
                    self.serves_stash_puts = msg.opened.stash_puts
                    self.serves_get_into = msg.opened.get_into
                    if msg.opened.HasField("read_table"):
                        self.read_table = msg.opened.read_table
                    self.lease_ttl_s = msg.opened.lease_ttl_s
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

    def call_with_payload(
        self, timeout: float, **request: Any
    ) -> tuple[pb.SessionResult, bytearray | None]:
        """:meth:`call` (a stream's results carry no raw bytes after them)."""
        return self.call(timeout, **request), None

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
        self._queue.put(call_message(call_id, request))
        if not waiter.done.wait(timeout):
            with self._waiting_lock:
                self._waiting.pop(call_id, None)
                late = waiter.result  # delivered just now: still ours
            if late is None:
                raise RpcFailed("deadline exceeded waiting for a session call", "DEADLINE_EXCEEDED")
        if waiter.result is None:
            raise SessionLost()
        return waiter.result

    def post(self, now: bool = False, **request: Any) -> None:
        """Send a call without waiting for its result (a release); the reader drops it.
        SessionLost if the stream has ended. (It is sent at once: ``now`` is for the
        session socket.)"""
        if not self.alive:
            raise SessionLost("the Session stream has ended")
        self._queue.put(pb.SessionRequest(call=pb.SessionCall(call_id=0, **request)))

    def close(self) -> None:
        self.alive = False
        self._queue.put(None)
        self._call.cancel()
        self._thread.join(timeout=5.0)
