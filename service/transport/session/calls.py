"""Calls carried on a Session stream (``SessionCall``): Get, Release, the device puts
(PutFromDevice, PutFromDeviceBatch), the host puts (``host_puts.py``) and, on a session
socket, get_bytes (``bytes_out.py``) without a new RPC.

A message on an open stream costs about half a unary call in Python gRPC (no new HTTP/2
stream, headers, deadline or trailers; docs/grpc.md, ``Session`` in "RPCs"), and device
gets are latency-bound. The request, the reply and the error table are those of the unary
RPCs; the leases belong to the session that carries the call.

Calls run as tasks, so a slow one (a shared-tier fill) does not hold up the next; results
go back as they finish, tagged with the client's call id. Calls whose handlers never wait
(inline puts, releases, touches: ``AT_ONCE``) are answered at once instead, inside the read
of their frame, where the transport can write the result now (the session socket whose
client reads): a task and a loop iteration cost about a third of an empty call. At most
``max_calls`` run at once: at the bound the transport stops reading the session's requests
(:meth:`SessionCalls.room`, ``on_room``) until one finishes, so a client that pipelines
calls without reading their results holds a bounded number of tasks and leases, and
tearing it down costs O(bound).
When the stream ends, the session is closed first, then its running calls are cancelled
and its leases dropped, without awaiting anything (a second cancellation of the stream's
handler must not skip the drop); everything a call waits on leaves in O(1) when cancelled
(``waiters.py``). A call that took leases and is still running gives them back itself: it
finds the session closed (the Get handlers check) or is cancelled at its next await (they
release on the way out), so no lease outlives the session. A result larger than a message
(the Get handlers refuse those first) is answered as ``ReplyTooLarge`` and its leases given
back, so it never ends the session. A release posted with call id 0 gets no result: its
caller does not wait for one (``SessionCall.call_id``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from embcache.errors import EmbCacheError, InvalidArgument, QuotaExceeded, ReplyTooLarge
from embcache.proto.constants import MAX_MESSAGE_BYTES
from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.service.transport.accounting import RpcMetrics
from embcache.service.transport.session.bytes_out import BytesReply
from embcache.service.transport.session.host_puts import SessionPuts
from embcache.service.transport.status import status_for

log = logging.getLogger("embcache.grpc")

GetHandler = Callable[[pb.GetRequest, str], Awaitable[pb.GetResponse]]
ReleaseHandler = Callable[[pb.ReleaseRequest, str], pb.ReleaseResponse]  # (request, owner)
# (request, owner of the IPC mappings, owner of the in-flight quota)
PutHandler = Callable[[pb.PutFromDeviceRequest, str, str], Awaitable[pb.PutResponse]]
# (request, owner): a GetInto in the session (the device handler's)
GetIntoHandler = Callable[[pb.GetIntoRequest, str], Awaitable[pb.GetIntoResponse]]
PutBatchHandler = Callable[
    [pb.PutFromDeviceBatchRequest, str, str], Awaitable[pb.PutFromDeviceBatchResponse]
]
# (request, owner) -> the answer and the views to send after it (``bytes_out.read_bytes``)
ReadBytes = Callable[[pb.GetBytesRequest, str], BytesReply]
# (request, owner) -> a host get's reply and the copies sent after it (``inline_gets.py``)
InlineGet = Callable[[pb.GetRequest, str], tuple[pb.GetResponse, BytesReply | None]]
# A session socket's writer of a result and the raw bytes after it: waits until the
# connection has room, then calls ``produce()`` and writes both, in one piece, and ends the
# reply's lease once the transport has let go of its views.
Produce = Callable[[], tuple[pb.SessionResponse, BytesReply | None]]
SendBytes = Callable[[Produce], Awaitable[None]]
NAMES = {  # a call's name in the metrics, as its RPC's
    "get": "Get",
    "release": "Release",
    "put_from_device": "PutFromDevice",
    "put_from_device_batch": "PutFromDeviceBatch",
    "put": "Put",
    "put_batch": "PutBatch",
    "put_reserve": "PutReserve",
    "put_commit": "PutCommit",
    "put_abort": "PutAbort",
    "get_bytes": "GetBytes",
    "get_into": "GetInto",
    "touch": "Touch",
}
Send = Callable[[pb.SessionResponse], Awaitable[None]]
MAX_TOUCH_KEYS = 4096  # keys one touch may count (a client posts one per get)
# Calls whose handlers never wait: answered at once where the transport can write at once.
AT_ONCE = frozenset({"put", "put_batch", "release", "touch"})


class SessionCalls:
    """The calls in flight on one Session stream. ``owner``: the session, whose leases and
    IPC mappings they are; ``quota_owner``: whose in-flight quota its device puts count
    against (the session's client; default ``owner``); ``max_calls``: the bound (0: none)."""

    def __init__(
        self,
        owner: str,
        send: Send,
        get: GetHandler,
        release: ReleaseHandler,
        metrics: RpcMetrics | None,
        *,
        put: PutHandler | None = None,
        put_batch: PutBatchHandler | None = None,
        on_call: Callable[[], None] | None = None,
        transport: str = "grpc",
        max_calls: int = 0,
        quota_owner: str | None = None,
        host_puts: SessionPuts | None = None,
        read_bytes: ReadBytes | None = None,
        send_bytes: SendBytes | None = None,
        get_into: GetIntoHandler | None = None,
        inline_get: InlineGet | None = None,
        touch: Callable[[list[str]], int | None] | None = None,
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
        self._send = send
        self._get = get
        self._release = release
        self._put = put
        self._put_batch = put_batch
        self._metrics = metrics
        self._on_call = on_call  # told of each call as it arrives (busy polling)
        self._tasks: set[asyncio.Task[None]] = set()
        self.host_puts = host_puts  # the session's host puts and reservations, if served
        self._read_bytes = read_bytes
        self._send_bytes = send_bytes  # None: the transport cannot send raw bytes (gRPC)
        self._get_into = get_into
        self._inline_get = inline_get
        # Hits served from the read table (None: no table); it says None for a touch it
        # dropped over its client's budget (``touches.py``).
        self._touch = touch

    @property
    def serves_bytes(self) -> bool:
        """Whether get_bytes is served here (a session socket's calls)."""
        return self._read_bytes is not None and self._send_bytes is not None

    @property
    def serves_inline_gets(self) -> bool:
        """Whether host gets may send small entries as copies after the result here."""
        return self._inline_get is not None and self._send_bytes is not None

    def start(self, call: pb.SessionCall) -> None:
        """Run ``call`` as a task; its result is sent when it finishes. A posted release
        (call id 0: no result) runs at once instead, without a task: it only updates the
        lease table, and it rides in front of the client's next call; so does a posted
        touch (it only counts hits)."""
        if self._on_call is not None:
            self._on_call()
        kind = call.WhichOneof("request")
        if call.call_id == 0 and kind == "release":
            self._posted_release(call.release)
            return
        if call.call_id == 0 and kind == "touch":
            self._posted_touch(call.touch)
            return
        if kind in AT_ONCE and self.send_now is not None and self._answer_now(call, kind):
            return
        task = asyncio.get_running_loop().create_task(self._run(call))
        self._tasks.add(task)
        task.add_done_callback(self._finished)

    def _answer_now(self, call: pb.SessionCall, kind: str) -> bool:
        """Run a call whose handler never waits (``AT_ONCE``) and write its result, with no
        task and no loop iteration in between; False, nothing run, when the connection
        cannot take the result now (the call then runs as a task, which waits for room)."""
        assert self.send_now is not None
        if not self._serves_at_once(kind):
            return False  # not served here: the task path answers so

        def produce() -> pb.SessionResponse:
            start = time.perf_counter()
            response = pb.SessionResponse()
            result = response.result
            result.call_id = call.call_id
            code = self._outcome(kind, lambda: self._fill_at_once(kind, call, result), result)
            if self._metrics is not None:
                name, elapsed = f"Session.{NAMES[kind]}", time.perf_counter() - start
                self._metrics.observe_rpc(self._transport, name, code, elapsed)
            return response

        return self.send_now(produce)

    def _serves_at_once(self, kind: str) -> bool:
        if kind in ("put", "put_batch"):
            return self.host_puts is not None
        return kind == "release" or (kind == "touch" and self._touch is not None)

    def _fill_at_once(self, kind: str, call: pb.SessionCall, result: pb.SessionResult) -> None:
        """Fill ``result`` for a call of ``AT_ONCE`` that ``_serves_at_once``."""
        puts = self.host_puts
        if kind == "put":
            assert puts is not None
            result.put.CopyFrom(puts.put(call.put))
        elif kind == "put_batch":
            assert puts is not None
            result.put_batch.CopyFrom(puts.put_batch(call.put_batch))
        elif kind == "release":
            result.release.CopyFrom(self._release(call.release, self.owner))
        else:
            assert self._touch is not None
            touched = self._touch(_touch_keys(call.touch))
            if touched is None:
                raise QuotaExceeded("touches over this client's budget (max_touch_keys_per_s)")
            result.touch.touched = touched

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
            if kind == "get":
                result.get.CopyFrom(await self._get(call.get, self.owner))
            elif kind in AT_ONCE and self._serves_at_once(kind):
                self._fill_at_once(kind, call, result)
            elif kind == "put_from_device" and self._put is not None:
                reply = await self._put(call.put_from_device, self.owner, self.quota_owner)
                result.put_from_device.CopyFrom(reply)
            elif kind == "get_into" and self._get_into is not None:
                result.get_into.CopyFrom(await self._get_into(call.get_into, self.owner))
            elif kind == "put_from_device_batch" and self._put_batch is not None:
                request = call.put_from_device_batch
                batch = await self._put_batch(request, self.owner, self.quota_owner)
                result.put_from_device_batch.CopyFrom(batch)
            elif kind is not None and kind.startswith("put") and self.host_puts is not None:
                await self._host_put(kind, call, result)
            else:
                raise InvalidArgument(
                    "a session call carries a get, release or device put request", kind=kind
                )
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
            await self._send(response)
        except BaseException:
            self._give_back(result)  # nobody will read this result
            raise

    async def _get_bytes(self, call: pb.SessionCall, start: float) -> None:
        """A get_bytes: its result, then the bytes raw (``bytes_out.py``); refused where they
        cannot follow (gRPC)."""
        request = call.get_bytes

        def read(result: pb.SessionResult) -> BytesReply:
            if self._read_bytes is None:
                raise InvalidArgument(
                    "get_bytes is a session socket's call (SessionOpened.bytes_out)"
                )
            reply = self._read_bytes(request, self.owner)
            result.get_bytes.CopyFrom(reply.out)
            return reply

        await self._with_bytes(call, start, "get_bytes", read)

    async def _inline(self, call: pb.SessionCall, start: float) -> None:
        """A host get whose small entries follow the result as copies (``inline_gets.py``)."""

        def read(result: pb.SessionResult) -> BytesReply | None:
            assert self._inline_get is not None
            reply, copies = self._inline_get(call.get, self.owner)
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
                if self._send_bytes is None:
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
            if self._send_bytes is None:
                response, _ = produce()  # the refusal
                await self._send(response)
            else:
                await self._send_bytes(produce)
        except asyncio.CancelledError:
            code = "CANCELLED"
            raise
        finally:
            if self._metrics is not None:
                elapsed = time.perf_counter() - start
                name = f"Session.{NAMES.get(kind, 'Unknown')}"
                self._metrics.observe_rpc(self._transport, name, code, elapsed)

    async def _host_put(self, kind: str, call: pb.SessionCall, result: pb.SessionResult) -> None:
        """A reservation's step (``host_puts.py``; inline puts are ``_fill_at_once``'s)."""
        puts = self.host_puts
        assert puts is not None
        if kind == "put_reserve":
            result.put_reserve.CopyFrom(puts.reserve(call.put_reserve))
        elif kind == "put_commit":
            result.put_commit.CopyFrom(await puts.commit(call.put_commit))
        elif kind == "put_abort":
            result.put_abort.CopyFrom(puts.abort(call.put_abort))
        else:
            raise InvalidArgument("unknown put call", kind=kind)

    def _posted_release(self, request: pb.ReleaseRequest) -> None:
        self._posted("release", lambda: self._release(request, self.owner))

    def _posted_touch(self, request: pb.TouchRequest) -> None:
        def touch() -> None:
            if self._touch is None:
                raise InvalidArgument("touch needs the daemon's read table (none here)")
            self._touch(_touch_keys(request))  # over the budget: dropped and counted there

        self._posted("touch", touch)

    def _posted(self, kind: str, run: Callable[[], object]) -> None:
        """Run a posted call (no result): its failure is logged only, nobody waits for it."""
        start = time.perf_counter()
        code = self._outcome(f"{kind} (posted)", run, None)
        if self._metrics is not None:
            elapsed = time.perf_counter() - start
            self._metrics.observe_rpc(self._transport, f"Session.{NAMES[kind]}", code, elapsed)

    def _give_back(self, result: pb.SessionResult) -> None:
        """Release the leases a result would have handed out."""
        if result.WhichOneof("outcome") == "get":
            self._release(pb.ReleaseRequest(lease_ids=_lease_ids(result.get)), self.owner)


def _fail(result: pb.SessionResult, err: EmbCacheError) -> str:
    """Make ``result`` the failure ``err`` (code from the one error table); returns the code."""
    code = status_for(err).grpc_code
    result.error.CopyFrom(
        pb.CallError(code=code, message=err.describe(), error_type=type(err).__name__)
    )
    return code


def _touch_keys(request: pb.TouchRequest) -> list[str]:
    """The keys of a touch, checked as a get's are (at most ``MAX_TOUCH_KEYS``)."""
    if len(request.keys) > MAX_TOUCH_KEYS:
        raise InvalidArgument(
            "too many keys in one touch", keys=len(request.keys), limit=MAX_TOUCH_KEYS
        )
    return list(request.keys)


def _lease_ids(reply: pb.GetResponse) -> list[int]:
    return [r.lease_id for r in reply.results if r.found and r.lease_id]
