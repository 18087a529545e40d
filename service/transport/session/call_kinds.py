"""What a session call can be, and what each kind does: one table (``AT_ONCE_CALLS``,
``TASK_CALLS``) from the request's field to the function that fills its result.

The functions run a call of one session (:class:`CallSite`: its owner, quota owner, the
daemon's handlers in its :class:`SessionIO`, its host puts) and fill the result in place.
A kind whose handler the session lacks (a device put in CPU mode, a touch without a read
table) is refused as ``InvalidArgument``, naming it. ``calls.py`` runs them: the first
table's at once, inside the read of their frame where the transport can write; the second's
as tasks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from embcache.errors import InvalidArgument, QuotaExceeded
from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.service.transport.session.bytes_out import BytesReply
from embcache.service.transport.session.host_puts import THREAD_CRC_BYTES, SessionPuts, crc_bytes
from embcache.service.transport.session.inline_gets import Render

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
Send = Callable[[pb.SessionResponse], Awaitable[None]]
# Hits served from the read table, counted for the session's client: how many keys were
# cached, or None for a touch dropped over the client's budget (``touches.py``).
Touch = Callable[[list[str]], int | None]
Settle = Callable[[Sequence[str] | None], Awaitable[None]]

NAMES = {  # a call's name in the metrics, as its RPC's
    "get": "Get",
    "release": "Release",
    "put_from_device": "PutFromDevice",
    "put_from_device_batch": "PutFromDeviceBatch",
    "put": "Put",
    "put_batch": "PutBatch",
    "put_abort": "PutAbort",
    "get_bytes": "GetBytes",
    "get_into": "GetInto",
    "touch": "Touch",
    "stash_refill": "StashRefill",
    "stash_commit": "StashCommit",
}
MAX_TOUCH_KEYS = 4096  # keys one touch may count (a client posts one per get)


@dataclass(frozen=True, slots=True)
class DaemonHandlers:
    """The daemon's handlers every session's calls run through (the gRPC servicer's gets and
    releases, the device plane's puts and get_into; None: not served), and what else a
    session needs of the daemon: ``render`` (a host get's reply, ReplyTooLarge past a
    message), ``offered_pools`` (the device pools the read table names, by index),
    ``drop_ipc`` (forget the client allocations a session opened) and ``on_call`` (told of
    each call as it arrives: busy polling)."""

    get: GetHandler
    release: ReleaseHandler
    render: Render
    put: PutHandler | None = None
    put_batch: PutBatchHandler | None = None
    get_into: GetIntoHandler | None = None
    offered_pools: Callable[[], Sequence[pb.PoolHandle]] = tuple
    drop_ipc: Callable[[str], object] | None = None
    on_call: Callable[[], None] | None = None


@dataclass(frozen=True, slots=True)
class SessionIO:
    """How one session's calls reach the daemon (``daemon``, and the session's own
    ``read_bytes``, ``inline_get`` and ``touch``: None where not served) and go back to
    their caller: ``send`` writes a result; ``send_bytes``, where the transport can, a
    result with raw bytes after it (``bytes_out.py``); ``settle(keys)`` returns once the
    commits posted before a read of ``keys`` are applied (``posted.py``)."""

    daemon: DaemonHandlers
    send: Send
    send_bytes: SendBytes | None = None
    read_bytes: ReadBytes | None = None
    inline_get: InlineGet | None = None
    touch: Touch | None = None
    settle: Settle | None = None


class CallSite(Protocol):
    """The session a call runs in (``calls.SessionCalls``)."""

    owner: str
    quota_owner: str
    io: SessionIO
    host_puts: SessionPuts | None


_H = TypeVar("_H")


def served(handler: _H | None, kind: str) -> _H:
    """``handler``, or InvalidArgument: this session does not serve ``kind``."""
    if handler is None:
        raise InvalidArgument(f"{kind} is not served on this session", kind=kind)
    return handler


def read_keys(call: pb.SessionCall) -> list[str] | None:
    """The keys a read call looks up (None: not a read)."""
    kind = call.WhichOneof("request")
    if kind == "get":
        return list(call.get.keys)
    if kind == "get_into":
        return list(call.get_into.keys)
    if kind == "get_bytes":
        return [call.get_bytes.key]
    return None


def touch_keys(request: pb.TouchRequest) -> list[str]:
    """The keys of a touch, checked as a get's are (at most ``MAX_TOUCH_KEYS``)."""
    if len(request.keys) > MAX_TOUCH_KEYS:
        raise InvalidArgument(
            "too many keys in one touch", keys=len(request.keys), limit=MAX_TOUCH_KEYS
        )
    return list(request.keys)


