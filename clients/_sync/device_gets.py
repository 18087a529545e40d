# GENERATED from clients/_async/device_gets.py by scripts/unasync.py: do not edit.
# Change the asyncio source, then run `python scripts/unasync.py`.
"""Gets onto a GPU: out of the daemon's device pool on that GPU, opened in this process.

By default the entries are copied out of the pool into tensors the caller owns (a gather on
the device's current stream); ``zero_copy=True`` gives views of the pool itself. Where the
daemon has no pool on that GPU, or this process cannot open it, the GPU is served through
the host for a while (``core/capabilities.py``) and the caller takes the host path.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from embcache.clients._sync.connection import Connection
from embcache.clients._sync.device_calls import device_call, when_unavailable
from embcache.clients._sync.results import LeasedTensors
from embcache.clients._sync.state import ClientState
from embcache.clients._sync.table_gets import TableReads
from embcache.clients._sync.view_holds import ViewHolds
from embcache.clients.core.requests import device_get_request
from embcache.clients.device import device_replies, exports, into, pools
from embcache.errors import PoolExhausted
from embcache.proto.embcache.v1 import embcache_pb2 as pb


class DeviceGets:
    """A client's gets onto a GPU, and ``get_into`` a CUDA buffer."""

    def __init__(
        self, conn: Connection, state: ClientState, tables: TableReads, holds: ViewHolds
    ) -> None:
        self._conn = conn
        self._state = state
        self._tables = tables
        self._holds = holds

    def get(
        self, names: list[str], device: str | torch.device, ttl_s: float | None, zero_copy: bool
    ) -> LeasedTensors | None:
        """The entries on ``device``: copies out of the read table's pool with no call where
        it has them all, else a device Get; None: take the host path."""
        if not zero_copy and ttl_s is None:  # no call where the read table has them all
            copies = self._tables.to_cuda(names, pools.resolve_device(device)[0])
            if copies is not None:
                return LeasedTensors(copies, [], self._conn.release)
        return self._from_pool(names, device, ttl_s, zero_copy)

    def _from_pool(
        self, names: list[str], device: str | torch.device, ttl_s: float | None, zero_copy: bool
    ) -> LeasedTensors | None:
        """A device Get, decoded into copies (or views) out of the pool opened here; None
        where the GPU has no device path (remembered for a while: ``ClientState``)."""
        dev, uuid = pools.resolve_device(device)
        no_device = self._state.no_device
        if uuid in no_device:
            return None
        caps = self._state.caps
        request = device_get_request(names, uuid, ttl_s, ready_event=caps.ready_events)
        taken_at = time.monotonic()
        fallback = when_unavailable(lambda exc: no_device.add(uuid, exc))
        try:
            reply = device_call(self._conn, "get", request, self._conn.stub.Get, fallback)
        except PoolExhausted:
            # The pool may be full of this client's own views that are gone but whose
            # leases wait for the pump (it waits for their device work first): end them
            # now and ask once more.
            if not self._conn.views.pending() or not self._conn.release_gone():
                raise
            reply = device_call(self._conn, "get", request, self._conn.stub.Get, fallback)
        if reply is None:
            return None
        try:
            decoded = device_replies.decode_device_get(
                reply, self._state.device_pools, owned=not zero_copy
            )
        except BaseException as exc:
            self._conn.release([r.lease_id for r in reply.results if r.found])
            if isinstance(exc, device_replies.EventOpenError):  # ask again, without an event
                caps.events_failed(exc)
                return self._from_pool(names, device, ttl_s, zero_copy)
            if isinstance(exc, device_replies.PoolOpenError):
                no_device.add(uuid, exc)
                return None
            raise
        copied = decoded.ready  # owned copies: an event after them (None: views, or no GPU)
        expires = taken_at + self._holds.lease_lifetime(ttl_s)

        def release(lease_ids: list[int]) -> int:
            device_replies.wait_copied(copied, dev)  # nothing reads the pool's pages after
            return self._conn.release(lease_ids)

        def post(lease_ids: list[int]) -> bool:
            # Owned copies only: once they are complete, and while the leases surely lived
            # then, nothing needs the daemon's count: the release rides with the next call.
            assert copied is not None
            copied.synchronize()
            if time.monotonic() >= expires:
                return False
            self._holds.release_later(lease_ids)
            return True

        views, anchors = self._holds.hold(decoded, ttl_s, taken_at, dev)
        return LeasedTensors(
            decoded.tensors,
            decoded.lease_ids,
            release,
            views,
            anchors,
            post=post if copied is not None else None,
        )

    def get_into(
        self, names: list[str], out: torch.Tensor, offsets: Sequence[int] | None
    ) -> list[into.IntoResult] | None:
        """Copy the entries into the CUDA buffer ``out``: out of the read table's pool with
        no call, else by the daemon (``GetInto``); None: copy through the host."""
        results = self._tables.into_cuda(names, out, offsets)
        if results is not None:
            return results
        exported = exports.export_cuda(out, as_bytes=True)
        if exported is None:
            return None
        uuid = exported.message.gpu_uuid
        if uuid in self._state.no_device:
            exported.returned()  # never sent
            return None
        request = pb.GetIntoRequest(
            keys=names, destination=pb.DeviceBuffer(buffer=exported.message), offsets=offsets
        )
        fallback = when_unavailable(lambda exc: self._state.no_device.add(uuid, exc))
        rpc = self._conn.stub.GetInto
        reply = device_call(self._conn, "get_into", request, rpc, fallback)
        if reply is None:
            return None
        exported.returned()  # the daemon has copied: its event may be reused
        return into.into_results(reply)
