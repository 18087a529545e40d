"""``AsyncEmbCacheClient``: the asyncio twin of :class:`EmbCacheClient` (same semantics).

async with AsyncEmbCacheClient("unix:/run/embcache.sock") as client:
    await client.put("img-1", embedding)
    async with client.get(["img-1"]) as (a,):
        ...
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Mapping, Sequence
from typing import Any, TypeVar, overload

import grpc
import torch

from embcache.clients._backends.async_lane import AsyncLaneSession
from embcache.clients._backends.async_session import AsyncSession
from embcache.clients.core.capabilities import Capabilities, HostFallbacks
from embcache.clients.core.channel import auth_metadata, connect
from embcache.clients.core.errors import RpcFailed, from_call_error, translate
from embcache.clients.core.payload import payload_of
from embcache.clients.core.requests import as_keys
from embcache.clients.core.retry import backoff_s, is_unknown_session, retry_step, should_retry
from embcache.clients.core.session_calls import SessionLost, serves
from embcache.clients.core.targets import lane_path, normalize_target
from embcache.clients.device import device_replies, exports, into, pools
from embcache.clients.device import puts as dp
from embcache.clients.device.host_replies import decode_get
from embcache.clients.device.shm import process_pool_maps
from embcache.clients.plain_calls import AsyncPlainCalls
from embcache.clients.results import AsyncLeasedTensors
from embcache.errors import DeviceUnavailable
from embcache.proto.constants import SESSION_KEY
from embcache.proto.embcache.v1 import embcache_pb2 as pb

T = TypeVar("T")
log = logging.getLogger("embcache.client")


class _GetCall:
    """``await client.get(keys)`` or ``async with client.get(keys) as tensors:``."""

    def __init__(self, run: Callable[[], Awaitable[AsyncLeasedTensors]]) -> None:
        self._run = run
        self._leased: AsyncLeasedTensors | None = None

    def __await__(self) -> Generator[Any, None, AsyncLeasedTensors]:
        return self._run().__await__()

    async def __aenter__(self) -> list[torch.Tensor | None]:
        self._leased = await self._run()
        return self._leased.tensors

    async def __aexit__(self, *exc: object) -> None:
        if self._leased is not None:
            await self._leased.release()


class AsyncEmbCacheClient(AsyncPlainCalls):
    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        timeout: float = 30.0,
        retries: int = 4,
        root_certificates: bytes | None = None,
        tls: bool = False,
        client_name: str = "",
        options: Sequence[tuple[str, Any]] = (),
        session_lane: bool = True,
    ) -> None:
        target = normalize_target(target)
        self._channel, self._stub, self._put = connect(
            target, tls=tls, root_certificates=root_certificates, options=options, aio=True
        )
        self.target = target
        self.timeout = timeout
        self.retries = retries
        self._auth = auth_metadata(token)
        self._token = token
        self._client_name = client_name
        # Session calls go over the daemon's lane when it has one (lane.py), else gRPC.
        self._lane = lane_path(target) if session_lane else None
        self._session: AsyncSession | AsyncLaneSession | None = None
        self._session_lock = asyncio.Lock()
        self._maps = process_pool_maps()
        self._pool_local: bool | None = None
        self._device_pools = pools.process_device_pools()
        self._no_device = HostFallbacks()
        self._caps = Capabilities()  # what the daemon turned out not to support

    # -- plumbing ------------------------------------------------------------------------
    async def _session_id(self) -> str:
        session_id = (await self._open_session()).session_id
        assert session_id is not None
        return session_id

    async def _open_session(self) -> AsyncSession | AsyncLaneSession:
        async with self._session_lock:
            if self._session is None or not self._session.alive:
                if self._session is not None:
                    await self._session.close()  # ended: let go of its socket
                    self._session = None
                # As in EmbCacheClient: a retry looks for the lane again.
                self._session = await self._call(self._lane_or_stream)
            return self._session

    async def _lane_or_stream(
        self, metadata: Any, timeout: float
    ) -> AsyncSession | AsyncLaneSession:
        lane = await self._open_lane()
        return lane or await AsyncSession.open(self._stub, metadata, self._client_name, timeout)

    async def _open_lane(self) -> AsyncLaneSession | None:
        """A session on the daemon's lane; None if it has none (this session uses gRPC; the
        next one looks for the lane again, e.g. after the daemon restarted with one)."""
        if self._lane is None:
            return None
        try:
            return await AsyncLaneSession.open(
                self._lane, self._token, self._client_name, self.timeout
            )
        except OSError as err:
            log.debug("no session lane at %s (%s): this session uses gRPC", self._lane, err)
            return None

    async def _get_call(self, request: pb.GetRequest) -> pb.GetResponse:
        """A Get in this client's session (see ``EmbCacheClient._session_call``)."""
        return await self._session_call(
            "get", request, lambda md, to: self._stub.Get(request, timeout=to, metadata=md)
        )

    async def _session_call(
        self, kind: str, request: Any, rpc: Callable[[Any, float], Awaitable[T]]
    ) -> T:
        """``request`` as a ``kind`` call on the session stream when the daemon serves those
        there, else the RPC (``EmbCacheClient._session_call``)."""
        attempt = 0
        while True:
            session = await self._open_session()
            if not serves(session, kind):
                return await self._call(rpc, session=True)
            try:
                result = await session.call(self.timeout, **{kind: request})
            except SessionLost:
                if attempt >= self.retries:
                    raise
                attempt += 1
                continue
            if result.WhichOneof("outcome") == kind:
                reply: T = getattr(result, kind)
                return reply
            if retry_step(result, attempt, self.retries) == "new_session":
                await self._drop_session()  # the daemon forgot it: start a new one
            else:
                await asyncio.sleep(backoff_s(attempt))
            attempt += 1

    async def _drop_session(self) -> None:
        async with self._session_lock:
            if self._session is not None:
                await self._session.close()
                self._session = None

    async def _call(self, fn: Callable[[Any, float], Awaitable[T]], *, session: bool = False) -> T:
        reopened = False
        attempt = 0
        while True:
            metadata = self._auth
            if session:
                metadata = (*metadata, (SESSION_KEY, await self._session_id()))
            try:
                return await fn(metadata, self.timeout)
            except grpc.RpcError as err:
                if session and not reopened and is_unknown_session(err):
                    reopened = True
                    await self._drop_session()
                    continue
                if should_retry(err) and attempt < self.retries:
                    await asyncio.sleep(backoff_s(attempt))
                    attempt += 1
                    continue
                raise translate(err) from err

    # -- puts ----------------------------------------------------------------------------
    async def put(self, key: str, tensor: Any, *, checksum: bool = True) -> bool:
        if self._caps.device_puts and dp.wants_device_put(tensor):
            created = await self._put_from_device(key, tensor)
            if created is not None:
                return created
        payload = payload_of(tensor)

        async def send(md: Any, to: float) -> pb.PutResponse:
            return await self._put(
                _aiter(payload.messages(key, checksum=checksum)), timeout=to, metadata=md
            )

        return bool((await self._call(send)).created)

    async def put_many(
        self, items: Mapping[str, Any] | Sequence[tuple[str, Any]], *, checksum: bool = True
    ) -> list[bool]:
        """:meth:`EmbCacheClient.put_many`: CUDA tensors in ``PutFromDeviceBatch`` calls, the
        rest streamed one by one."""
        pairs = dp.as_pairs(items)
        out: list[bool | None] = [None] * len(pairs)
        cuda = [(i, k, t) for i, (k, t) in enumerate(pairs) if dp.wants_device_put(t)]
        if cuda and self._caps.device_puts and self._caps.batch_puts:
            for batch in dp.batches(cuda) or []:
                reply = await self._put_batch(batch)
                if reply is None:
                    break
                batch.returned(reply, out)
        return [
            bool(c) if c is not None else await self.put(k, t, checksum=checksum)
            for (k, t), c in zip(pairs, out, strict=True)
        ]

    async def _put_batch(self, batch: dp.Batch) -> pb.PutFromDeviceBatchResponse | None:
        try:
            return await self._session_call(
                "put_from_device_batch",
                batch.request,
                lambda md, to: self._stub.PutFromDeviceBatch(
                    batch.request, timeout=to, metadata=md
                ),
            )
        except (DeviceUnavailable, RpcFailed) as exc:
            if not self._caps.put_failed(exc):
                raise
        return None

    async def _put_from_device(self, key: str, tensor: torch.Tensor) -> bool | None:
        exported = exports.export_cuda(tensor.detach().contiguous())
        if exported is None:
            return None
        request = pb.PutFromDeviceRequest(key=key, tensor=exported.message)
        try:
            reply = await self._session_call(
                "put_from_device",
                request,
                lambda md, to: self._stub.PutFromDevice(request, timeout=to, metadata=md),
            )
        except DeviceUnavailable as exc:
            self._caps.put_failed(exc)  # streams bytes from now on
            return None
        exported.returned()  # the daemon has copied: its event may be reused
        return bool(reply.created)

    # -- gets ----------------------------------------------------------------------------
    def get(
        self,
        keys: str | Sequence[str],
        device: str | torch.device | None = None,
        *,
        ttl_s: float | None = None,
    ) -> _GetCall:
        return _GetCall(lambda: self._get(keys, device, ttl_s))

    async def _get(
        self, keys: str | Sequence[str], device: str | torch.device | None, ttl_s: float | None
    ) -> AsyncLeasedTensors:
        names, _ = as_keys(keys)
        if device is not None and torch.device(device).type == "cuda":
            on_device = await self._get_device(names, device, ttl_s)
            if on_device is not None:
                return on_device
        if self._pool_local is False:
            tensors = [await self._fetch_tensor(k) for k in names]
            return await self._placed(AsyncLeasedTensors(tensors, [], self.release), device)
        request = pb.GetRequest(keys=names, ttl_s=ttl_s) if ttl_s else pb.GetRequest(keys=names)
        reply = await self._get_call(request)
        try:
            decoded = decode_get(reply, self._maps)
        except BaseException:
            await self.release([r.lease_id for r in reply.results if r.found])
            raise
        if decoded.lease_ids:
            self._pool_local = not decoded.remote
        if decoded.remote:
            await self.release(decoded.lease_ids)
            for i in decoded.remote:
                decoded.tensors[i] = await self._fetch_tensor(names[i])
            decoded.lease_ids = []
        leased = AsyncLeasedTensors(decoded.tensors, decoded.lease_ids, self.release)
        return await self._placed(leased, device)

    async def _get_device(
        self, names: list[str], device: str | torch.device, ttl_s: float | None
    ) -> AsyncLeasedTensors | None:
        dev, uuid = pools.resolve_device(device)
        if uuid in self._no_device:
            return None
        request = pb.GetRequest(keys=names, gpu_uuid=uuid, ready_event=self._caps.ready_events)
        if ttl_s:
            request.ttl_s = ttl_s
        try:
            reply = await self._get_call(request)
        except DeviceUnavailable as exc:
            self._no_device.add(uuid, exc)
            return None
        try:
            decoded = device_replies.decode_device_get(reply, self._device_pools)
        except BaseException as exc:
            await self.release([r.lease_id for r in reply.results if r.found])
            if isinstance(exc, device_replies.EventOpenError):  # ask again, without an event
                self._caps.events_failed(exc)
                return await self._get_device(names, device, ttl_s)
            if isinstance(exc, device_replies.PoolOpenError):
                self._no_device.add(uuid, exc)
                return None
            raise

        async def release(lease_ids: list[int]) -> int:
            device_replies.sync_device(dev)
            return await self.release(lease_ids)

        return AsyncLeasedTensors(decoded.tensors, decoded.lease_ids, release)

    async def _placed(
        self, leased: AsyncLeasedTensors, device: str | torch.device | None
    ) -> AsyncLeasedTensors:
        if device is None or torch.device(device).type == "cpu":
            return leased
        async with leased as tensors:
            moved = [None if t is None else t.to(device) for t in tensors]
        return AsyncLeasedTensors(moved, [], self.release)

    async def _fetch_tensor(self, key: str) -> torch.Tensor | None:
        entry = await self.get_bytes(key)
        return None if entry is None else entry.tensor()

    @overload
    async def get_into(
        self, keys: Sequence[str], out: torch.Tensor, offsets: Sequence[int] | None = None
    ) -> list[into.IntoResult]: ...
    @overload
    async def get_into(self, keys: Sequence[str], out: Sequence[torch.Tensor]) -> list[bool]: ...
    async def get_into(
        self,
        keys: Sequence[str],
        out: torch.Tensor | Sequence[torch.Tensor],
        offsets: Sequence[int] | None = None,
    ) -> list[into.IntoResult] | list[bool]:
        """See :meth:`EmbCacheClient.get_into`."""
        names, _ = as_keys(keys)
        if not isinstance(out, torch.Tensor):
            async with self.get(names) as tensors:
                return into.copy_into(tensors, out)
        into.check_buffer(out, names, offsets)
        if out.device.type == "cuda" and out.numel():
            results = await self._get_into_device(names, out, offsets)
            if results is not None:
                return results
        async with self.get(names) as tensors:
            return into.copy_into_buffer(names, tensors, out, offsets)

    async def _get_into_device(
        self, names: list[str], out: torch.Tensor, offsets: Sequence[int] | None
    ) -> list[into.IntoResult] | None:
        exported = exports.export_cuda(out, as_bytes=True)
        if exported is None:
            return None
        if exported.message.gpu_uuid in self._no_device:
            exported.returned()  # never sent
            return None
        request = pb.GetIntoRequest(
            keys=names, destination=pb.DeviceBuffer(buffer=exported.message), offsets=offsets
        )
        try:
            reply = await self._call(
                lambda md, to: self._stub.GetInto(request, timeout=to, metadata=md), session=True
            )
        except DeviceUnavailable as exc:
            self._no_device.add(exported.message.gpu_uuid, exc)
            return None
        exported.returned()  # the daemon has copied: its event may be reused
        return into.into_results(reply)

    # -- leases --------------------------------------------------------------------------
    async def release(self, lease_ids: Sequence[int]) -> int:
        if not lease_ids:
            return 0
        request = pb.ReleaseRequest(lease_ids=lease_ids)
        session = self._session
        if session is not None and session.alive and session.serves_calls:
            try:
                result = await session.call(self.timeout, release=request)
            except SessionLost:  # the session's leases ended with it; ask over an RPC
                pass
            else:
                if result.WhichOneof("outcome") == "release":
                    return int(result.release.released)
                raise from_call_error(result.error)
        reply = await self._call(
            lambda md, to: self._stub.Release(request, timeout=to, metadata=md)
        )
        return int(reply.released)

    # -- life cycle ----------------------------------------------------------------------
    async def close(self) -> None:
        await self._drop_session()
        await self._channel.close()

    async def __aenter__(self) -> AsyncEmbCacheClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def _aiter(items: Any) -> AsyncIterator[Any]:
    for item in items:
        yield item
