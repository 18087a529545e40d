# GENERATED from clients/_async/client.py by scripts/unasync.py: do not edit.
# Change the asyncio source, then run `python scripts/unasync.py`.
"""The client's puts and gets: streamed or copied by the daemon from a GPU, and zero-copy
where the daemon's memory is mapped in this process.

A CUDA tensor is put by the daemon copying it from this GPU when it can open the memory;
anything else is streamed in CRC-checked chunks. A get on the daemon's node returns views
of its host pool, or of a GPU's device pool with ``device=``; elsewhere the bytes are
streamed. Where a path turns out not to work (another machine, no device pool, memory that
cannot be exported) the client remembers and takes the next one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, overload

import torch

from embcache.clients._backends.sync_io import leased_call
from embcache.clients._sync.results import LeasedTensors
from embcache.clients._sync.stateless_calls import StatelessCalls
from embcache.clients.core.errors import RpcFailed
from embcache.clients.core.payload import payload_of
from embcache.clients.core.requests import as_keys, device_get_request, get_request
from embcache.clients.device import device_replies, exports, into, pools
from embcache.clients.device import puts as dp
from embcache.clients.device.host_replies import decode_get
from embcache.errors import DeviceUnavailable
from embcache.proto.embcache.v1 import embcache_pb2 as pb


class EmbCacheClient(StatelessCalls):
    """A client of one embcache daemon, for asyncio programs (docs/grpc.md).

    Made on the event loop that uses it. ``async with AsyncEmbCacheClient(target) as c:``
    closes it at the end; ``get`` is awaited, or used as ``async with c.get(keys) as ts:``.
    """

    # -- puts ------------------------------------------------------------------------------
    def put(self, key: str, tensor: Any, *, checksum: bool = True) -> bool:
        """Store a tensor under ``key``.

        A CUDA tensor is copied by the daemon from this GPU (``PutFromDevice``; no checksum:
        the bytes never pass through this process) when the daemon can open its memory;
        anything else is streamed in 1 MiB chunks. Puts are idempotent: retried like reads.

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
            created = self._put_from_device(key, tensor)
            if created is not None:
                return created
        payload = payload_of(tensor)

        def send(md: Any, to: float) -> pb.PutResponse:
            messages = payload.messages(key, checksum=checksum)
            return self._put(messages, timeout=to, metadata=md)

        # In the session: the daemon counts the put's in-flight bytes against this client.
        reply = self._call(send, session=True)
        return bool(reply.created)

    def put_many(
        self, items: Mapping[str, Any] | Sequence[tuple[str, Any]], *, checksum: bool = True
    ) -> list[bool]:
        """Store several tensors: the CUDA ones in ``PutFromDeviceBatch`` calls (one wait
        per call; each call is all or nothing), the rest one by one as :meth:`put` does.

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

    # -- gets ------------------------------------------------------------------------------
    @leased_call
    def get(
        self,
        keys: str | Sequence[str],
        device: str | torch.device | None = None,
        *,
        ttl_s: float | None = None,
    ) -> LeasedTensors:
        """Tensors for ``keys`` (None for a miss), leased until released.

        On the daemon's node the tensors are read-only views of its shared memory (entries
        in several page runs are gathered copies); elsewhere the bytes are streamed. With a
        CUDA ``device`` and a daemon with a device pool on that GPU, the tensors live on the
        GPU: views of the daemon's device pool (contiguous entries; valid while leased) or
        gathered copies the caller owns, ready for work queued on the device's current
        stream. Without such a pool they are copied there and the leases released at once.

        Args:
            keys: one key, or several.
            device: ``"cuda"``, ``"cuda:N"`` or a torch.device to get the tensors on a GPU;
                None or ``"cpu"`` for the host.
            ttl_s: the leases' lifetime (None: the daemon's default).

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
            leased = self._get_device(names, device, ttl_s)
            if leased is not None:
                return leased
        if self._pool_local is False:
            tensors = [self._fetch_tensor(k) for k in names]
            return self._placed(LeasedTensors(tensors, [], self.release), device)
        reply = self._get_call(get_request(names, ttl_s))
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
        leased = LeasedTensors(decoded.tensors, decoded.lease_ids, self.release)
        return self._placed(leased, device)

    def _get_device(
        self, names: list[str], device: str | torch.device, ttl_s: float | None
    ) -> LeasedTensors | None:
        dev, uuid = pools.resolve_device(device)
        if uuid in self._no_device:
            return None
        request = device_get_request(names, uuid, ttl_s, ready_event=self._caps.ready_events)
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