# -- answered at once: their handlers never wait --------------------------------------------
def put(site: CallSite, call: pb.SessionCall, result: pb.SessionResult) -> None:
    result.put.CopyFrom(served(site.host_puts, "put").put(call.put))


def put_batch(site: CallSite, call: pb.SessionCall, result: pb.SessionResult) -> None:
    result.put_batch.CopyFrom(served(site.host_puts, "put_batch").put_batch(call.put_batch))


def release(site: CallSite, call: pb.SessionCall, result: pb.SessionResult) -> None:
    result.release.CopyFrom(site.io.daemon.release(call.release, site.owner))


def touch(site: CallSite, call: pb.SessionCall, result: pb.SessionResult) -> None:
    touched = served(site.io.touch, "touch")(touch_keys(call.touch))
    if touched is None:
        raise QuotaExceeded("touches over this client's budget (max_touch_keys_per_s)")
    result.touch.touched = touched


def stash_refill(site: CallSite, call: pb.SessionCall, result: pb.SessionResult) -> None:
    puts = served(site.host_puts, "stash_refill")
    result.stash_refill.CopyFrom(puts.stash_refill(call.stash_refill))


def stash_commit(site: CallSite, call: pb.SessionCall, result: pb.SessionResult) -> None:
    puts = served(site.host_puts, "stash_commit")
    result.stash_commit.CopyFrom(puts.stash_commit(call.stash_commit))


# -- run as tasks ---------------------------------------------------------------------------
async def get(site: CallSite, call: pb.SessionCall, result: pb.SessionResult) -> None:
    result.get.CopyFrom(await site.io.daemon.get(call.get, site.owner))


async def put_from_device(site: CallSite, call: pb.SessionCall, result: pb.SessionResult) -> None:
    handler = served(site.io.daemon.put, "put_from_device")
    reply = await handler(call.put_from_device, site.owner, site.quota_owner)
    result.put_from_device.CopyFrom(reply)


async def put_from_device_batch(
    site: CallSite, call: pb.SessionCall, result: pb.SessionResult
) -> None:
    handler = served(site.io.daemon.put_batch, "put_from_device_batch")
    reply = await handler(call.put_from_device_batch, site.owner, site.quota_owner)
    result.put_from_device_batch.CopyFrom(reply)


async def get_into(site: CallSite, call: pb.SessionCall, result: pb.SessionResult) -> None:
    handler = served(site.io.daemon.get_into, "get_into")
    result.get_into.CopyFrom(await handler(call.get_into, site.owner))


async def put_abort(site: CallSite, call: pb.SessionCall, result: pb.SessionResult) -> None:
    result.put_abort.CopyFrom(served(site.host_puts, "put_abort").abort(call.put_abort))


async def stash_commit_task(site: CallSite, call: pb.SessionCall, result: pb.SessionResult) -> None:
    """A commit with a CRC32 over many bytes to compute: off the loop."""
    puts = served(site.host_puts, "stash_commit")
    reply = await asyncio.to_thread(puts.stash_commit, call.stash_commit)
    result.stash_commit.CopyFrom(reply)


def at_once(kind: str, call: pb.SessionCall) -> bool:
    """Whether a call of ``kind`` is answered at once (its handler never waits, and any
    CRC32 it computes is small); else it runs as a task."""
    if kind == "stash_commit":
        return crc_bytes(call.stash_commit) <= THREAD_CRC_BYTES
    return kind in AT_ONCE_CALLS


Fill = Callable[[CallSite, pb.SessionCall, pb.SessionResult], None]
AsyncFill = Callable[[CallSite, pb.SessionCall, pb.SessionResult], Awaitable[None]]
AT_ONCE_CALLS: dict[str, Fill] = {
    "put": put,
    "put_batch": put_batch,
    "release": release,
    "touch": touch,
    "stash_refill": stash_refill,
    "stash_commit": stash_commit,
}
TASK_CALLS: dict[str, AsyncFill] = {
    "get": get,
    "put_from_device": put_from_device,
    "put_from_device_batch": put_from_device_batch,
    "get_into": get_into,
    "put_abort": put_abort,
    "stash_commit": stash_commit_task,  # where at_once() says no
}
