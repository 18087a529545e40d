"""Puts of host tensors: on the session where the daemon serves them there, else streamed.

A gRPC ``Put`` is a client-streaming call, which on the same node costs many times the
bytes it carries (docs/facts.md). Where the session runs on the daemon's session socket and
the daemon says so (``SessionOpened.host_puts`` / ``writable_puts``):

- an entry of at most ``INLINE_PUT_BYTES`` goes inline, header and bytes in one session
  call (``put``); ``put_many`` packs such entries into ``put_batch`` calls of at most that
  many bytes each (one round trip per batch, all or nothing);
- a larger one is written once, straight into pages the daemon reserved for this session
  (``put_reserve``), through a writable mapping of the host pool (``device/shm_write.py``;
  only served to a process of the daemon's uid), then committed with its CRC32
  (``put_commit``; ``put_abort`` if the copy fails). A reservation that ended without this
  process (a lost session, an idle timeout) keeps its pages out of reuse while this process
  may write them; a ``put_abort`` of its id, once the copy stopped, gives them back.

Anything else (an older daemon, a gRPC session, a pool this process cannot map for
writing) streams the bytes in 1 MiB chunks, as before. Every path is idempotent and retried.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

from embcache.clients._async.connection import AsyncConnection
from embcache.clients._async.state import ClientState
from embcache.clients.core.errors import from_call_error
from embcache.clients.core.payload import Payload, payload_of
from embcache.clients.core.session_calls import SessionLost, serves
from embcache.clients.device.shm_write import process_writable_maps
from embcache.errors import EmbCacheError, NotFound, PermissionDenied
from embcache.proto.constants import CHUNK_BYTES
from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.proto.framing import InlinePuts

# Entries up to this size travel inline in one session call (and a put_batch carries at most
# this many bytes): one message holds them with their headers (the limit is 1 MiB + 128 KiB),
# and below it a copy into the message costs less than the extra round trip of a reservation.
INLINE_PUT_BYTES = CHUNK_BYTES
BATCH_ITEMS = 1024  # items per put_batch (the daemon's bound)


class AsyncHostPuts:
    """A client's puts of host tensors (module docstring)."""

    def __init__(self, conn: AsyncConnection, state: ClientState) -> None:
        self._conn = conn
        self._state = state

    async def put_host(self, key: str, tensor: Any, checksum: bool) -> bool:
        """Store a host tensor (or a CUDA one the daemon could not read) by the cheapest
        path the daemon serves; True if created."""
        payload = payload_of(tensor)
        session = await self._conn.open_session()
        if payload.nbytes <= INLINE_PUT_BYTES and serves(session, "put"):
            inline = InlinePuts([(payload.header(key, checksum=checksum), payload.data)], False)
            reply = await self._conn.session_call(
                "put", inline, self._streamed(key, payload, checksum)
            )
            return bool(reply.created)
        if self._state.caps.writable_puts and serves(session, "put_reserve"):
            created = await self._put_reserved(key, payload, checksum)
            if created is not None:
                return created
        reply = await self._conn.call(self._streamed(key, payload, checksum), session=True)
        return bool(reply.created)

    def _streamed(self, key: str, payload: Payload, checksum: bool) -> Any:
        """The gRPC Put stream of ``payload``, as a ``fn(metadata, timeout)`` for ``call``
        in the session (the daemon counts its in-flight bytes against this client)."""

        async def send(md: Any, to: float) -> pb.PutResponse:
            messages = payload.messages(key, checksum=checksum)
            return await self._conn.put_stream(messages, timeout=to, metadata=md)

        return send

    async def _put_reserved(self, key: str, payload: Payload, checksum: bool) -> bool | None:
        """Reserve pages, copy the bytes into them, commit; None: this process cannot write
        the pool (the client streams from now on). A session lost on the way takes its
        reservation with it: the put starts again on a new session."""
        attempt = 0
        ended: list[int] = []  # reservations whose session was lost after this process wrote
        while True:
            session = await self._conn.open_session()
            if not serves(session, "put_reserve"):
                return None
            await self._done_with(session, ended)
            try:
                return await self._fill_reserved(session, key, payload, checksum, ended)
            except PermissionDenied:
                self._state.caps.writable_puts = False
                return None
            except SessionLost:
                if attempt >= self._conn.retries:
                    raise
                attempt += 1

    async def _fill_reserved(
        self, session: Any, key: str, payload: Payload, checksum: bool, ended: list[int]
    ) -> bool | None:
        header = payload.header(key, checksum=False)
        reserved = await self._one(session, "put_reserve", pb.PutReserveRequest(header=header))
        rid = reserved.reservation_id
        if rid == 0:
            return False  # stored already with this dtype and shape
        pool = process_writable_maps().get(reserved.pool)
        if pool is None:  # another /dev/shm, say: stream from now on
            self._state.caps.writable_puts = False
            await self._one(session, "put_abort", pb.PutAbortRequest(reservation_id=rid))
            return None
        ended.append(rid)  # until the daemon hears that this process stopped writing
        try:
            crc = pool.write_runs(reserved.runs, payload.data, checksum=checksum)
        except BaseException:
            await self._one(session, "put_abort", pb.PutAbortRequest(reservation_id=rid))
            ended.remove(rid)
            raise
        commit = pb.PutCommitRequest(reservation_id=rid)
        if crc is not None:
            commit.checksum = crc
        try:
            reply = await self._one(session, "put_commit", commit)
        except NotFound:  # it ended meanwhile (idle too long): its pages wait for our word
            await self._done_with(session, ended)
            raise
        ended.remove(rid)
        return bool(reply.created)

    async def _done_with(self, session: Any, ended: list[int]) -> None:
        """Tell the daemon this process stopped writing the pages of reservations that
        ended without it (a lost session, an idle timeout): it keeps such pages out of
        reuse until then, or until this process exits. Best effort."""
        while ended:
            rid = ended.pop()
            with contextlib.suppress(EmbCacheError, SessionLost):
                await self._one(session, "put_abort", pb.PutAbortRequest(reservation_id=rid))

    async def _one(self, session: Any, kind: str, request: Any) -> Any:
        """One call on ``session``: its reply, or its typed error raised."""
        result = await session.call(self._conn.timeout, **{kind: request})
        if result.WhichOneof("outcome") == kind:
            return getattr(result, kind)
        raise from_call_error(result.error)

    async def put_host_many(self, pairs: Sequence[tuple[str, Any]], checksum: bool) -> list[bool]:
        """Store host tensors: the small ones in ``put_batch`` calls when served, the others
        one by one (:meth:`put_host`). Per item, in order, True if created."""
        if not pairs:
            return []
        session = await self._conn.open_session()
        if not serves(session, "put_batch"):
            return [await self.put_host(k, t, checksum) for k, t in pairs]
        out: list[bool | None] = [None] * len(pairs)
        batch: list[tuple[int, tuple[pb.PutHeader, memoryview]]] = []
        size = 0
        for i, (key, tensor) in enumerate(pairs):
            payload = payload_of(tensor)
            if payload.nbytes > INLINE_PUT_BYTES:
                continue
            if batch and (size + payload.nbytes > INLINE_PUT_BYTES or len(batch) >= BATCH_ITEMS):
                await self._put_batch_call(batch, out)
                batch, size = [], 0
            batch.append((i, (payload.header(key, checksum=checksum), payload.data)))
            size += payload.nbytes
        if batch:
            await self._put_batch_call(batch, out)
        return [
            bool(c) if c is not None else await self.put_host(k, t, checksum)
            for (k, t), c in zip(pairs, out, strict=True)
        ]

    async def _put_batch_call(
        self, batch: list[tuple[int, tuple[pb.PutHeader, memoryview]]], out: list[bool | None]
    ) -> None:
        request = InlinePuts([item for _, item in batch], True)

        async def one_by_one(md: Any, to: float) -> pb.PutFromDeviceBatchResponse:
            return pb.PutFromDeviceBatchResponse()  # not served after all: left to put()

        reply = await self._conn.session_call("put_batch", request, one_by_one)
        for (i, _), res in zip(batch, reply.results, strict=False):
            out[i] = res.created
