"""Calls carried on a Session stream (``SessionCall``): Get, Release, the device puts
(PutFromDevice, PutFromDeviceBatch), the host puts (``host_puts.py``) and, on a session
socket, get_bytes (``bytes_out.py``) without a new RPC.

A message on an open stream costs about half a unary call in Python gRPC (no new HTTP/2
stream, headers, deadline or trailers; docs/grpc.md, ``Session`` in "RPCs"), and device
gets are latency-bound. The request, the reply and the error table are those of the unary
RPCs; the leases belong to the session that carries the call.

Calls run as tasks, so a slow one (a shared-tier fill) does not hold up the next; results
go back as they finish, tagged with the client's call id. Calls whose handlers never wait
(inline puts, stash refills and commits, releases, touches: ``call_kinds.at_once``) are
answered at once instead, inside the read of their frame, where the transport can write the
result now (the session socket whose client reads): a task and a loop iteration cost about
a third of an empty call. At most ``max_calls`` run at once: at the bound the transport
stops reading the session's requests (:meth:`SessionCalls.room`, ``on_room``) until one
finishes, so a client that pipelines calls without reading their results holds a bounded
number of tasks and leases, and tearing it down costs O(bound).
When the stream ends, the session is closed first, then its running calls are cancelled
and its leases dropped, without awaiting anything (a second cancellation of the stream's
handler must not skip the drop); everything a call waits on leaves in O(1) when cancelled
(``waiters.py``). A call that took leases and is still running gives them back itself: it
finds the session closed (the Get handlers check) or is cancelled at its next await (they
release on the way out), so no lease outlives the session. A result larger than a message
(the Get handlers refuse those first) is answered as ``ReplyTooLarge`` and its leases given
back, so it never ends the session. A release posted with call id 0 gets no result: its
caller does not wait for one (``SessionCall.call_id``). What each kind of call does is
``call_kinds.py``'s table.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from embcache.errors import EmbCacheError, InvalidArgument, ReplyTooLarge
from embcache.proto.constants import MAX_MESSAGE_BYTES
from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.service.transport.accounting import RpcMetrics
from embcache.service.transport.session.bytes_out import BytesReply
from embcache.service.transport.session.call_kinds import (
    AT_ONCE_CALLS,
    NAMES,
    TASK_CALLS,
    SessionIO,
    at_once,
    read_keys,
    served,
    touch_keys,
)
from embcache.service.transport.session.host_puts import THREAD_CRC_BYTES, SessionPuts, crc_bytes
from embcache.service.transport.status import status_for

log = logging.getLogger("embcache.grpc")


class SessionCalls:
    """The calls in flight on one session. ``owner``: the session, whose leases and IPC
    mappings they are; ``io``: its handlers and writers; ``quota_owner``: whose in-flight
    quota its device puts count against (the session's client; default ``owner``);
    ``max_calls``: the bound (0: none); ``host_puts``: its host puts, where served."""

    def __init__(
        self,
        owner: str,
        io: SessionIO,
        metrics: RpcMetrics | None,
        *,
        transport: str = "grpc",
        max_calls: int = 0,
        quota_owner: str | None = None,
        host_puts: SessionPuts | None = None,
    ) -> None:
        self.owner = owner
        self.quota_owner = quota_owner or owner
        self.max_calls = max_calls
        self.on_room: Callable[[], None] | None = None  # told when a call ends below the bound
        # ``send_now(produce)``: where the connection has room now (the session socket's),
        # writes ``produce()`` and says True; else False, ``produce`` not called. Calls whose
        # handlers never wait are then answered without a task.
        self.send_now: Callable[[Callable[[], pb.SessionResponse]], bool] | None = None
        self._room: asyncio.Future[None] | None = None  # the reader waiting for room
        self._transport = transport  # the metrics' label: "grpc"; "lane": the session socket
        self.io = io  # its handlers and writers
        self._metrics = metrics
        self._tasks: set[asyncio.Task[None]] = set()
        self.host_puts = host_puts  # the session's host puts and reservations, if served
        self.on_posted: Callable[[], None] | None = None  # told of each posted commit

    @property
    def serves_bytes(self) -> bool:
        """Whether get_bytes is served here (a session socket's calls)."""
        return self.io.read_bytes is not None and self.io.send_bytes is not None

    @property
    def serves_inline_gets(self) -> bool:
        """Whether host gets may send small entries as copies after the result here."""
        return self.io.inline_get is not None and self.io.send_bytes is not None

    def start(self, call: pb.SessionCall) -> None:
        """Run ``call`` as a task; its result is sent when it finishes. A posted release
        (call id 0: no result) runs at once instead, without a task: it only updates the
        lease table, and it rides in front of the client's next call; so does a posted
        touch (it only counts hits)."""
        if self.io.daemon.on_call is not None:
            self.io.daemon.on_call()
        kind = call.WhichOneof("request")
        if call.call_id == 0 and kind == "release":
            self._posted_release(call.release)
            return
        if call.call_id == 0 and kind == "touch":
            self._posted_touch(call.touch)
            return
        if call.call_id == 0 and kind == "stash_commit":
            self._posted_commit(call.stash_commit)
            return
        if at_once(kind, call) and self.send_now is not None and self._answer_now(call, kind):
            return
        task = asyncio.get_running_loop().create_task(self._run(call))
        self._tasks.add(task)
        task.add_done_callback(self._finished)

    def _answer_now(self, call: pb.SessionCall, kind: str) -> bool:
        """Run a call whose handler never waits (``at_once``) and write its result, with no
        task and no loop iteration in between; False, nothing run, when the connection
        cannot take the result now (the call then runs as a task, which waits for room)."""
        assert self.send_now is not None

        def produce() -> pb.SessionResponse:
            start = time.perf_counter()
            response = pb.SessionResponse()
            result = response.result
            result.call_id = call.call_id
            code = self._outcome(kind, lambda: AT_ONCE_CALLS[kind](self, call, result), result)
            if self._metrics is not None:
                name, elapsed = f"Session.{NAMES[kind]}", time.perf_counter() - start
                self._metrics.observe_rpc(self._transport, name, code, elapsed)
            return response

        return self.send_now(produce)

    @staticmethod
    def _outcome(kind: str, run: Callable[[], object], result: pb.SessionResult | None) -> str:
        """Run ``run()`` (which never waits) and return its status code; a failure is logged
        and, with a ``result``, made that result's error (None: a posted call's, which
        nobody reads)."""
        try:
            run()
        except EmbCacheError as err:
            code = status_for(err).grpc_code if result is None else _fail(result, err)
            log.info("Session.%s -> %s: %s", kind, code, err.describe())
            return code
        except Exception:
            if result is None:
                raise
            log.exception("Session.%s failed unexpectedly", kind)
            error = pb.CallError(code="INTERNAL", message=f"internal error in {kind}")
            result.error.CopyFrom(error)
            return "INTERNAL"
        return "OK"

    @property
    def in_flight(self) -> int:
        """Calls started and not finished (their results not sent yet)."""
        return len(self._tasks)

    @property
    def full(self) -> bool:
        """At the bound: the transport reads no more of the session's requests."""
        return 0 < self.max_calls <= len(self._tasks)

    async def room(self) -> None:
        """Until fewer than ``max_calls`` are in flight (a gRPC stream's reader awaits this
        before it reads the next request; HTTP/2 flow control then holds the client back)."""
        while self.full:
            self._room = asyncio.get_running_loop().create_future()
            await self._room

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if self.full:
            return
        waiter, self._room = self._room, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        if self.on_room is not None:
            self.on_room()

    def cancel(self) -> None:
        """Cancel the calls still running (each gives back the leases it took) and abort the
        session's put reservations (their pages go back); O(n)."""
        for task in list(self._tasks):
            task.cancel()
        if self.host_puts is not None:
            self.host_puts.close()

    async def _run(self, call: pb.SessionCall) -> None:
        start = time.perf_counter()
        kind = call.WhichOneof("request")
        keys = read_keys(call)
        if keys is not None and self.io.settle is not None:
            await self.io.settle(keys)  # a commit posted before this read is applied first
        if kind == "get_bytes":
            await self._get_bytes(call, start)
            return
        inline = kind == "get" and call.get.inline_max_bytes and not call.get.gpu_uuid
        if inline and self.serves_inline_gets:  # elsewhere the request's wish is ignored
            await self._inline(call, start)
            return
        response = pb.SessionResponse()
        result = response.result  # filled in place: the reply is copied once, into it
        result.call_id = call.call_id
        code = "OK"
        try:
            if kind in TASK_CALLS:
                await TASK_CALLS[kind](self, call, result)
            elif kind in AT_ONCE_CALLS:
                AT_ONCE_CALLS[kind](self, call, result)
            else:
                raise InvalidArgument("a session call carries a known request", kind=kind)
        except EmbCacheError as err:
            code = _fail(result, err)
            log.info("Session.%s -> %s: %s", kind, code, err.describe())
        except asyncio.CancelledError:
            code = "CANCELLED"
            raise
        except Exception:
            code = "INTERNAL"
            log.exception("Session.%s failed unexpectedly", kind)
            result.error.CopyFrom(pb.CallError(code=code, message=f"internal error in {kind}"))
        finally:
            if self._metrics is not None:
                name = f"Session.{NAMES.get(kind or '', 'Unknown')}"
                self._metrics.observe_rpc(self._transport, name, code, time.perf_counter() - start)
        if response.ByteSize() > MAX_MESSAGE_BYTES:  # would end the session: refuse it alone
            self._give_back(result)
            size = response.ByteSize()
            _fail(result, ReplyTooLarge("reply exceeds the message limit", size=size,
                                        limit=MAX_MESSAGE_BYTES))  # fmt: skip
        try:
            await self.io.send(response)
        except BaseException:
            self._give_back(result)  # nobody will read this result
            raise

    async def _get_bytes(self, call: pb.SessionCall, start: float) -> None:
        """A get_bytes: its result, then the bytes raw (``bytes_out.py``); refused where they
        cannot follow (gRPC)."""
        request = call.get_bytes

        def read(result: pb.SessionResult) -> BytesReply:
            if self.io.read_bytes is None:
                raise InvalidArgument(
                    "get_bytes is a session socket's call (SessionOpened.bytes_out)"
                )
            reply = self.io.read_bytes(request, self.owner)
            result.get_bytes.CopyFrom(reply.out)
            return reply

        await self._with_bytes(call, start, "get_bytes", read)

    async def _inline(self, call: pb.SessionCall, start: float) -> None:
        """A host get whose small entries follow the result as copies (``inline_gets.py``)."""

        def read(result: pb.SessionResult) -> BytesReply | None:
            assert self.io.inline_get is not None
            reply, copies = self.io.inline_get(call.get, self.owner)
            result.get.CopyFrom(reply)
            return copies

        await self._with_bytes(call, start, "get", read)

    async def _with_bytes(
        self,
        call: pb.SessionCall,
        start: float,
        kind: str,
        read: Callable[[pb.SessionResult], BytesReply | None],
    ) -> None:
        """A call whose result raw bytes follow: ``read(result)`` fills the result and says
        what follows, run once the connection has room; both are written together."""
        code = "OK"

        def produce() -> tuple[pb.SessionResponse, BytesReply | None]:
            nonlocal code
            response = pb.SessionResponse()
            result = response.result
            result.call_id = call.call_id
            reply = None
            try:
                if self.io.send_bytes is None:
                    raise InvalidArgument(
                        f"{kind} with raw bytes is a session socket's call", kind=kind
                    )
                reply = read(result)
            except EmbCacheError as err:
                code = _fail(result, err)
                log.info("Session.%s -> %s: %s", kind, code, err.describe())
            except Exception:
                if reply is not None:
                    reply.release()
                    reply = None
                self._give_back(result)
                code = "INTERNAL"
                log.exception("Session.%s failed unexpectedly", kind)
                error = pb.CallError(code=code, message=f"internal error in {kind}")
                result.error.CopyFrom(error)
            return response, reply

        try:
            if self.io.send_bytes is None:
                response, _ = produce()  # the refusal
                await self.io.send(response)
            else:
                await self.io.send_bytes(produce)
        except asyncio.CancelledError:
            code = "CANCELLED"
            raise
        finally:
            if self._metrics is not None:
                elapsed = time.perf_counter() - start
                name = f"Session.{NAMES.get(kind, 'Unknown')}"
                self._metrics.observe_rpc(self._transport, name, code, elapsed)

    def _posted_release(self, request: pb.ReleaseRequest) -> None:
        self._posted("release", lambda: self.io.daemon.release(request, self.owner))

    def _posted_touch(self, request: pb.TouchRequest) -> None:
        def touch() -> None:
            if self.io.touch is None:
                raise InvalidArgument("touch needs the daemon's read table (none here)")
            self.io.touch(touch_keys(request))  # over the budget: dropped and counted there

        self._posted("touch", touch)

    def _posted_commit(self, request: pb.StashCommitRequest) -> None:
        """A stash commit posted (call id 0; ``posted.py``): applied now, answered only
        if it fails, by a result with call id 0 that its client logs."""
        if self.on_posted is not None:
            self.on_posted()

        def commit() -> None:
            if (nbytes := crc_bytes(request)) > THREAD_CRC_BYTES:
                raise InvalidArgument("a posted stash_commit covers too many bytes",
                                      nbytes=nbytes, limit=THREAD_CRC_BYTES)  # fmt: skip
            served(self.host_puts, "stash_commit").stash_commit(request)

        self._posted("stash_commit", commit, answer_failure=True)

    def _posted(self, kind: str, run: Callable[[], object], answer_failure: bool = False) -> None:
        """Run a posted call (no result): its failure is logged; with ``answer_failure``
        also answered, by a result with call id 0, where the client reads now."""
        start = time.perf_counter()
        response = pb.SessionResponse() if answer_failure else None
        result = response.result if response is not None else None
        code = self._outcome(f"{kind} (posted)", run, result)
        if self._metrics is not None:
            elapsed = time.perf_counter() - start
            self._metrics.observe_rpc(self._transport, f"Session.{NAMES[kind]}", code, elapsed)
        if response is not None and code != "OK" and self.send_now is not None:
            self.send_now(lambda: response)

    def _give_back(self, result: pb.SessionResult) -> None:
        """Release the leases a result would have handed out."""
        if result.WhichOneof("outcome") == "get":
            self.io.daemon.release(pb.ReleaseRequest(lease_ids=_lease_ids(result.get)), self.owner)


def _fail(result: pb.SessionResult, err: EmbCacheError) -> str:
    """Make ``result`` the failure ``err`` (code from the one error table); returns the code."""
    code = status_for(err).grpc_code
    result.error.CopyFrom(
        pb.CallError(code=code, message=err.describe(), error_type=type(err).__name__)
    )
    return code


def _lease_ids(reply: pb.GetResponse) -> list[int]:
    return [r.lease_id for r in reply.results if r.found and r.lease_id]
