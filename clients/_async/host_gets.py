"""Gets of entries in the daemon's host memory.

On the daemon's node small entries are copies read out of the read table with no call, or
sent after the result; larger ones (and every entry of a ``zero_copy`` get) are
copy-on-write views of the host pool with a lease. On another machine the bytes come in the
reply, or streamed. A get for a GPU that has no device path is copied there from the host.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from embcache.clients._async.connection import AsyncConnection
from embcache.clients._async.results import AsyncLeasedTensors
from embcache.clients._async.state import ClientState
from embcache.clients._async.stateless_calls import AsyncStatelessCalls
from embcache.clients._async.table_gets import AsyncTableReads
from embcache.clients._async.view_holds import ViewHolds
from embcache.clients.core.replies import check_ended
from embcache.clients.core.requests import get_request
from embcache.clients.core.session_calls import serves
from embcache.clients.device.host_replies import (
    INLINE_GET_BYTES,
    INLINE_REMOTE_BYTES,
    decode_get,
    leased_ids,
)
from embcache.errors import LeaseExpired
from embcache.proto.embcache.v1 import embcache_pb2 as pb

R = TypeVar("R")


class AsyncHostGets:
    """A client's gets out of the daemon's host pool, and copies made from them."""

    def __init__(
        self,
        conn: AsyncConnection,
        state: ClientState,
        tables: AsyncTableReads,
        holds: ViewHolds,
        calls: AsyncStatelessCalls,
    ) -> None:
        self._conn = conn
        self._state = state
        self._tables = tables
        self._holds = holds
        self._calls = calls

    async def get(
        self,
        names: list[str],
        device: str | torch.device | None = None,
        ttl_s: float | None = None,
        zero_copy: bool = False,
    ) -> AsyncLeasedTensors:
        """The entries as host tensors (copied to ``device`` afterwards, if it is a GPU)."""
        release = self._conn.release
        state = self._state
        if not zero_copy and ttl_s is None:
            # No call: read where the daemon wrote (a lifetime asked for is the daemon's to
            # check, so such a get is a call).
            copies = await self._tables.copies(names)
            if copies is not None:
                return await self.placed(AsyncLeasedTensors(copies, [], release), device)
        if state.pool_local is False and not await self._inline_gets():
            tensors = [await self._fetch_tensor(k) for k in names]
            return await self.placed(AsyncLeasedTensors(tensors, [], release), device)
        taken_at = time.monotonic()
        # Copies on request; on another machine up to the most one reply carries.
        limit = INLINE_REMOTE_BYTES if state.pool_local is False else state.copy_gets_up_to
        limit = 0 if zero_copy and state.pool_local is not False else limit
        reply, payload = await self._get_call(get_request(names, ttl_s), limit)
        try:
            decoded = decode_get(reply, state.maps, payload=payload)
        except BaseException:
            await release(leased_ids(reply))
            raise
        if decoded.lease_ids:
            state.pool_local = not decoded.remote
        if decoded.remote:
            await release(decoded.lease_ids)
            for i in decoded.remote:
                decoded.tensors[i] = await self._fetch_tensor(names[i])
            decoded.lease_ids = []
            decoded.anchors = []
        views, anchors = self._holds.hold(decoded, ttl_s, taken_at)
        # Copies made before the leases could have ended (the client's estimate runs from
        # before the call was sent) need no count from the daemon at release.
        fresh = time.monotonic() < taken_at + self._holds.lease_lifetime(ttl_s)
        leased = AsyncLeasedTensors(
            decoded.tensors,
            decoded.lease_ids,
            release,
            views,
            anchors,
            post=self._holds.release_later if fresh else None,
        )
        del decoded, anchors  # the leased tensors hold the views now: nothing else may
        return await self.placed(leased, device)

    async def copy(self, names: list[str], copy: Callable[[list[Any]], R]) -> R:
        """``copy(tensors)`` of a host get whose entries are read straight from the shared
        mapping (no views to make: they are copied at once), then the leases end."""
        if self._state.pool_local is False:
            return await self._copied(await self.get(names), copy)
        copies = await self._tables.copies(names)  # no call where the read table has them all
        if copies is not None:
            return copy(copies)
        # copied into the caller's memory anyway: small entries may come as copies
        reply, payload = await self._get_call(get_request(names, None), INLINE_GET_BYTES)
        ids = leased_ids(reply)
        try:
            decoded = decode_get(reply, self._state.maps, views=False, payload=payload)
            if decoded.remote:  # not mappable here: the leased get streams the bytes
                self._state.pool_local = False
                await self._conn.release(ids)
                return await self._copied(await self.get(names), copy)
            self._state.pool_local = True if ids else self._state.pool_local
            result = copy(decoded.tensors)
        except BaseException:
            await self._conn.release(ids)
            raise
        check_ended(await self._conn.release(ids), ids)  # copied while the leases lived, or not
        return result

    async def placed(
        self, leased: AsyncLeasedTensors, device: str | torch.device | None
    ) -> AsyncLeasedTensors:
        """``leased`` as it is for the host, else copied to ``device`` (its leases end)."""
        if device is None or torch.device(device).type == "cpu":
            return leased
        moved = await self._copied(leased, lambda ts: [_moved(t, device) for t in ts])
        return AsyncLeasedTensors(moved, [], self._conn.release)

    async def _copied(self, leased: AsyncLeasedTensors, copy: Callable[[list[Any]], R]) -> R:
        """``copy(tensors)``, then the leases end at once: the views are read no more."""
        try:
            result = copy(leased.tensors)
        except BaseException:
            with contextlib.suppress(LeaseExpired):  # do not hide the error that is leaving
                await leased.release(now=True)
            raise
        await leased.release(now=True)
        return result

    async def _fetch_tensor(self, key: str) -> torch.Tensor | None:
        entry = await self._calls.get_bytes(key)
        return None if entry is None else entry.tensor()

    async def _get_call(
        self, request: pb.GetRequest, limit: int
    ) -> tuple[pb.GetResponse, bytearray | None]:
        """A host Get in the session, and the raw bytes after its result: where the session
        socket serves it, entries of at most ``limit`` bytes come back as copies (no lease,
        no mapping), their bytes after the result; 0: none."""
        if not limit or not await self._inline_gets():
            return await self._conn.get_call(request), None
        request.inline_max_bytes = limit

        def take(reply: pb.GetResponse, payload: bytearray | None) -> Any:
            return reply, payload

        async def rpc(md: Any, to: float) -> tuple[pb.GetResponse, None]:  # no copies follow
            return await self._conn.stub.Get(request, timeout=to, metadata=md), None

        got: tuple[pb.GetResponse, bytearray | None] = await self._conn.session_call(
            "get", request, rpc, take
        )
        return got

    async def _inline_gets(self) -> bool:
        """Whether this client's session serves host gets with inline copies."""
        return serves(await self._conn.open_session(), "inline_get")


def _moved(tensor: torch.Tensor | None, device: str | torch.device) -> torch.Tensor | None:
    """``tensor`` copied to ``device`` (a miss stays None)."""
    return None if tensor is None else tensor.to(device)
