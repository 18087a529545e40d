"""Puts of host bytes carried by a session: inline, or written by the client into its stash.

A gRPC ``Put`` is a client stream, and on a same-node client that streaming call costs far
more than the bytes (docs/facts.md, "Where a call's time goes"). On a session the same puts
are one call each, or less:

- ``put`` / ``put_batch``: header and bytes inline (small entries, at most 1 MiB of data per
  call: one message). Validation, quotas, the CRC32 check, idempotence and the error table
  are the gRPC Put's (``engine.begin_put``, then one write and the commit). A batch is all
  or nothing: every item is reserved, written and checked before any is committed.
- ``stash_refill`` -> the client writes -> ``stash_commit``: the daemon holds free pages for
  the client's process (a stash, refilled in batches); the client copies each put straight
  into pages of it through a writable mapping of the host pool's segment, and the commit
  (checking a CRC32 when one is given) makes the entries READY, all or nothing
  (``engine/stash_path.py``, ``host/stash.py``). Only a peer with the daemon's uid is served
  these (:func:`may_write_segment`): such a process could open the segment for writing
  anyway, so the daemon grants nothing it could not take, and never hands a writable
  descriptor to anyone. ``put_abort`` with a stash's id gives back what is left of it; a
  stash outlives its session (the process may still be copying) and goes back when the
  process says so or exits.
"""

from __future__ import annotations

import logging

from embcache.errors import InvalidArgument, NotFound, PermissionDenied
from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.service.engine import CacheEngine
from embcache.service.host.put_writer import PutHandle
from embcache.service.host.stash import StashedPut
from embcache.service.transport.session.registry import PeerCreds

log = logging.getLogger("embcache.session")

MAX_BATCH_ITEMS = 1024  # items of one put_batch or stash_commit (as PutFromDeviceBatch)
THREAD_CRC_BYTES = 16 << 20  # a commit's CRC32 over more than this runs off the loop


def crc_bytes(request: pb.StashCommitRequest) -> int:
    """The bytes a stash commit computes a CRC32 over when each of its puts has one."""
    return sum(run.length for item in request.items for run in item.runs)


def may_write_segment(peer: PeerCreds | None, daemon_uid: int) -> bool:
    """Whether a session's peer may write the host pool's pages itself: only a process the
    kernel says runs as the daemon's uid (``SO_PEERCRED``), which the segment's file mode
    lets open it for writing anyway. Unknown peers (gRPC) never may."""
    return peer is not None and peer.uid == daemon_uid


