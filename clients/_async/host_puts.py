"""Puts of host tensors: into this process's stash where the daemon offers one, else on
the session, else streamed.

A gRPC ``Put`` is a client-streaming call, which on the same node costs many times the
bytes it carries (docs/facts.md). Where the session runs on the daemon's session socket:

- with ``SessionOpened.stash_puts`` (a process of the daemon's uid), every entry is written
  once, straight into pages of a stash the daemon holds for this process, through a
  writable mapping of the host pool, and committed with its CRC32 in one call; ``put_many``
  commits up to ``BATCH_ITEMS`` entries per call, all or nothing (``stash_puts.py``);
- otherwise (``SessionOpened.host_puts``) an entry of at most ``INLINE_PUT_BYTES`` goes
  inline, header and bytes in one session call (``put``); ``put_many`` packs such entries
  into ``put_batch`` calls of at most that many bytes each (all or nothing).

Anything else (an older daemon, a gRPC session, a larger entry without a stash) streams the
bytes in 1 MiB chunks. Every path is idempotent and retried.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from embcache.clients._async.connection import AsyncConnection
from embcache.clients._async.stash_puts import AsyncStashPuts
from embcache.clients._async.state import ClientState
from embcache.clients._async.table_gets import AsyncTableReads
from embcache.clients.core.payload import Payload, payload_of
from embcache.clients.core.session_calls import serves
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

    def __init__(self, conn: AsyncConnection, state: ClientState, tables: AsyncTableReads) -> None:
        self._conn = conn
        self._state = state
        self._tables = tables
        self._stash = AsyncStashPuts(conn, state)

    async def close(self) -> None:
        """Give this client's stashes back (the client closes)."""
        await self._stash.close()

    async def put_host(self, key: str, tensor: Any, checksum: bool) -> bool:
        """Store a host tensor (or a CUDA one the daemon could not read) by the cheapest
        path the daemon serves; True if created."""
        payload = payload_of(tensor)
        session = await self._conn.open_session()
        listed = self._listed([(key, payload)])
        if listed == [True]:
            return False  # stored already, with this dtype and shape
        if payload.nbytes:
            post = listed == [None]
            stashed = await self._stash.put(session, [(key, payload)], checksum, post=post)
            if stashed is not None:
                return stashed[0]
        if payload.nbytes <= INLINE_PUT_BYTES and serves(session, "put"):
            inline = InlinePuts([(payload.header(key, checksum=checksum), payload.data)], False)
            reply = await self._conn.session_call(
                "put", inline, self._streamed(key, payload, checksum)
            )
            return bool(reply.created)
        reply = await self._conn.call(self._streamed(key, payload, checksum), session=True)
        return bool(reply.created)

    def _streamed(self, key: str, payload: Payload, checksum: bool) -> Any:
        """The gRPC Put stream of ``payload``, as a ``fn(metadata, timeout)`` for ``call``
        in the session (the daemon counts its in-flight bytes against this client)."""

        async def send(md: Any, to: float) -> pb.PutResponse:
            messages = payload.messages(key, checksum=checksum)
            return await self._conn.put_stream(messages, timeout=to, metadata=md)

        return send

    async def put_host_many(self, pairs: Sequence[tuple[str, Any]], checksum: bool) -> list[bool]:
        """Store host tensors: the small ones in ``put_batch`` calls when served, the others
        one by one (:meth:`put_host`). Per item, in order, True if created."""
        if not pairs:
            return []
        session = await self._conn.open_session()
        stashed = await self._put_stashed_many(session, pairs, checksum)
        if stashed is not None:
            return stashed
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

    async def _put_stashed_many(
        self, session: Any, pairs: Sequence[tuple[str, Any]], checksum: bool
    ) -> list[bool] | None:
        """Every pair through the stash, in commits of at most ``BATCH_ITEMS`` (each all or
        nothing); None, nothing stored, where that path does not serve them (repeated keys
        or empty entries too: they take the other paths)."""
        items = [(key, payload_of(tensor)) for key, tensor in pairs]
        if len({key for key, _ in items}) != len(items) or not all(p.nbytes for _, p in items):
            return None
        listed = self._listed(items)
        new = [i for i, known in enumerate(listed) if known is not True]
        out = [False] * len(items)
        for at in range(0, len(new), BATCH_ITEMS):
            some = new[at : at + BATCH_ITEMS]
            post = all(listed[i] is None for i in some)
            done = await self._stash.put(session, [items[i] for i in some], checksum, post=post)
            if done is None:  # not served (from here on): the rest the other ways
                if not at:
                    return None
                rest = await self.put_host_many([pairs[i] for i in new[at:]], checksum)
                done, some = rest, new[at:]
            for i, created in zip(some, done, strict=True):
                out[i] = created
        return out

    def _listed(self, items: Sequence[tuple[str, Payload]]) -> list[bool | None]:
        """Per item, what the read table says of its key: True, listed with the same dtype
        and shape (stored already: nothing is written and no call made); False, listed
        otherwise (the daemon's to refuse, in a call); None, not listed (a commit may be
        posted). All False where no table can be read."""
        table = self._tables.table_now(lookups=True)
        if table is None:
            return [False] * len(items)
        out: list[bool | None] = []
        for key, payload in items:
            found = table.locate(key)
            out.append(
                None
                if found is None
                else found.dtype_name == payload.dtype and found.shape == payload.shape
            )
        return out

    async def _put_batch_call(
        self, batch: list[tuple[int, tuple[pb.PutHeader, memoryview]]], out: list[bool | None]
    ) -> None:
        request = InlinePuts([item for _, item in batch], True)

        async def one_by_one(md: Any, to: float) -> pb.PutFromDeviceBatchResponse:
            return pb.PutFromDeviceBatchResponse()  # not served after all: left to put()

        reply = await self._conn.session_call("put_batch", request, one_by_one)
        for (i, _), res in zip(batch, reply.results, strict=False):
            out[i] = res.created
