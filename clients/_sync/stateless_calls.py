# GENERATED from clients/_async/stateless_calls.py by scripts/unasync.py: do not edit.
# Change the asyncio source, then run `python scripts/unasync.py`.
"""The calls that need neither the session nor a device: exists, evict, prefetch, stats,
renew and get_bytes. Each is one RPC with the connection's deadline and retries; get_bytes
rides the session instead where it runs on a session socket, which sends the bytes raw."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc

from embcache.clients._backends.sync_io import CallFn
from embcache.clients._sync.connection import Connection
from embcache.clients._sync.table_gets import TableReads
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


class StatelessCalls:
    """A client's simple calls; each raises ``RpcFailed`` when the daemon could not be
    reached (after the retries) in time."""

    def __init__(self, conn: Connection, tables: TableReads) -> None:
        self._conn = conn
        self._tables = tables

    def exists(self, keys: str | Sequence[str]) -> bool | list[bool]:
        """Whether entries are stored (complete and visible).

        Args:
            keys: one key, or several.

        Returns:
            For one key a bool; for several a bool each, in order.

        """
        names, single = as_keys(keys)
        table = self._tables.read_table()
        if table is not None and all(table.contains(k) for k in names):
            return True if single else [True] * len(names)
        request = pb.ExistsRequest(keys=names)
        reply = self._conn.call(_unary(self._conn.stub.Exists, request))
        found = list(reply.exists)
        return found[0] if single else found

    def evict(self, keys: str | Sequence[str], device: Any = None) -> str | list[str]:
        """Remove entries; leased entries are never forced out.

        Args:
            keys: one key, or several.
            device: ``"cuda:N"``, an index or a torch.device: only the copies on that GPU go
                (their host copies stay; ``"not_found"`` then also means no copy there).

        Returns:
            For one key ``"evicted"``; for several an outcome each: ``"evicted"``,
            ``"not_found"`` or ``"leased"``.

        Raises:
            NotFound: (one key) no such entry.
            EntryLeased: (one key) the entry is leased.
            DeviceUnavailable: ``device`` has no device pool in the daemon.
        """
        names, single = as_keys(keys)
        request = evict_request(names, pools.uuid_of(device))
        try:
            reply = self._conn.call(_unary(self._conn.stub.Evict, request))
        except Exception as exc:
            return evict_outcomes(names, single, failure=exc)
        return evict_outcomes(names, single, reply=reply)

    def prefetch(self, keys: Sequence[str], device: Any = None) -> dict[str, int]:
        """Warm the daemon's local tiers ahead of the gets that will follow.

        Args:
            keys: the entries to bring in (from the shared tier to the host pool).
            device: also copy them to that GPU's device pool (``"cuda:N"``, an index).

        Returns:
            Counts: ``requested``, ``local``, ``fetched``, ``missing``, ``resident``.

        Raises:
            DeviceUnavailable: ``device`` has no device pool in the daemon.
        """
        request = prefetch_request(keys, pools.uuid_of(device))
        reply = self._conn.call(_unary(self._conn.stub.Prefetch, request))
        return prefetch_dict(reply)

    def stats(self) -> dict[str, Any]:
        """The daemon's stats document (counters as ints) and its open sessions.

        Returns:
            The document as nested dicts, with ``grpc_sessions`` added.

        """
        reply = self._conn.call(_unary(self._conn.stub.Stats, pb.StatsRequest()))
        return stats_dict(reply)

    def renew(self, lease_ids: Sequence[int], ttl_s: float | None = None) -> int:
        """Extend leases (a reader that needs its views longer than their TTL).

        Args:
            lease_ids: the ids of leases this client holds (``leased.lease_ids``).
            ttl_s: the new lifetime, from now; None: the daemon's default.

        Returns:
            How many leases were renewed; fewer than given means some had ended (their
            views may already show reused memory).

        Raises:
            InvalidArgument: a lifetime the daemon refuses.
        """
        request = renew_request(lease_ids, ttl_s)
        reply = self._conn.call(_unary(self._conn.stub.Renew, request), session=True)
        return int(reply.renewed)

    def get_bytes(self, key: str, offset: int = 0, length: int | None = None) -> EntryBytes | None:
        """An entry's bytes (works from any machine): on the session socket when the session
        runs on one (the bytes follow the result raw), else streamed over gRPC.

        Args:
            key: the entry's key.
            offset: the first byte to send.
            length: how many bytes (None: to the end).

        Returns:
            The dtype, shape and bytes (``.tensor()`` views them), or None if absent.

        Raises:
            InvalidArgument: the range lies outside the entry.
        """
        request = pb.GetBytesRequest(key=key, offset=offset)
        if length is not None:
            request.length = length

        def fetch(md: Any, to: float) -> EntryBytes:  # the gRPC stream's way
            collector = BytesCollector(key)
            for msg in self._conn.bytes_stream(request, timeout=to, metadata=md):
                collector.add(msg, length, offset)
            return collector.result()

        def take(out: pb.BytesOut, payload: bytearray | None) -> EntryBytes:  # a socket's
            data = payload if payload is not None else bytearray()
            if len(data) != out.payload_bytes:
                raise ValueError("get_bytes: fewer bytes than the result announced")
            return EntryBytes(key, out.meta.dtype, tuple(out.meta.shape), data)

        try:
            return self._conn.session_call("get_bytes", request, fetch, take)
        except EmbCacheError as exc:
            if getattr(exc, "grpc_status", None) == grpc.StatusCode.NOT_FOUND:
                return None
            raise


def _unary(method: Any, request: Any) -> CallFn[Any]:
    """The ``fn(metadata, timeout)`` of ``AsyncConnection.call`` for one unary RPC."""
    return lambda md, to: method(request, timeout=to, metadata=md)
