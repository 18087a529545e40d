"""The client's puts and gets: streamed or copied by the daemon from a GPU, and zero-copy
where the daemon's memory is mapped in this process.

A CUDA tensor is put by the daemon copying it from this GPU when it can open the memory;
anything else is streamed in CRC-checked chunks. A get on the daemon's node returns
copy-on-write views of its host pool, or with ``device=`` tensors on the GPU copied out of
its device pool (views of the pool with ``zero_copy=True``); elsewhere the bytes are
streamed. Where a path turns out not to work (another machine, no device pool, memory that
cannot be exported) the client remembers and takes the next one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar, overload

import torch

from embcache.clients._async.host_puts import AsyncHostPuts
from embcache.clients._async.results import AsyncLeasedTensors
from embcache.clients._backends.async_io import leased_call
from embcache.clients.core.errors import RpcFailed
from embcache.clients.core.replies import check_ended
from embcache.clients.core.requests import as_keys, device_get_request, get_request
from embcache.clients.core.session_calls import serves
from embcache.clients.device import device_replies, exports, into, pools
from embcache.clients.device import puts as dp
from embcache.clients.device.host_replies import (
    INLINE_GET_BYTES,
    INLINE_REMOTE_BYTES,
    Pinned,
    decode_get,
    leased_ids,
    pinned,
)
from embcache.errors import DeviceUnavailable, LeaseExpired
from embcache.proto.embcache.v1 import embcache_pb2 as pb

R = TypeVar("R")


class AsyncEmbCacheClient(AsyncHostPuts):
    """A client of one embcache daemon, for asyncio programs (docs/grpc.md).

    Made on the event loop that uses it. ``async with AsyncEmbCacheClient(target) as c:``
    closes it at the end; ``get`` is awaited, or used as ``async with c.get(keys) as ts:``.
    """

    # -- puts ------------------------------------------------------------------------------
    async def put(self, key: str, tensor: Any, *, checksum: bool = True) -> bool:
        """Store a tensor under ``key``.

        A CUDA tensor is copied by the daemon from this GPU (``PutFromDevice``; no checksum:
        the bytes never pass through this process) when the daemon can open its memory;
        anything else goes by the cheapest host path the daemon serves (``host_puts.py``:
        inline on the session, written into reserved pages, or streamed in 1 MiB chunks).
        Puts are idempotent: retried like reads.

        Args:
            key: the entry's key.
            tensor: a torch tensor (any device) or a numpy array.
            checksum: send the CRC32 of streamed bytes for the daemon to check.

        Returns:
            True if the entry was created, False if it existed (same dtype and shape).

        Raises:
            MetadataConflict: the key exists with another dtype or shape.
            InvalidArgument: a bad key, dtype or shape, or bytes that fail their checksum.
            PoolExhausted: no room even after eviction (also QuotaExceeded, EntryTooLarge).
            RpcFailed: the daemon could not be reached (after the retries) in time.
        """
        if self._caps.device_puts and dp.wants_device_put(tensor):
            created = await self._put_from_device(key, tensor)
            if created is not None:
                return created
        return await self._put_host(key, tensor, checksum)

    async def put_many(
        self, items: Mapping[str, Any] | Sequence[tuple[str, Any]], *, checksum: bool = True
    ) -> list[bool]:
        """Store several tensors: the CUDA ones in ``PutFromDeviceBatch`` calls (one wait
        per call; each call is all or nothing), small host ones in ``put_batch`` session
        calls (up to 1 MiB each, all or nothing), the rest one by one as :meth:`put` does.

        Args:
            items: a mapping of keys to tensors, or ``(key, tensor)`` pairs.
            checksum: as for :meth:`put`.

        Returns:
            Per item, in order, True if it was created.

        Raises:
            ValueError: a key that is not a string, or one given twice.
            MetadataConflict: as for :meth:`put` (and its other errors).
        """
        pairs = dp.as_pairs(items)
        out: list[bool | None] = [None] * len(pairs)
        cuda = [(i, k, t) for i, (k, t) in enumerate(pairs) if dp.wants_device_put(t)]
        if cuda and self._caps.device_puts and self._caps.batch_puts:
            for batch in dp.batches(cuda) or []:
                reply = await self._put_batch(batch)
                if reply is None:
                    break
                batch.returned(reply, out)
        for i, (k, t) in enumerate(pairs):  # CUDA tensors not batched: one device put each
            if out[i] is None and self._caps.device_puts and dp.wants_device_put(t):
                out[i] = await self.put(k, t, checksum=checksum)
        rest = [i for i, c in enumerate(out) if c is None]
        stored = await self._put_host_many([pairs[i] for i in rest], checksum)
        for i, created in zip(rest, stored, strict=True):
            out[i] = created
        return [bool(c) for c in out]

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

    # -- gets ------------------------------------------------------------------------------
    @leased_call
    async def get(
        self,
        keys: str | Sequence[str],
        device: str | torch.device | None = None,
        *,
        ttl_s: float | None = None,
        zero_copy: bool = False,
    ) -> AsyncLeasedTensors:
        """Tensors for ``keys`` (None for a miss), valid for as long as you hold them.

        On the daemon's node the tensors are copies this process owns, read straight out
        of the daemon's host pool with no call where its read table has them and checked
        afterwards against the table (docs/same_node_reads.md); entries larger than
        ``copy_gets_up_to``, and every entry with ``zero_copy=True``, are zero-copy views
        of the pool instead, each in a private copy-on-write mapping: writing into one
        (``x.mul_(2)``) changes only this tensor, never the cache (entries in several page
        runs are gathered copies). Elsewhere the bytes are streamed, small entries in the
        reply itself.
        With a CUDA ``device`` and a daemon with a device pool on that GPU, the tensors
        live on the GPU, copied out of the pool into memory you own (one gather on the
        device's current stream, which later work waits for); ``zero_copy=True`` gives
        views of the pool itself for entries in one run: no copy, but read-only by
        contract (a write would change the cache for every reader).
        Without such a pool they are copied there and the leases released at once.

        A view's lease ends once its block has ended (``with``, or ``release()``) *and* the
        last tensor over its bytes is gone; until then the client renews it before its TTL,
        so a tensor kept after its block keeps its bytes. Copies end their leases at the
        end of the block (device copies once the copy is complete).

        Args:
            keys: one key, or several.
            device: ``"cuda"``, ``"cuda:N"`` or a torch.device to get the tensors on a GPU;
                None or ``"cpu"`` for the host.
            ttl_s: the leases' lifetime between renewals (None: the daemon's default).
            zero_copy: views of the pool (the device pool's, with a CUDA ``device``) with
                a lease, instead of copies.

        Returns:
            The leased tensors, in the order of ``keys``; the asyncio client returns them
            from an awaitable that is also an async context manager.

        Raises:
            InvalidArgument: a bad key, or a lifetime the daemon refuses.
            RpcFailed: the daemon could not be reached (after the retries) in time, or the
                client is closed (code ``CANCELLED``).
        """
        names, _ = as_keys(keys)
        if device is not None and torch.device(device).type == "cuda":
            if not zero_copy and ttl_s is None:  # no call where the read table has them all
                copies = await self._table_to_cuda(names, pools.resolve_device(device)[0])
                if copies is not None:
                    return AsyncLeasedTensors(copies, [], self.release)
            leased = await self._get_device(names, device, ttl_s, zero_copy)
            if leased is not None:
                return leased
        if not zero_copy and ttl_s is None:
            # No call: read where the daemon wrote (a lifetime asked for is the daemon's to
            # check, so such a get is a call).
            copies = await self._table_copies(names)
            if copies is not None:
                return await self._placed(AsyncLeasedTensors(copies, [], self.release), device)
        if self._pool_local is False and not await self._inline_gets():
            tensors = [await self._fetch_tensor(k) for k in names]
            return await self._placed(AsyncLeasedTensors(tensors, [], self.release), device)
        taken_at = time.monotonic()
        # Copies on request; on another machine up to the most one reply carries.
        limit = INLINE_REMOTE_BYTES if self._pool_local is False else self._copy_gets_up_to
        limit = 0 if zero_copy and self._pool_local is not False else limit
        reply, payload = await self._host_get_call(get_request(names, ttl_s), limit)
        try:
            decoded = decode_get(reply, self._maps, payload=payload)
        except BaseException:
            await self.release(leased_ids(reply))
            raise
        if decoded.lease_ids:
            self._pool_local = not decoded.remote
        if decoded.remote:
            await self.release(decoded.lease_ids)
            for i in decoded.remote:
                decoded.tensors[i] = await self._fetch_tensor(names[i])
            decoded.lease_ids = []
            decoded.anchors = []
        views, anchors = self._hold_views(decoded, ttl_s, taken_at)
        # Copies made before the leases could have ended (the client's estimate runs from
        # before the call was sent) need no count from the daemon at release.
        fresh = time.monotonic() < taken_at + self._lease_lifetime(ttl_s)
        leased = AsyncLeasedTensors(
            decoded.tensors,
            decoded.lease_ids,
            self.release,
            views,
            anchors,
            post=self._release_later if fresh else None,
        )
        del decoded, anchors  # the leased tensors hold the views now: nothing else may
        return await self._placed(leased, device)

    async def pin(self, keys: Sequence[str], *, ttl_s: float | None = None) -> list[Pinned | None]:
        """Lease entries and learn each one's dtype and shape, without their bytes.

        One host ``Get`` whose locations are not mapped nor fetched: it works the same
        whether or not this process can map the daemon's pool. The leases keep the entries
        from eviction until :meth:`release` (``[p.lease_id for p in pins if p]``) or the
        end of their lifetime (``ttl_s``); they are not renewed by the client.

        Args:
            keys: the keys to pin.
            ttl_s: the leases' lifetime (None: the daemon's default).

        Returns:
            Per key, in order, a ``Pinned`` or None for a miss.

        Raises:
            InvalidArgument: a bad key, or a lifetime the daemon refuses.
            RpcFailed: the daemon could not be reached (after the retries) in time.
        """
        names, _ = as_keys(keys)
        return pinned(await self._get_call(get_request(names, ttl_s)))

    async def describe(self, keys: Sequence[str]) -> list[Pinned | None]:
        """Each entry's dtype, shape and size, without its bytes and without holding it.

        On the daemon's node this reads the daemon's read table with no call, when it lists
        every key; otherwise it is one ``pin`` whose leases end at once. Nothing keeps the
        entries from eviction afterwards: a later get may miss.

        Args:
            keys: the keys to describe.

        Returns:
            Per key, in order, a ``Pinned`` with ``lease_id`` 0, or None for a miss.

        Raises:
            InvalidArgument: a bad key.
            RpcFailed: the daemon could not be reached (after the retries) in time.
        """
        names, _ = as_keys(keys)
        table = await self._read_table()
        if table is not None:
            found = [table.locate(k) for k in names]
            if all(f is not None and table.unchanged(f) for f in found):
                return [
                    Pinned(k, f.dtype_name, f.shape, f.nbytes, 0)
                    for k, f in zip(names, found, strict=True)
                    if f is not None
                ]
        pins = pinned(await self._get_call(get_request(names, None)))
        ids = [p.lease_id for p in pins if p is not None]
        if ids:
            await self.release(ids)
        return [None if p is None else dataclasses.replace(p, lease_id=0) for p in pins]

    def describe_listed(self, keys: Sequence[str]) -> list[Pinned | None] | None:
        """What the daemon's read table lists of ``keys`` right now, with no call at all.

        Never waits on the daemon nor on another thread's call through this client, so a
        loop that must not stall (a scheduler) may ask it inline and ask the daemon, in the
        background, only about what it does not list. A table is read only once this client
        has a session open (after any call on the daemon's node); until then, and where no
        table can be read (another machine, a pool this process cannot map), this is None.
        Nothing is held: a listed entry may be evicted right after.

        Args:
            keys: the keys to look up.

        Returns:
            None where no table can be read now; else per key, in order, a ``Pinned`` with
            ``lease_id`` 0, or None where the table does not list the key (which says
            nothing of the daemon: it may hold the entry all the same).

        Raises:
            InvalidArgument: a bad key.
        """
        names, _ = as_keys(keys)
        table = self._table_now()
        if table is None:
            return None
        out: list[Pinned | None] = []
        for key in names:
            f = table.locate(key)
            listed = f is not None and table.unchanged(f)
            out.append(Pinned(key, f.dtype_name, f.shape, f.nbytes, 0) if listed and f else None)
        return out

    async def _get_device(
        self, names: list[str], device: str | torch.device, ttl_s: float | None, zero_copy: bool
    ) -> AsyncLeasedTensors | None:
        dev, uuid = pools.resolve_device(device)
        if uuid in self._no_device:
            return None
        request = device_get_request(names, uuid, ttl_s, ready_event=self._caps.ready_events)
        taken_at = time.monotonic()
        try:
            reply = await self._get_call(request)
        except DeviceUnavailable as exc:
            self._no_device.add(uuid, exc)
            return None
        try:
            decoded = device_replies.decode_device_get(
                reply, self._device_pools, owned=not zero_copy
            )
        except BaseException as exc:
            await self.release([r.lease_id for r in reply.results if r.found])
            if isinstance(exc, device_replies.EventOpenError):  # ask again, without an event
                self._caps.events_failed(exc)
                return await self._get_device(names, device, ttl_s, zero_copy)
            if isinstance(exc, device_replies.PoolOpenError):
                self._no_device.add(uuid, exc)
                return None
            raise
        copied = decoded.ready  # owned copies: an event after them (None: views, or no GPU)
        expires = taken_at + self._lease_lifetime(ttl_s)

        async def release(lease_ids: list[int]) -> int:
            device_replies.wait_copied(copied, dev)  # nothing reads the pool's pages after
            return await self.release(lease_ids)

        def post(lease_ids: list[int]) -> bool:
            # Owned copies only: once they are complete, and while the leases surely lived
            # then, nothing needs the daemon's count: the release rides with the next call.
            assert copied is not None
            copied.synchronize()
            if time.monotonic() >= expires:
                return False
            self._release_later(lease_ids)
            return True

        views, anchors = self._hold_views(decoded, ttl_s, taken_at, dev)
        return AsyncLeasedTensors(
            decoded.tensors,
            decoded.lease_ids,
            release,
            views,
            anchors,
            post=post if copied is not None else None,
        )

    async def _placed(
        self, leased: AsyncLeasedTensors, device: str | torch.device | None
    ) -> AsyncLeasedTensors:
        if device is None or torch.device(device).type == "cpu":
            return leased
        moved = await self._copied(leased, lambda ts: [_moved(t, device) for t in ts])
        return AsyncLeasedTensors(moved, [], self.release)

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
        """Copy entries into your memory; the copies are complete when this returns.

        Args:
            keys: the entries, in order.
            out: one contiguous tensor (on a CUDA buffer the daemon copies straight into
                it), or a list of tensors: one per key, of its dtype and element count.
            offsets: with one tensor, each entry's byte offset in it; None packs the entries
                back to back at 16-byte-aligned offsets.

        Returns:
            With one tensor, an ``IntoResult`` per key (found, dtype, shape, nbytes, offset;
            ``r.view(out)`` is the entry over the buffer); with a list, found flags.

        Raises:
            ValueError: ``out`` or ``offsets`` cannot hold the entries (not contiguous,
                overlapping or too small slots, a dtype or size that differs).
        """
        names, _ = as_keys(keys)
        if not isinstance(out, torch.Tensor):
            outs = out
            if outs and all(isinstance(t, torch.Tensor) and t.is_cuda for t in outs):
                found = await self._table_into_cuda(names, outs)
                if found is not None:
                    return found
            return await self._host_copy(names, lambda ts: into.copy_into(ts, outs))
        into.check_buffer(out, names, offsets)
        if out.device.type == "cuda" and out.numel():
            results = await self._table_into_cuda(names, out, offsets)
            if results is not None:
                return results
            results = await self._get_into_device(names, out, offsets)
            if results is not None:
                return results
        buffer = out
        return await self._host_copy(
            names, lambda ts: into.copy_into_buffer(names, ts, buffer, offsets)
        )

    async def _host_get_call(
        self, request: pb.GetRequest, limit: int
    ) -> tuple[pb.GetResponse, bytearray | None]:
        """A host Get in the session, and the raw bytes after its result: where the session
        socket serves it, entries of at most ``limit`` bytes come back as copies (no lease,
        no mapping), their bytes after the result; 0: none."""
        if not limit or not await self._inline_gets():
            return await self._get_call(request), None
        request.inline_max_bytes = limit

        def take(reply: pb.GetResponse, payload: bytearray | None) -> Any:
            return reply, payload

        async def rpc(md: Any, to: float) -> tuple[pb.GetResponse, None]:  # no copies follow
            return await self._stub.Get(request, timeout=to, metadata=md), None

        got: tuple[pb.GetResponse, bytearray | None] = await self._session_call(
            "get", request, rpc, take
        )
        return got

    async def _inline_gets(self) -> bool:
        """Whether this client's session serves host gets with inline copies."""
        return serves(await self._open_session(), "inline_get")

    async def _host_copy(self, names: list[str], copy: Callable[[list[Any]], R]) -> R:
        """``copy(tensors)`` of a host get whose entries are read straight from the shared
        mapping (no views to make: they are copied at once), then the leases end."""
        if self._pool_local is False:
            return await self._copied(await self.get(names), copy)
        copies = await self._table_copies(names)  # no call where the read table has them all
        if copies is not None:
            return copy(copies)
        # copied into the caller's memory anyway: small entries may come as copies
        reply, payload = await self._host_get_call(get_request(names, None), INLINE_GET_BYTES)
        ids = leased_ids(reply)
        try:
            decoded = decode_get(reply, self._maps, views=False, payload=payload)
            if decoded.remote:  # not mappable here: the leased get streams the bytes
                self._pool_local = False
                await self.release(ids)
                return await self._copied(await self.get(names), copy)
            self._pool_local = True if ids else self._pool_local
            result = copy(decoded.tensors)
        except BaseException:
            await self.release(ids)
            raise
        check_ended(await self.release(ids), ids)  # copied while the leases lived, or not
        return result

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
            reply = await self._session_call(
                "get_into",
                request,
                lambda md, to: self._stub.GetInto(request, timeout=to, metadata=md),
            )
        except DeviceUnavailable as exc:
            self._no_device.add(exported.message.gpu_uuid, exc)
            return None
        exported.returned()  # the daemon has copied: its event may be reused
        return into.into_results(reply)


def _moved(tensor: torch.Tensor | None, device: str | torch.device) -> torch.Tensor | None:
    """``tensor`` copied to ``device`` (a miss stays None)."""
    return None if tensor is None else tensor.to(device)
