"""The calls of both clients that need no session and no device: exists, evict, prefetch,
stats, renew and get_bytes. Each client class mixes in its flavour (blocking or asyncio) and
provides ``_stub`` and ``_call`` (deadline, metadata, retries on UNAVAILABLE)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, overload

import grpc

from embcache.clients.core.replies import (
    BytesCollector,
    EntryBytes,
    evict_outcomes,
    prefetch_dict,
    stats_dict,
)
from embcache.clients.core.requests import as_keys, evict_request, prefetch_request, renew_request
from embcache.clients.device import pools
from embcache.errors import EmbCacheError
from embcache.proto.embcache.v1 import embcache_pb2 as pb

T = TypeVar("T")


class PlainCalls:
    """Mixed into :class:`~embcache.clients.EmbCacheClient`."""

    _stub: Any

    if TYPE_CHECKING:  # the client's own (sync_client.py)

        def _call(self, fn: Callable[[Any, float], T], *, session: bool = False) -> T: ...

    @overload
    def exists(self, keys: str) -> bool: ...  # type: ignore[overload-overlap]
    @overload
    def exists(self, keys: Sequence[str]) -> list[bool]: ...
    def exists(self, keys: str | Sequence[str]) -> bool | list[bool]:
        names, single = as_keys(keys)
        request = pb.ExistsRequest(keys=names)
        reply = self._call(_unary(self._stub.Exists, request))
        found = list(reply.exists)
        return found[0] if single else found

    @overload
    def evict(self, keys: str, device: Any = None) -> str: ...  # type: ignore[overload-overlap]
    @overload
    def evict(self, keys: Sequence[str], device: Any = None) -> list[str]: ...
    def evict(self, keys: str | Sequence[str], device: Any = None) -> str | list[str]:
        """One key: "evicted", or raises NotFound / EntryLeased. Several: an outcome each
        ("evicted", "not_found", "leased"); leased entries are never forced out.
        ``device`` (``"cuda:N"``, an index): only the copies on that GPU go, their host
        copies stay ("not_found" then also means no copy there)."""
        names, single = as_keys(keys)
        request = evict_request(names, pools.uuid_of(device))
        try:
            reply = self._call(_unary(self._stub.Evict, request))
        except Exception as exc:
            return evict_outcomes(names, single, failure=exc)
        return evict_outcomes(names, single, reply=reply)

    def prefetch(self, keys: Sequence[str], device: Any = None) -> dict[str, int]:
        """Warm the daemon's local tiers (shared tier -> host pool, and ``device``'s GPU)."""
        request = prefetch_request(keys, pools.uuid_of(device))
        reply = self._call(_unary(self._stub.Prefetch, request))
        return prefetch_dict(reply)

    def stats(self) -> dict[str, Any]:
        reply = self._call(_unary(self._stub.Stats, pb.StatsRequest()))
        return stats_dict(reply)

    def renew(self, lease_ids: Sequence[int], ttl_s: float | None = None) -> int:
        request = renew_request(lease_ids, ttl_s)
        reply = self._call(_unary(self._stub.Renew, request))
        return int(reply.renewed)

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


class AsyncPlainCalls:
    """Mixed into :class:`~embcache.clients.AsyncEmbCacheClient` (the same calls, awaited)."""

    _stub: Any

    if TYPE_CHECKING:  # the client's own (async_client.py)

        async def _call(
            self, fn: Callable[[Any, float], Awaitable[T]], *, session: bool = False
        ) -> T: ...

    @overload
    async def exists(self, keys: str) -> bool: ...  # type: ignore[overload-overlap]
    @overload
    async def exists(self, keys: Sequence[str]) -> list[bool]: ...
    async def exists(self, keys: str | Sequence[str]) -> bool | list[bool]:
        names, single = as_keys(keys)
        request = pb.ExistsRequest(keys=names)
        reply = await self._call(_unary(self._stub.Exists, request))
        found = list(reply.exists)
        return found[0] if single else found

    @overload
    async def evict(self, keys: str, device: Any = None) -> str: ...  # type: ignore[overload-overlap]
    @overload
    async def evict(self, keys: Sequence[str], device: Any = None) -> list[str]: ...
    async def evict(self, keys: str | Sequence[str], device: Any = None) -> str | list[str]:
        names, single = as_keys(keys)
        request = evict_request(names, pools.uuid_of(device))
        try:
            reply = await self._call(_unary(self._stub.Evict, request))
        except Exception as exc:
            return evict_outcomes(names, single, failure=exc)
        return evict_outcomes(names, single, reply=reply)

    async def prefetch(self, keys: Sequence[str], device: Any = None) -> dict[str, int]:
        """Warm the daemon's local tiers (shared tier -> host pool, and ``device``'s GPU)."""
        request = prefetch_request(keys, pools.uuid_of(device))
        reply = await self._call(_unary(self._stub.Prefetch, request))
        return prefetch_dict(reply)

    async def stats(self) -> dict[str, Any]:
        reply = await self._call(_unary(self._stub.Stats, pb.StatsRequest()))
        return stats_dict(reply)

    async def renew(self, lease_ids: Sequence[int], ttl_s: float | None = None) -> int:
        request = renew_request(lease_ids, ttl_s)
        reply = await self._call(_unary(self._stub.Renew, request))
        return int(reply.renewed)

    async def get_bytes(
        self, key: str, offset: int = 0, length: int | None = None
    ) -> EntryBytes | None:
        request = pb.GetBytesRequest(key=key, offset=offset)
        if length is not None:
            request.length = length

        async def fetch(md: Any, to: float) -> EntryBytes:
            collector = BytesCollector(key)
            async for msg in self._stub.GetBytes(request, timeout=to, metadata=md):
                collector.add(msg, length, offset)
            return collector.result()

        try:
            return await self._call(fetch)
        except EmbCacheError as exc:
            if getattr(exc, "grpc_status", None) == grpc.StatusCode.NOT_FOUND:
                return None
            raise


def _unary(method: Any, request: Any) -> Callable[[Any, float], Any]:
    """The ``fn(metadata, timeout)`` of ``_call`` for one unary RPC."""
    return lambda md, to: method(request, timeout=to, metadata=md)
