"""Calls carried on a Session stream (``SessionCall``): Get, Release and the device puts
(PutFromDevice, PutFromDeviceBatch) without a new RPC.

A message on an open stream costs about half a unary call in Python gRPC (no new HTTP/2
stream, headers, deadline or trailers; docs/grpc.md, ``Session`` in "RPCs"), and device
gets are latency-bound. The request, the reply and the error table are those of the unary
RPCs; the leases belong to the session that carries the call.

Calls run as tasks, so a slow one (a shared-tier fill) does not hold up the next; results
go back as they finish, tagged with the client's call id. When the stream ends, the session
is closed first, then its running calls are cancelled and its leases dropped, without
awaiting anything (a second cancellation of the stream's handler must not skip the drop). A
call that took leases and is still running gives them back itself: it finds the session
closed (the Get handlers check) or is cancelled at its next await (they release on the way
out), so no lease outlives the session.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from embcache.errors import EmbCacheError, InvalidArgument
from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.service.transport.accounting import RpcMetrics
from embcache.service.transport.status import status_for

log = logging.getLogger("embcache.grpc")

GetHandler = Callable[[pb.GetRequest, str], Awaitable[pb.GetResponse]]
ReleaseHandler = Callable[[pb.ReleaseRequest], pb.ReleaseResponse]
PutHandler = Callable[[pb.PutFromDeviceRequest, str], Awaitable[pb.PutResponse]]
PutBatchHandler = Callable[
    [pb.PutFromDeviceBatchRequest, str], Awaitable[pb.PutFromDeviceBatchResponse]
]
NAMES = {  # a call's name in the metrics, as its RPC's
    "get": "Get",
    "release": "Release",
    "put_from_device": "PutFromDevice",
    "put_from_device_batch": "PutFromDeviceBatch",
}
Send = Callable[[pb.SessionResponse], Awaitable[None]]


class SessionCalls:
    """The calls in flight on one Session stream."""

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
    ) -> None:
        self.owner = owner
        self._transport = transport  # the metrics' label: "grpc"; "lane": the session socket
        self._send = send
        self._get = get
        self._release = release
        self._put = put
        self._put_batch = put_batch
        self._metrics = metrics
        self._on_call = on_call  # told of each call as it arrives (busy polling)
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self, call: pb.SessionCall) -> None:
        """Run ``call`` as a task; its result is sent when it finishes."""
        if self._on_call is not None:
            self._on_call()
        task = asyncio.get_running_loop().create_task(self._run(call))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def cancel(self) -> None:
        """Cancel the calls still running (each gives back the leases it took)."""
        for task in list(self._tasks):
            task.cancel()

    async def _run(self, call: pb.SessionCall) -> None:
        start = time.perf_counter()
        kind = call.WhichOneof("request")
        response = pb.SessionResponse()
        result = response.result  # filled in place: the reply is copied once, into it
        result.call_id = call.call_id
        code = "OK"
        try:
            if kind == "get":
                result.get.CopyFrom(await self._get(call.get, self.owner))
            elif kind == "release":
                result.release.CopyFrom(self._release(call.release))
            elif kind == "put_from_device" and self._put is not None:
                reply = await self._put(call.put_from_device, self.owner)
                result.put_from_device.CopyFrom(reply)
            elif kind == "put_from_device_batch" and self._put_batch is not None:
                batch = await self._put_batch(call.put_from_device_batch, self.owner)
                result.put_from_device_batch.CopyFrom(batch)
            else:
                raise InvalidArgument(
                    "a session call carries a get, release or device put request", kind=kind
                )
        except EmbCacheError as err:
            code = status_for(err).grpc_code
            log.info("Session.%s -> %s: %s", kind, code, err.describe())
            result.error.CopyFrom(
                pb.CallError(code=code, message=err.describe(), error_type=type(err).__name__)
            )
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
        try:
            await self._send(response)
        except BaseException:
            # Nobody will read this result: give back the leases it hands out.
            if result.WhichOneof("outcome") == "get":
                self._release(pb.ReleaseRequest(lease_ids=_lease_ids(result.get)))
            raise


def _lease_ids(reply: pb.GetResponse) -> list[int]:
    return [r.lease_id for r in reply.results if r.found]
