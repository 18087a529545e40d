"""The ``embcache.v1.EmbeddingCache`` servicer: protobuf in, engine API calls, protobuf out.

Handlers run on the daemon's event loop and call the engine directly: its calls are short
(table updates under one lock, or one <= 1 MiB memcpy per chunk), so a thread hop would
cost more than it saves. The device calls (``handlers/device.py``) wait on copies without
blocking the loop: polled on it, or in a worker thread when long (``device_get.py``).
Its ``Session`` stream carries a session of the session service (``session/service.py``),
which also serves the session socket's sessions.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
from google.protobuf import struct_pb2

from embcache import build_info
from embcache.errors import InvalidArgument, NotFound, UnknownSession
from embcache.proto.constants import CHUNK_BYTES
from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.proto.embcache.v1 import services as pb_grpc
from embcache.proto.framing import encode_chunk
from embcache.service.config import Settings
from embcache.service.device.ipc.cache import IpcCache
from embcache.service.engine import CacheEngine, EvictOutcome, EvictResults, raise_for_evict
from embcache.service.host import admission
from embcache.service.host.leases import Lease
from embcache.service.transport.accounting import RpcMetrics
from embcache.service.transport.grpc.busy_poll import BusyPoll
from embcache.service.transport.grpc.errors import rpc
from embcache.service.transport.grpc.sessions import VERSION_METADATA, serve_stream
from embcache.service.transport.handlers.device import (
    DevicePlane,
    check_reply_size,
    lease_ids_of,
    meta_of,
    pool_handle_of,
)
from embcache.service.transport.idle import idle_limited
from embcache.service.transport.render import LocationRenderer
from embcache.service.transport.session.admin import SessionAdmin
from embcache.service.transport.session.call_kinds import DaemonHandlers
from embcache.service.transport.session.registry import SessionRegistry
from embcache.service.transport.session.service import SessionService

log = logging.getLogger("embcache.grpc")

_EVICT_OUTCOMES = {
    EvictOutcome.EVICTED: pb.EVICTED,
    EvictOutcome.NOT_FOUND: pb.NOT_FOUND,
    EvictOutcome.LEASED: pb.LEASED,
}


class EmbeddingCacheServicer(pb_grpc.EmbeddingCacheServicer):
    """Every RPC of the service (docs/grpc.md, "RPCs"; the sessions' in ``sessions.py``);
    owns the session registry, the device plane and the busy poller."""

    def __init__(
        self,
        engine: CacheEngine,
        settings: Settings,
        metrics: RpcMetrics | None = None,
        *,
        ipc: IpcCache | None = None,
    ) -> None:
        self.engine = engine
        self.settings = settings
        self.metrics = metrics
        self.sessions = SessionRegistry(token=bool(settings.auth_token))
        self.admin = SessionAdmin(self.sessions, engine)  # operators: list and drop sessions
        self.host_pool = pool_handle_of(LocationRenderer(engine, settings).host_pool())
        self.device = DevicePlane(engine, settings, ipc)
        self.busy = BusyPoll(settings.busy_poll_us / 1e6)  # started with the server
        self.session_socket_tcp_port = (
            0  # the session socket's TCP port, once it listens (serving.py)
        )
        handlers = DaemonHandlers(
            get=self._get,
            release=self._release,
            render=self._checked_reply,
            put=self.device.put_from_device,
            put_batch=self.device.put_from_device_batch,
            get_into=self.device.get_into,
            offered_pools=self.device.offered_pools,
            drop_ipc=self.device.ipc.drop_owner,
            on_call=self.busy.poke,
        )
        # Opens the sessions of Session streams and of the session socket (serving.py)
        self.session_service = SessionService(
            engine, settings, metrics, self.sessions, self.host_pool, handlers
        )
        self.posted = self.session_service.posted  # reads wait for commits posted before them

    @rpc("Lanes")
    async def Lanes(
        self, request: pb.LanesRequest, context: grpc.aio.ServicerContext
    ) -> pb.LanesResponse:
        return pb.LanesResponse(tcp_port=self.session_socket_tcp_port)

    @rpc("Session")
    async def Session(
        self,
        request_iterator: AsyncIterator[pb.SessionRequest],
        context: grpc.aio.ServicerContext,
    ) -> None:
        await serve_stream(self.session_service, request_iterator, context)

    def close(self) -> None:
        """Close the client allocations opened through IPC (after the server stopped)."""
        self.device.ipc.close()

    # -- puts ----------------------------------------------------------------------------
    @rpc("Put")
    async def Put(
        self, request_iterator: AsyncIterator[pb.PutRequest], context: grpc.aio.ServicerContext
    ) -> pb.PutResponse:
        owner = self._quota_owner(context)
        # A stream that sends nothing for put_idle_timeout_s fails with IdleTimeout.
        messages = aiter(idle_limited(request_iterator, self.settings.put_idle_timeout_s))
        first = await anext(messages, None)
        if not isinstance(first, pb.PutRequest) or first.WhichOneof("kind") != "header":
            raise InvalidArgument("the first message of a Put must be a header")
        head = first.header
        handle = self.engine.begin_put(
            head.key,
            head.dtype,
            tuple(head.shape),
            nbytes=head.nbytes if head.HasField("nbytes") else None,
            checksum=head.checksum if head.HasField("checksum") else None,
            owner=owner,
        )
        # Any way out but commit (a bad chunk, the client cancelling, vanishing or going
        # idle, the deadline passing: all raise here) aborts: nothing is visible, the pages
        # are free.
        with handle:
            async for msg in messages:
                chunk = _chunk_of(msg)
                if len(chunk) > CHUNK_BYTES:
                    raise InvalidArgument(
                        "chunk too large", chunk_bytes=len(chunk), limit=CHUNK_BYTES
                    )
                handle.write(chunk)
            created = handle.commit()
        return pb.PutResponse(created=created, nbytes=handle.nbytes)

    @rpc("PutFromDevice")
    async def PutFromDevice(
        self, request: pb.PutFromDeviceRequest, context: grpc.aio.ServicerContext
    ) -> pb.PutResponse:
        owner = self.sessions.owner_for(context)
        return await self.device.put_from_device(request, owner, self._quota_owner(context))

    @rpc("PutFromDeviceBatch")
    async def PutFromDeviceBatch(
        self, request: pb.PutFromDeviceBatchRequest, context: grpc.aio.ServicerContext
    ) -> pb.PutFromDeviceBatchResponse:
        owner = self.sessions.owner_for(context)
        return await self.device.put_from_device_batch(request, owner, self._quota_owner(context))

    def _quota_owner(self, context: grpc.aio.ServicerContext) -> str:
        return self.sessions.quota_owner_for(context)

    # -- gets ----------------------------------------------------------------------------
    @rpc("Get")
    async def Get(
        self, request: pb.GetRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetResponse:
        if request.gpu_uuid:
            self.engine.device.index_for(request.gpu_uuid)  # no such pool: fail first
        owner = self.sessions.owner_for(context)
        await self.posted.settle(request.keys)  # commits posted before this read first
        reply = await self._get(request, owner)
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            # The deadline passed while the reply was built: nobody will read it, so its
            # leases end now rather than at their TTL.
            self.engine.release(lease_ids_of(reply), owner)
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed")
        return reply

    async def _get(self, request: pb.GetRequest, owner: str) -> pb.GetResponse:
        """A Get for ``owner``: the RPC's and a session call's."""
        if request.gpu_uuid:
            return await self.device.get(request, owner, self.sessions.alive)
        ttl = request.ttl_s if request.HasField("ttl_s") else None
        leases = self.engine.get(list(request.keys), owner, ttl_s=ttl)
        try:
            if not self.sessions.alive(owner):
                # The session ended while we were taking leases: they would outlive it.
                raise UnknownSession("session ended during the call", session=owner)
            return self._checked_reply(request.keys, leases)  # ReplyTooLarge: refused whole
        except BaseException:  # nobody receives these leases
            self.engine.release((x.lease_id for x in leases if x is not None), owner)
            raise

    def _checked_reply(self, keys: Sequence[str], leases: Sequence[Lease | None]) -> pb.GetResponse:
        """:meth:`_host_reply`, refused (ReplyTooLarge) if it would not fit one message."""
        reply = self._host_reply(keys, leases)
        check_reply_size(reply)
        return reply

    def _host_reply(self, keys: Sequence[str], leases: Sequence[Lease | None]) -> pb.GetResponse:
        pool_id = self.host_pool.pool_id
        reply = pb.GetResponse()
        for key, lease in zip(keys, leases, strict=True):
            if lease is None:
                reply.results.append(pb.GetResult(key=key, found=False))
                continue
            runs = [pb.ByteRun(offset=off, length=n) for off, n in lease.byte_runs]
            reply.results.append(
                pb.GetResult(
                    key=key,
                    found=True,
                    meta=meta_of(lease),
                    lease_id=lease.lease_id,
                    host=pb.HostLocation(pool_id=pool_id, runs=runs),
                )
            )
        if any(lease is not None for lease in leases):
            reply.pools.append(self.host_pool)
        return reply

    @rpc("GetInto")
    async def GetInto(
        self, request: pb.GetIntoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetIntoResponse:
        owner = self.sessions.owner_for(context)
        await self.posted.settle(request.keys)
        return await self.device.get_into(request, owner)

    @rpc("GetBytes")
    async def GetBytes(
        self, request: pb.GetBytesRequest, context: grpc.aio.ServicerContext
    ) -> None:
        chunk_bytes = request.chunk_bytes if request.HasField("chunk_bytes") else CHUNK_BYTES
        if not 0 < chunk_bytes <= CHUNK_BYTES:
            raise InvalidArgument(
                "chunk_bytes must be in (0, 1 MiB]", chunk_bytes=chunk_bytes, limit=CHUNK_BYTES
            )
        owner = self.sessions.owner_for(context)
        await self.posted.settle([request.key])
        lease = self.engine.get([request.key], owner)[0]
        if lease is None:
            raise NotFound("no such entry", key=request.key)
        try:
            length = request.length if request.HasField("length") else None
            # Each chunk is written as its serialized message, copied once out of the pool
            # (decoding.py sends such bytes as they are): no protobuf message per chunk.
            chunks = self.engine.iter_bytes(
                lease, request.offset, length, chunk_bytes, copy=encode_chunk
            )
            first = next(chunks, None)  # validates the range before anything is sent
            await context.write(pb.GetBytesResponse(meta=meta_of(lease)))
            if first is not None:
                await context.write(first)
            for chunk in chunks:
                await context.write(chunk)
        finally:
            self.engine.release([lease.lease_id])

    # -- leases --------------------------------------------------------------------------
    @rpc("Release")
    async def Release(
        self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReleaseResponse:
        return self._release(request, self.sessions.owner_for(context))

    def _release(self, request: pb.ReleaseRequest, owner: str) -> pb.ReleaseResponse:
        """End ``owner``'s leases among the ids (others' are skipped, as unknown ones)."""
        return pb.ReleaseResponse(released=self.engine.release(request.lease_ids, owner))

    @rpc("Renew")
    async def Renew(
        self, request: pb.RenewRequest, context: grpc.aio.ServicerContext
    ) -> pb.RenewResponse:
        ttl = request.ttl_s if request.HasField("ttl_s") else None
        owner = self.sessions.owner_for(context)  # only the caller's own leases
        return pb.RenewResponse(renewed=self.engine.renew(request.lease_ids, ttl, owner))

    # -- exists / evict / stats ----------------------------------------------------------
    @rpc("Exists")
    async def Exists(
        self, request: pb.ExistsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ExistsResponse:
        keys = [admission.check_key(k, self.settings) for k in request.keys]
        await self.posted.settle(keys)
        return pb.ExistsResponse(exists=self.engine.exists(keys))

    @rpc("Evict")
    async def Evict(
        self, request: pb.EvictRequest, context: grpc.aio.ServicerContext
    ) -> pb.EvictResponse:
        keys = list(request.keys)
        await self.posted.settle(keys)
        if request.gpu_uuid:  # that GPU's copies only (DeviceUnavailable if it has no pool)
            index = self.engine.device.index_for(request.gpu_uuid)
            outcomes = self.engine.device.evict(keys, index)
            if len(keys) == 1:  # a single key fails loudly, as below
                raise_for_evict(keys[0], outcomes[0], device=index)
        elif len(keys) == 1:  # a single key fails loudly: NOT_FOUND / FAILED_PRECONDITION
            freed = self.engine.evict_one(keys[0])
            outcomes = EvictResults([EvictOutcome.EVICTED], freed)
        else:
            outcomes = self.engine.evict(keys)
        return pb.EvictResponse(
            results=[
                pb.EvictResult(key=k, outcome=_EVICT_OUTCOMES[o])
                for k, o in zip(keys, outcomes, strict=True)
            ],
            freed_bytes=outcomes.freed_bytes,
        )

    @rpc("Stats")
    async def Stats(
        self, request: pb.StatsRequest, context: grpc.aio.ServicerContext
    ) -> pb.StatsResponse:
        await self.posted.settle(None)
        document = {**_jsonable(self.engine.stats().to_dict()), **build_info.as_dict()}
        stats = struct_pb2.Struct()
        stats.update(document)
        await context.send_initial_metadata(VERSION_METADATA)
        return pb.StatsResponse(
            stats=stats, sessions=len(self.sessions), stats_json=json.dumps(document)
        )

    @rpc("Prefetch")
    async def Prefetch(
        self, request: pb.PrefetchRequest, context: grpc.aio.ServicerContext
    ) -> pb.PrefetchResponse:
        device = None
        if request.gpu_uuid:
            device = self.engine.device.index_for(request.gpu_uuid)
        keys = list(request.keys)
        await self.posted.settle(keys)
        result = await asyncio.to_thread(self.engine.prefetch, keys, device=device)
        return pb.PrefetchResponse(**result)


def _chunk_of(msg: Any) -> memoryview | bytes:
    if isinstance(msg, memoryview):  # the fast path of decoding.decode_put_request
        return msg
    if isinstance(msg, pb.PutRequest) and msg.WhichOneof("kind") == "chunk":
        return msg.chunk
    got = msg.WhichOneof("kind") if isinstance(msg, pb.PutRequest) else "undecodable"
    raise InvalidArgument("after the header a Put carries only chunks", got=got)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value
