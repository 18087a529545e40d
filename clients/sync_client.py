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

import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar, overload

import grpc
import torch

from ..proto.embcache.v1 import embcache_pb2 as pb
from ..proto.embcache.v1 import embcache_pb2_grpc as pb_grpc
from ..service.errors import EmbCacheError, EntryLeased, NotFound
from ._wire import (
    CHANNEL_OPTIONS,
    SERVICE,
    SESSION_KEY,
    BytesCollector,
    EntryBytes,
    as_keys,
    encode_put,
    normalize_target,
    payload_of,
)
from .errors import RpcFailed, backoff_s, is_unknown_session, should_retry, translate
from .results import LeasedTensors, copy_into, decode_get
from .shm import process_pool_maps
from .stats import EVICT_NAMES, stats_dict

T = TypeVar("T")


class _Session:
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


class EmbCacheClient:
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
    ) -> None:
        target = normalize_target(target)
        opts = [*CHANNEL_OPTIONS, *options]
        if tls or root_certificates is not None:
            creds = grpc.ssl_channel_credentials(root_certificates)
            self._channel = grpc.secure_channel(target, creds, options=opts)
        else:
            self._channel = grpc.insecure_channel(target, options=opts)
        self._stub = pb_grpc.EmbeddingCacheStub(self._channel)
        self._put = self._channel.stream_unary(
            SERVICE + "Put",
            request_serializer=encode_put,
            response_deserializer=pb.PutResponse.FromString,
        )
        self.target = target
        self.timeout = timeout
        self.retries = retries
        self._auth: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {token}"),) if token else ()
        )
        self._client_name = client_name
        self._session: _Session | None = None
        self._session_lock = threading.Lock()
        self._maps = process_pool_maps()
        self._pool_local: bool | None = None  # learned from the first hit
        self._closed = False

    # -- plumbing ------------------------------------------------------------------------
    def _session_id(self) -> str:
        with self._session_lock:
            if self._closed:
                raise RpcFailed("client is closed", "CANCELLED")
            if self._session is None or not self._session.alive:
                self._session = self._call(
                    lambda md, to: _Session(self._stub, md, self._client_name, to)
                )
            assert self._session.session_id is not None
            return self._session.session_id

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
        """Store a tensor (torch or numpy). True if created, False if it already existed."""
        payload = payload_of(tensor)
        reply = self._call(
            lambda md, to: self._put(
                payload.messages(key, checksum=checksum), timeout=to, metadata=md
            )
        )
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
        CUDA ``device`` the tensors are copied there and the leases released at once (the
        direct device path arrives with the device pool).
        """
        names, _ = as_keys(keys)
        if self._pool_local is False:
            tensors = [self._fetch_tensor(k) for k in names]
            return self._placed(LeasedTensors(tensors, [], self.release), device)
        request = pb.GetRequest(keys=names, ttl_s=ttl_s) if ttl_s else pb.GetRequest(keys=names)
        reply = self._call(
            lambda md, to: self._stub.Get(request, timeout=to, metadata=md), session=True
        )
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

    def _placed(self, leased: LeasedTensors, device: str | torch.device | None) -> LeasedTensors:
        if device is None or torch.device(device).type == "cpu":
            return leased
        with leased as tensors:
            moved = [None if t is None else t.to(device) for t in tensors]
        return LeasedTensors(moved, [], self.release)

    def _fetch_tensor(self, key: str) -> torch.Tensor | None:
        entry = self.get_bytes(key)
        return None if entry is None else entry.tensor()

    def get_into(self, keys: Sequence[str], out: Sequence[torch.Tensor]) -> list[bool]:
        """Copy each entry into ``out[i]`` (same dtype and element count); found flags."""
        with self.get(keys) as tensors:
            return copy_into(tensors, out)

    def get_bytes(self, key: str, offset: int = 0, length: int | None = None) -> EntryBytes | None:
        """The entry's bytes streamed over gRPC (works from any machine); None if absent."""
        request = pb.GetBytesRequest(key=key, offset=offset)
        if length is not None:
            request.length = length

        def fetch(md: Any, to: float) -> EntryBytes:
            collector = BytesCollector(key)
            for msg in self._stub.GetBytes(request, timeout=to, metadata=md):
                collector.add(msg, length, offset)
            return collector.result()

        try:
            return self._call(fetch)
        except EmbCacheError as exc:
            if getattr(exc, "grpc_status", None) == grpc.StatusCode.NOT_FOUND:
                return None
            raise

    # -- leases --------------------------------------------------------------------------
    def release(self, lease_ids: Sequence[int]) -> int:
        if not lease_ids:
            return 0
        request = pb.ReleaseRequest(lease_ids=lease_ids)
        reply = self._call(lambda md, to: self._stub.Release(request, timeout=to, metadata=md))
        return int(reply.released)

    def renew(self, lease_ids: Sequence[int], ttl_s: float | None = None) -> int:
        request = pb.RenewRequest(lease_ids=lease_ids)
        if ttl_s is not None:
            request.ttl_s = ttl_s
        reply = self._call(lambda md, to: self._stub.Renew(request, timeout=to, metadata=md))
        return int(reply.renewed)

    # -- exists / evict / stats ----------------------------------------------------------
    @overload
    def exists(self, keys: str) -> bool: ...  # type: ignore[overload-overlap]
    @overload
    def exists(self, keys: Sequence[str]) -> list[bool]: ...
    def exists(self, keys: str | Sequence[str]) -> bool | list[bool]:
        names, single = as_keys(keys)
        request = pb.ExistsRequest(keys=names)
        reply = self._call(lambda md, to: self._stub.Exists(request, timeout=to, metadata=md))
        found = list(reply.exists)
        return found[0] if single else found

    @overload
    def evict(self, keys: str) -> str: ...  # type: ignore[overload-overlap]
    @overload
    def evict(self, keys: Sequence[str]) -> list[str]: ...
    def evict(self, keys: str | Sequence[str]) -> str | list[str]:
        """One key: "evicted", or raises NotFound / EntryLeased. Several: an outcome each
        ("evicted", "not_found", "leased"); leased entries are never forced out."""
        names, single = as_keys(keys)
        request = pb.EvictRequest(keys=names)
        try:
            reply = self._call(lambda md, to: self._stub.Evict(request, timeout=to, metadata=md))
        except Exception as exc:
            if single or len(names) != 1:
                raise
            return [_outcome_of(exc)]
        outcomes = [EVICT_NAMES[r.outcome] for r in reply.results]
        return outcomes[0] if single else outcomes

    def stats(self) -> dict[str, Any]:
        reply = self._call(
            lambda md, to: self._stub.Stats(pb.StatsRequest(), timeout=to, metadata=md)
        )
        return stats_dict(reply)

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


def _outcome_of(exc: Exception) -> str:
    if isinstance(exc, NotFound):
        return "not_found"
    if isinstance(exc, EntryLeased):
        return "leased"
    raise exc
