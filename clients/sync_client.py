"""``EmbCacheClient``: the blocking client for encoder and decoder workers.

    with EmbCacheClient("unix:/run/embcache.sock") as client:
        client.put("img-1", embedding)                  # streams 1 MiB chunks, CRC32-checked
        with client.get(["img-1", "img-2"]) as (a, b):  # zero-copy views on the same node
            ...                                         # leases released on exit

Every call has a deadline (``timeout``) and is retried on UNAVAILABLE with jittered
exponential backoff. Leases taken by ``get`` belong to a Session stream opened on first
use and kept for the life of the client: if this process dies, the daemon releases them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar, overload

import grpc
import torch

from embcache.clients._backends.sync_lane import LaneSession
from embcache.clients._backends.sync_session import Session
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
from embcache.clients.plain_calls import PlainCalls
from embcache.clients.results import LeasedTensors
from embcache.errors import DeviceUnavailable
from embcache.proto.constants import SESSION_KEY
from embcache.proto.embcache.v1 import embcache_pb2 as pb

T = TypeVar("T")
log = logging.getLogger("embcache.client")


class EmbCacheClient(PlainCalls):
    """The blocking client (module docstring); exists, evict, prefetch, stats, renew and
    get_bytes come from :class:`~embcache.clients.plain_calls.PlainCalls`."""

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
            target, tls=tls, root_certificates=root_certificates, options=options, aio=False
        )
        self.target = target
        self.timeout = timeout
        self.retries = retries
        self._auth = auth_metadata(token)
        self._token = token
        self._client_name = client_name
        # Session calls go over the daemon's lane when it has one (lane.py), else gRPC.
        self._lane = lane_path(target) if session_lane else None
        self._session: Session | LaneSession | None = None
        self._session_lock = threading.Lock()
        self._maps = process_pool_maps()
        self._pool_local: bool | None = None  # learned from the first hit
        self._device_pools = pools.process_device_pools()
        self._no_device = HostFallbacks()  # GPUs served through the host for now
        self._caps = Capabilities()  # what the daemon turned out not to support
        self._closed = False

    # -- plumbing ------------------------------------------------------------------------
    def _session_id(self) -> str:
        session_id = self._open_session().session_id
        assert session_id is not None
        return session_id

    def _open_session(self) -> Session | LaneSession:
        with self._session_lock:
            if self._closed:
                raise RpcFailed("client is closed", "CANCELLED")
            if self._session is None or not self._session.alive:
                if self._session is not None:
                    self._session.close()  # ended: let go of its socket and thread
                    self._session = None
                # On the lane if the daemon has one, else a gRPC Session stream; a retry
                # (UNAVAILABLE: a restarting daemon) looks for the lane again.
                self._session = self._call(
                    lambda md, to: (
                        self._open_lane() or Session(self._stub, md, self._client_name, to)
                    )
                )
            return self._session

    def _open_lane(self) -> LaneSession | None:
        """A session on the daemon's lane; None if it has none (this session uses gRPC; the
        next one looks for the lane again, e.g. after the daemon restarted with one)."""
        if self._lane is None:
            return None
        try:
            return LaneSession(self._lane, self._token, self._client_name, self.timeout)
        except OSError as err:
            log.debug("no session lane at %s (%s): this session uses gRPC", self._lane, err)
            return None

    def _get_call(self, request: pb.GetRequest) -> pb.GetResponse:
        """A Get whose leases belong to this client's session (see :meth:`_session_call`)."""
        return self._session_call(
            "get", request, lambda md, to: self._stub.Get(request, timeout=to, metadata=md)
        )

    def _session_call(self, kind: str, request: Any, rpc: Callable[[Any, float], T]) -> T:
        """``request`` as a ``kind`` call on the session stream when the daemon serves those
        there (half the latency of an RPC), else the RPC ``rpc(metadata, timeout)`` in the
        session. Retried like an RPC: on UNAVAILABLE, and once on a new session if the
        stream ended (a Get's leases ended with it; a put is idempotent)."""
        attempt = 0
        while True:
            session = self._open_session()
            if not serves(session, kind):
                return self._call(rpc, session=True)
            try:
                result = session.call(self.timeout, **{kind: request})
            except SessionLost:
                if attempt >= self.retries:
                    raise
                attempt += 1
                continue
            if result.WhichOneof("outcome") == kind:
                reply: T = getattr(result, kind)
                return reply
            if retry_step(result, attempt, self.retries) == "new_session":
                self._drop_session()  # the daemon forgot it: start a new one
            else:
                time.sleep(backoff_s(attempt))
            attempt += 1

    def _drop_session(self) -> None:
        with self._session_lock:
            if self._session is not None:
                self._session.close()
                self._session = None

    def _call(self, fn: Callable[[Any, float], T], *, session: bool = False) -> T:
        """Run ``fn(metadata, timeout)`` with retries on UNAVAILABLE (and a stale session)."""
        reopened = False
        attempt = 0
        while True:
            metadata = self._auth
            if session:
                metadata = (*metadata, (SESSION_KEY, self._session_id()))
            try:
                return fn(metadata, self.timeout)
            except grpc.RpcError as err:
                if session and not reopened and is_unknown_session(err):
                    reopened = True
                    self._drop_session()
                    continue
                if should_retry(err) and attempt < self.retries:
                    time.sleep(backoff_s(attempt))
                    attempt += 1
                    continue
                raise translate(err) from err

    # -- puts ----------------------------------------------------------------------------
    def put(self, key: str, tensor: Any, *, checksum: bool = True) -> bool:
        """Store a tensor (torch or numpy). True if created, False if it already existed.

        A CUDA tensor goes through PutFromDevice (the daemon copies it from this GPU; no
        checksum) when the daemon can open it, else its bytes are streamed."""
        if self._caps.device_puts and dp.wants_device_put(tensor):
            created = self._put_from_device(key, tensor)
            if created is not None:
                return created
        payload = payload_of(tensor)
        reply = self._call(
            lambda md, to: self._put(
                payload.messages(key, checksum=checksum), timeout=to, metadata=md
            )
        )
        return bool(reply.created)

    def put_many(
        self, items: Mapping[str, Any] | Sequence[tuple[str, Any]], *, checksum: bool = True
    ) -> list[bool]:
        """Store several tensors (a mapping or ``(key, tensor)`` pairs); per item, in order,
        True if created. The CUDA tensors go in ``PutFromDeviceBatch`` calls (one wait per
        call; a call is all or nothing: ``device_puts.py``); the rest is streamed as by
        :meth:`put`."""
        pairs = dp.as_pairs(items)
        out: list[bool | None] = [None] * len(pairs)
        cuda = [(i, k, t) for i, (k, t) in enumerate(pairs) if dp.wants_device_put(t)]
        if cuda and self._caps.device_puts and self._caps.batch_puts:
            for batch in dp.batches(cuda) or []:
                reply = self._put_batch(batch)
                if reply is None:
                    break
                batch.returned(reply, out)
        return [
            bool(c) if c is not None else self.put(k, t, checksum=checksum)
            for (k, t), c in zip(pairs, out, strict=True)
        ]

    def _put_batch(self, batch: dp.Batch) -> pb.PutFromDeviceBatchResponse | None:
        try:
            return self._session_call(
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

    def _put_from_device(self, key: str, tensor: torch.Tensor) -> bool | None:
        exported = exports.export_cuda(tensor.detach().contiguous())
        if exported is None:
            return None
        request = pb.PutFromDeviceRequest(key=key, tensor=exported.message)
        try:
            reply = self._session_call(
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
    ) -> LeasedTensors:
        """Tensors for ``keys`` (None for a miss), leased until released.

        On the daemon's node the tensors are read-only views of its shared memory (entries
        in several page runs are gathered copies). Elsewhere the bytes are streamed. With a
        CUDA ``device`` (``"cuda"``, ``"cuda:N"``, a torch.device) and a daemon with a
        device pool on that GPU, the tensors live on the GPU: views of the daemon's device
        pool (contiguous entries; valid while leased) or gathered copies the caller owns.
        Without such a pool they are copied there and the leases released at once.
        """
        names, _ = as_keys(keys)
        if device is not None and torch.device(device).type == "cuda":
            leased = self._get_device(names, device, ttl_s)
            if leased is not None:
                return leased
        if self._pool_local is False:
            tensors = [self._fetch_tensor(k) for k in names]
            return self._placed(LeasedTensors(tensors, [], self.release), device)
        request = pb.GetRequest(keys=names, ttl_s=ttl_s) if ttl_s else pb.GetRequest(keys=names)
        reply = self._get_call(request)
        try:
            decoded = decode_get(reply, self._maps)
        except BaseException:
            self.release([r.lease_id for r in reply.results if r.found])
            raise
        if decoded.lease_ids:
            self._pool_local = not decoded.remote
        if decoded.remote:
            self.release(decoded.lease_ids)
            for i in decoded.remote:
                decoded.tensors[i] = self._fetch_tensor(names[i])
            decoded.lease_ids = []
        return self._placed(LeasedTensors(decoded.tensors, decoded.lease_ids, self.release), device)

    def _get_device(
        self, names: list[str], device: str | torch.device, ttl_s: float | None
    ) -> LeasedTensors | None:
        dev, uuid = pools.resolve_device(device)
        if uuid in self._no_device:
            return None
        request = pb.GetRequest(keys=names, gpu_uuid=uuid, ready_event=self._caps.ready_events)
        if ttl_s:
            request.ttl_s = ttl_s
        try:
            reply = self._get_call(request)
        except DeviceUnavailable as exc:
            self._no_device.add(uuid, exc)
            return None
        try:
            decoded = device_replies.decode_device_get(reply, self._device_pools)
        except BaseException as exc:
            self.release([r.lease_id for r in reply.results if r.found])
            if isinstance(exc, device_replies.EventOpenError):  # ask again, without an event
                self._caps.events_failed(exc)
                return self._get_device(names, device, ttl_s)
            if isinstance(exc, device_replies.PoolOpenError):
                self._no_device.add(uuid, exc)
                return None
            raise

        def release(lease_ids: list[int]) -> int:
            device_replies.sync_device(dev)
            return self.release(lease_ids)

        return LeasedTensors(decoded.tensors, decoded.lease_ids, release)

    def _placed(self, leased: LeasedTensors, device: str | torch.device | None) -> LeasedTensors:
        if device is None or torch.device(device).type == "cpu":
            return leased
        with leased as tensors:
            moved = [None if t is None else t.to(device) for t in tensors]
        return LeasedTensors(moved, [], self.release)

    def _fetch_tensor(self, key: str) -> torch.Tensor | None:
        entry = self.get_bytes(key)
        return None if entry is None else entry.tensor()

    @overload
    def get_into(
        self, keys: Sequence[str], out: torch.Tensor, offsets: Sequence[int] | None = None
    ) -> list[into.IntoResult]: ...
    @overload
    def get_into(self, keys: Sequence[str], out: Sequence[torch.Tensor]) -> list[bool]: ...
    def get_into(
        self,
        keys: Sequence[str],
        out: torch.Tensor | Sequence[torch.Tensor],
        offsets: Sequence[int] | None = None,
    ) -> list[into.IntoResult] | list[bool]:
        """Copy entries into your memory.

        ``out`` one contiguous tensor (a CUDA buffer: the daemon copies straight into it):
        each entry's bytes go to its byte offset (``offsets``, or packed back to back at
        16-byte-aligned offsets); returns an :class:`IntoResult` per key (found, dtype,
        shape, offset; ``r.view(out)``). The copies are complete when this returns.
        ``out`` a list of tensors: one per key, same dtype and element count; found flags.
        """
        names, _ = as_keys(keys)
        if not isinstance(out, torch.Tensor):
            with self.get(names) as tensors:
                return into.copy_into(tensors, out)
        into.check_buffer(out, names, offsets)
        if out.device.type == "cuda" and out.numel():
            results = self._get_into_device(names, out, offsets)
            if results is not None:
                return results
        with self.get(names) as tensors:
            return into.copy_into_buffer(names, tensors, out, offsets)

    def _get_into_device(
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
            reply = self._call(
                lambda md, to: self._stub.GetInto(request, timeout=to, metadata=md), session=True
            )
        except DeviceUnavailable as exc:
            self._no_device.add(exported.message.gpu_uuid, exc)
            return None
        exported.returned()  # the daemon has copied: its event may be reused
        return into.into_results(reply)

    # -- leases --------------------------------------------------------------------------
    def release(self, lease_ids: Sequence[int]) -> int:
        if not lease_ids:
            return 0
        request = pb.ReleaseRequest(lease_ids=lease_ids)
        session = self._session
        if session is not None and session.alive and session.serves_calls:
            try:
                result = session.call(self.timeout, release=request)
            except SessionLost:  # the session's leases ended with it; ask over an RPC
                pass
            else:
                if result.WhichOneof("outcome") == "release":
                    return int(result.release.released)
                raise from_call_error(result.error)
        reply = self._call(lambda md, to: self._stub.Release(request, timeout=to, metadata=md))
        return int(reply.released)

    # -- life cycle ----------------------------------------------------------------------
    def close(self) -> None:
        """End the session (the daemon releases its leases) and close the channel."""
        self._drop_session()
        self._closed = True
        self._channel.close()

    def __enter__(self) -> EmbCacheClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
