"""Puts of host bytes carried by a session: inline, or into pages the client fills itself.

A gRPC ``Put`` is a client stream, and on a same-node client that streaming call costs far
more than the bytes (docs/facts.md, "Where a call's time goes"). On a session the same puts
are one call each:

- ``put`` / ``put_batch``: header and bytes inline (small entries, at most 1 MiB of data per
  call: one message). Validation, quotas, the CRC32 check, idempotence and the error table
  are the gRPC Put's (``engine.begin_put``, then one write and the commit). A batch is all
  or nothing: every item is reserved, written and checked before any is committed.
- ``put_reserve`` -> the client writes -> ``put_commit`` (or ``put_abort``): large entries
  with one copy. The daemon reserves FILLING pages for the session and answers their byte
  runs; the client copies its tensor straight into them through a writable mapping of the
  host pool's segment, and the commit (checking a CRC32 when one is given) makes the entry
  READY. Only a peer with the daemon's uid is served these (:func:`may_write_segment`): such
  a process could open the segment for writing anyway, so the daemon grants nothing it could
  not take; the daemon never hands a writable descriptor to anyone. A reservation ends on
  its commit or abort, when its session ends (a crashed client or an operator's drop
  included), and after ``put_idle_timeout_s`` without its commit. Its pages go back at once
  only when the client said it is done writing them (its commit or its abort) or its process
  has exited; otherwise the client may still be copying, and they stay out of reuse until
  its process exits (``host/reservations.py``), counted against its in-flight quota.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from dataclasses import dataclass

from embcache.errors import InvalidArgument, NotFound, PermissionDenied
from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.service.engine import CacheEngine
from embcache.service.host.put_writer import PutHandle
from embcache.service.host.stash import StashedPut
from embcache.service.transport.session.registry import PeerCreds

log = logging.getLogger("embcache.session")

MAX_BATCH_ITEMS = 1024  # items of one put_batch (as PutFromDeviceBatch)
THREAD_CRC_BYTES = 16 << 20  # a commit's CRC32 over more than this runs off the loop


def crc_bytes(request: pb.StashCommitRequest) -> int:
    """The bytes a stash commit computes a CRC32 over when each of its puts has one."""
    return sum(run.length for item in request.items for run in item.runs)


def may_write_segment(peer: PeerCreds | None, daemon_uid: int) -> bool:
    """Whether a session's peer may write the host pool's pages itself: only a process the
    kernel says runs as the daemon's uid (``SO_PEERCRED``), which the segment's file mode
    lets open it for writing anyway. Unknown peers (gRPC) never may."""
    return peer is not None and peer.uid == daemon_uid


@dataclass(slots=True)
class _Reservation:
    handle: PutHandle
    timer: asyncio.TimerHandle | None


class SessionPuts:
    """The host puts of one session, and its open reservations (module docstring).

    ``quota_owner``: whose in-flight quota the reserved bytes count against; ``writable``:
    whether this session's peer may fill reserved pages itself; ``idle_s``: how long a
    reservation waits for its commit; ``writer``: the owner (the session) whose process the
    engine knows (``engine.quarantine.bind``), the one that fills reserved pages."""

    def __init__(
        self,
        engine: CacheEngine,
        host_pool: pb.PoolHandle,
        quota_owner: str,
        *,
        writable: bool,
        idle_s: float,
        writer: str | None = None,
    ) -> None:
        self.engine = engine
        self.host_pool = host_pool
        self.quota_owner = quota_owner
        self.writable = writable
        self.idle_s = idle_s
        self.writer = writer
        self._open: dict[int, _Reservation] = {}
        self._closed = False

    @property
    def reservations(self) -> int:
        """Reservations open now (their pages FILLING)."""
        return len(self._open)

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

    def _begin(self, head: pb.PutHeader, writer: tuple[str, int] | None = None) -> PutHandle:
        if self._closed:
            raise NotFound("the session has ended")
        return self.engine.begin_put(
            head.key,
            head.dtype,
            tuple(head.shape),
            nbytes=head.nbytes if head.HasField("nbytes") else None,
            checksum=head.checksum if head.HasField("checksum") else None,
            owner=self.quota_owner,
            writer=writer,
        )

    # -- reserved pages ----------------------------------------------------------------------
    def reserve(self, request: pb.PutReserveRequest) -> pb.PutReserveResponse:
        """Reserve FILLING pages for the session's client to fill; id 0: the entry exists
        with the same metadata (nothing to write)."""
        if not self.writable:
            raise PermissionDenied("only a peer with the daemon's uid may fill pages itself")
        head = pb.PutHeader()
        head.CopyFrom(request.header)
        head.ClearField("checksum")  # checked at the commit, over the pages
        rid = secrets.randbits(63) or 1
        while rid in self._open:
            rid = secrets.randbits(63) or 1
        handle = self._begin(head, writer=None if self.writer is None else (self.writer, rid))
        if handle.exists_already:
            return pb.PutReserveResponse(reservation_id=0, nbytes=handle.nbytes)
        timer = None
        if self.idle_s > 0:
            timer = asyncio.get_running_loop().call_later(self.idle_s, self._expire, rid)
        self._open[rid] = _Reservation(handle, timer)
        runs = [pb.ByteRun(offset=off, length=n) for off, n in handle.byte_runs]
        return pb.PutReserveResponse(
            reservation_id=rid, runs=runs, pool=self.host_pool, nbytes=handle.nbytes
        )

    async def commit(self, request: pb.PutCommitRequest) -> pb.PutResponse:
        """Make a filled reservation READY (its CRC32 checked over the pages when given);
        a bad checksum or any other failure frees its pages."""
        found = self._take(request.reservation_id)
        handle = found.handle
        checksum = request.checksum if request.HasField("checksum") else None
        with handle:  # any way out but the commit aborts: pages freed, nothing visible
            if checksum is not None and handle.nbytes > THREAD_CRC_BYTES:
                await asyncio.to_thread(handle.filled_in_place, checksum)
            else:
                handle.filled_in_place(checksum)
            created = handle.commit()
        return pb.PutResponse(created=created, nbytes=handle.nbytes)

    def abort(self, request: pb.PutAbortRequest) -> pb.PutAbortResponse:
        """Give a reservation's pages back (the client asks after its copy stopped: they
        are free at once); false when it had ended already. The pages of one that ended
        without the client (its session dropped, its idle timeout) and are held for it go
        back now too, when this session's process is the one that holds them."""
        found = self._open.pop(request.reservation_id, None)
        if found is None:
            if self.writer is not None and request.reservation_id:
                self.engine.writer_done(self.writer, request.reservation_id)
            return pb.PutAbortResponse(aborted=False)
        self._end(found, writer_stopped=True)
        return pb.PutAbortResponse(aborted=True)

    # -- stashes: pages filled ahead of the puts (host/stash.py) ---------------------------
    def stash_refill(self, request: pb.StashRefillRequest) -> pb.StashRefillResponse:
        """Hold at least ``nbytes`` of free pages for this session's process, as the stash
        its client knows by ``stash_id``: their byte runs."""
        writer = self._stash_writer(request.stash_id)
        runs = self.engine.stash.refill(self.quota_owner, writer, request.nbytes)
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

    def _take(self, rid: int) -> _Reservation:
        found = self._open.pop(rid, None)
        if found is None:
            raise NotFound(
                "no such put reservation (committed, aborted, timed out, or not this session's)",
                reservation_id=rid,
            )
        if found.timer is not None:
            found.timer.cancel()
        return found

    def _expire(self, rid: int) -> None:
        found = self._open.pop(rid, None)
        if found is not None:
            key = found.handle.key
            log.info("put reservation of %r idle for %.1f s: aborted", key, self.idle_s)
            self._end(found)

    @staticmethod
    def _end(found: _Reservation, *, writer_stopped: bool = False) -> None:
        if found.timer is not None:
            found.timer.cancel()
        found.handle.abort(writer_stopped=writer_stopped)

    def close(self) -> None:
        """The session ended: abort every reservation and refuse new puts. The pages of each
        go back once the client's process is gone (it may be copying still)."""
        self._closed = True
        open_now, self._open = self._open, {}
        for found in open_now.values():
            self._end(found)