class SessionPuts:
    """The host puts of one session (module docstring).

    ``quota_owner``: whose in-flight quota puts and stashes count against; ``writable``:
    whether this session's peer may fill pages itself; ``writer``: the owner (the session)
    whose process the engine knows (``engine.quarantine.bind``), the one that fills them."""

    def __init__(
        self,
        engine: CacheEngine,
        host_pool: pb.PoolHandle,
        quota_owner: str,
        *,
        writable: bool,
        writer: str | None = None,
    ) -> None:
        self.engine = engine
        self.host_pool = host_pool
        self.quota_owner = quota_owner
        self.writable = writable
        self.writer = writer
        self._closed = False

    # -- inline ----------------------------------------------------------------------------
    def put(self, request: pb.SessionPut) -> pb.PutResponse:
        """One inline put: begin, write, commit; any failure aborts (nothing left)."""
        handle = self._begin(request.header)
        with handle:
            handle.write(request.data)
            created = handle.commit()
        return pb.PutResponse(created=created, nbytes=handle.nbytes)

    def put_batch(self, request: pb.SessionPutBatch) -> pb.PutFromDeviceBatchResponse:
        """Inline puts, all or nothing: each reserved, written and checked before any is
        committed; on any failure every reservation is aborted."""
        items = request.items
        if len(items) > MAX_BATCH_ITEMS:
            raise InvalidArgument("too many items", items=len(items), limit=MAX_BATCH_ITEMS)
        keys = [item.header.key for item in items]
        if len(set(keys)) != len(keys):
            raise InvalidArgument("a put_batch takes distinct keys")
        handles: list[PutHandle] = []
        try:
            for item in items:
                handle = self._begin(item.header)
                handles.append(handle)
                handle.write(item.data)
                handle.verify()
            created = [h.commit() for h in handles]
        except BaseException:
            for handle in handles:
                handle.abort()  # no-op for the committed ones
            raise
        results = [
            pb.PutResponse(created=c, nbytes=h.nbytes)
            for c, h in zip(created, handles, strict=True)
        ]
        return pb.PutFromDeviceBatchResponse(results=results)

    def _begin(self, head: pb.PutHeader) -> PutHandle:
        if self._closed:
            raise NotFound("the session has ended")
        return self.engine.begin_put(
            head.key,
            head.dtype,
            tuple(head.shape),
            nbytes=head.nbytes if head.HasField("nbytes") else None,
            checksum=head.checksum if head.HasField("checksum") else None,
            owner=self.quota_owner,
        )

    # -- stashes: pages filled ahead of the puts (host/stash.py) ---------------------------
    def stash_refill(self, request: pb.StashRefillRequest) -> pb.StashRefillResponse:
        """Hold at least ``nbytes`` of free pages for this session's process, and up to
        ``extra_bytes`` more of those free now, as the stash its client knows by
        ``stash_id``: their byte runs."""
        writer = self._stash_writer(request.stash_id)
        if len(request.give_back) > MAX_BATCH_ITEMS:
            raise InvalidArgument(
                "too many stashes given back", given=len(request.give_back), limit=MAX_BATCH_ITEMS
            )
        stash = self.engine.stash
        for token in request.give_back:
            stash.give_back(writer[0], token)
        runs = stash.refill(self.quota_owner, writer, request.nbytes, request.extra_bytes)
        return pb.StashRefillResponse(
            runs=[pb.ByteRun(offset=off, length=n) for off, n in runs],
            pool=self.host_pool,
            page_bytes=self.engine.settings.page_bytes,
        )

    def stash_commit(self, request: pb.StashCommitRequest) -> pb.PutFromDeviceBatchResponse:
        """Make the puts the client wrote into its stash READY and visible, all or nothing."""
        writer = self._stash_writer(request.stash_id)
        items = request.items
        if len(items) > MAX_BATCH_ITEMS:
            raise InvalidArgument("too many items", items=len(items), limit=MAX_BATCH_ITEMS)
        if len({item.header.key for item in items}) != len(items):
            raise InvalidArgument("a stash_commit takes distinct keys")
        puts = [
            StashedPut(
                item.header.key, item.header.dtype, tuple(item.header.shape),
                tuple((run.offset, run.length) for run in item.runs),
                item.header.nbytes if item.header.HasField("nbytes") else None,
                item.header.checksum if item.header.HasField("checksum") else None,
            )
            for item in items
        ]  # fmt: skip
        created = self.engine.stash.commit(self.quota_owner, writer, puts)
        results = [
            pb.PutResponse(created=c, nbytes=sum(n for _, n in put.byte_runs))
            for c, put in zip(created, puts, strict=True)
        ]
        return pb.PutFromDeviceBatchResponse(results=results)

    def _stash_writer(self, stash_id: int) -> tuple[str, int]:
        if self._closed:
            raise NotFound("the session has ended")
        if not self.writable or self.writer is None:
            raise PermissionDenied("only a peer with the daemon's uid may fill pages itself")
        if not stash_id:
            raise InvalidArgument("stash_id must not be 0")
        return self.writer, stash_id

    def abort(self, request: pb.PutAbortRequest) -> pb.PutAbortResponse:
        """Give back what is left of the stash this session's process knows by the id (its
        client closes, or stops using it): free at once. False when it holds none by it."""
        given = False
        if self.writer is not None and request.reservation_id:
            given = self.engine.stash.give_back(self.writer, request.reservation_id)
        return pb.PutAbortResponse(aborted=given)

    def close(self) -> None:
        """The session ended: refuse new puts. Its process's stashes stay held until it
        gives them back or exits (it may be copying into them still)."""
        self._closed = True
