# GENERATED from clients/_async/host_gets.py by scripts/unasync.py: do not edit.
# Change the asyncio source, then run `python scripts/unasync.py`.
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

from embcache.clients._sync.connection import Connection
from embcache.clients._sync.results import LeasedTensors
from embcache.clients._sync.state import ClientState
from embcache.clients._sync.stateless_calls import StatelessCalls
from embcache.clients._sync.table_gets import TableReads
from embcache.clients._sync.view_holds import ViewHolds
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


class HostGets:
    """A client's gets out of the daemon's host pool, and copies made from them."""

    def __init__(
        self,
        conn: Connection,
        state: ClientState,
        tables: TableReads,
        holds: ViewHolds,
        calls: StatelessCalls,
    ) -> None:
        self._conn = conn
        self._state = state
        self._tables = tables
        self._holds = holds
        self._calls = calls

    def get(
        self,
        names: list[str],
        device: str | torch.device | None = None,
        ttl_s: float | None = None,
        zero_copy: bool = False,
    ) -> LeasedTensors:
        """The entries as host tensors (copied to ``device`` afterwards, if it is a GPU)."""
        release = self._conn.release
        state = self._state
        if not zero_copy and ttl_s is None:
            # No call: read where the daemon wrote (a lifetime asked for is the daemon's to
            # check, so such a get is a call).
            copies = self._tables.copies(names)
            if copies is not None:
                return self.placed(LeasedTensors(copies, [], release), device)
        if state.pool_local is False and not self._inline_gets():
            tensors = [self._fetch_tensor(k) for k in names]
            return self.placed(LeasedTensors(tensors, [], release), device)
        taken_at = time.monotonic()
        # Copies on request; on another machine up to the most one reply carries.
        limit = INLINE_REMOTE_BYTES if state.pool_local is False else state.copy_gets_up_to
        limit = 0 if zero_copy and state.pool_local is not False else limit
        reply, payload = self._get_call(get_request(names, ttl_s), limit)
        try:
            decoded = decode_get(reply, state.maps, payload=payload)
        except BaseException:
            release(leased_ids(reply))
            raise
        if decoded.lease_ids:
            state.pool_local = not decoded.remote
        if decoded.remote:
            release(decoded.lease_ids)
            for i in decoded.remote:
                decoded.tensors[i] = self._fetch_tensor(names[i])
            decoded.lease_ids = []
            decoded.anchors = []
        views, anchors = self._holds.hold(decoded, ttl_s, taken_at)
        # Copies made before the leases could have ended (the client's estimate runs from
        # before the call was sent) need no count from the daemon at release.
        fresh = time.monotonic() < taken_at + self._holds.lease_lifetime(ttl_s)
        leased = LeasedTensors(
            decoded.tensors,
            decoded.lease_ids,
            release,
            views,
            anchors,
            post=self._holds.release_later if fresh else None,
        )
        del decoded, anchors  # the leased tensors hold the views now: nothing else may
        return self.placed(leased, device)

    def copy(self, names: list[str], copy: Callable[[list[Any]], R]) -> R:
        """``copy(tensors)`` of a host get whose entries are read straight from the shared
        mapping (no views to make: they are copied at once), then the leases end."""
        if self._state.pool_local is False:
            return self._copied(self.get(names), copy)
        copies = self._tables.copies(names)  # no call where the read table has them all
        if copies is not None:
            return copy(copies)
        # copied into the caller's memory anyway: small entries may come as copies
        reply, payload = self._get_call(get_request(names, None), INLINE_GET_BYTES)
        ids = leased_ids(reply)
        try:
            decoded = decode_get(reply, self._state.maps, views=False, payload=payload)
            if decoded.remote:  # not mappable here: the leased get streams the bytes
                self._state.pool_local = False
                self._conn.release(ids)
                return self._copied(self.get(names), copy)
            self._state.pool_local = True if ids else self._state.pool_local
            result = copy(decoded.tensors)
        except BaseException:
            self._conn.release(ids)
            raise
        check_ended(self._conn.release(ids), ids)  # copied while the leases lived, or not
        return result

    def placed(self, leased: LeasedTensors, device: str | torch.device | None) -> LeasedTensors:
        """``leased`` as it is for the host, else copied to ``device`` (its leases end)."""
        if device is None or torch.device(device).type == "cpu":
            return leased
        moved = self._copied(leased, lambda ts: [_moved(t, device) for t in ts])
        return LeasedTensors(moved, [], self._conn.release)

    def _copied(self, leased: LeasedTensors, copy: Callable[[list[Any]], R]) -> R:
        """``copy(tensors)``, then the leases end at once: the views are read no more."""
        try:
            result = copy(leased.tensors)
        except BaseException:
            with contextlib.suppress(LeaseExpired):  # do not hide the error that is leaving
                leased.release(now=True)
            raise
        leased.release(now=True)
        return result

    def _fetch_tensor(self, key: str) -> torch.Tensor | None:
        entry = self._calls.get_bytes(key)
        return None if entry is None else entry.tensor()

    def _get_call(
        self, request: pb.GetRequest, limit: int
    ) -> tuple[pb.GetResponse, bytearray | None]:
        """A host Get in the session, and the raw bytes after its result: where the session
        socket serves it, entries of at most ``limit`` bytes come back as copies (no lease,
        no mapping), their bytes after the result; 0: none."""
        if not limit or not self._inline_gets():
            return self._conn.get_call(request), None
        request.inline_max_bytes = limit

        def take(reply: pb.GetResponse, payload: bytearray | None) -> Any:
            return reply, payload

        def rpc(md: Any, to: float) -> tuple[pb.GetResponse, None]:  # no copies follow
            return self._conn.stub.Get(request, timeout=to, metadata=md), None

        got: tuple[pb.GetResponse, bytearray | None] = self._conn.session_call(
            "get", request, rpc, take
        )
        return got

    def _inline_gets(self) -> bool:
        """Whether this client's session serves host gets with inline copies."""
        return serves(self._conn.open_session(), "inline_get")


def _moved(tensor: torch.Tensor | None, device: str | torch.device) -> torch.Tensor | None:
    """``tensor`` copied to ``device`` (a miss stays None)."""
    return None if tensor is None else tensor.to(device)
