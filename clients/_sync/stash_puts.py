# GENERATED from clients/_async/stash_puts.py by scripts/unasync.py: do not edit.
# Change the asyncio source, then run `python scripts/unasync.py`.
"""Puts written straight into this process's stashes of the host pool, one commit per call.

Where the daemon offers stashes (``SessionOpened.stash_puts``: the session socket, a peer of
its uid), a put of host bytes costs one copy and one small call: the bytes go into pages of
a stash through this process's writable mapping of the segment (``device/shm_write.py``),
and ``stash_commit`` makes the entries READY, all or nothing, before it answers. Pages come
in refills of many puts' worth (``device/stash.py``). Anything this path cannot do (no
stash offered, a pool this process cannot map for writing, a refill refused for room or
quota, a lost session, a daemon that restarted) answers None, having published nothing, and
the caller puts another way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

from embcache.clients._sync.connection import Connection
from embcache.clients._sync.state import ClientState
from embcache.clients.core.errors import from_call_error
from embcache.clients.core.payload import Payload
from embcache.clients.core.posted_puts import postable
from embcache.clients.core.session_calls import SessionLost, serves
from embcache.clients.device.shm_write import process_writable_maps
from embcache.clients.device.stash import REFILL_BYTES, Carved, Stashes
from embcache.errors import EmbCacheError, NotFound, PermissionDenied, PoolExhausted, QuotaExceeded
from embcache.proto.embcache.v1 import embcache_pb2 as pb

MIN_REFILL_BYTES = 1 << 20  # the first refill, before the pool's size is known
POOL_SHARE = 64  # a refill takes at most this fraction of the pool beyond what a put needs
MAX_UNSEEN = 4096  # keys posted before a put commits with a call again


class StashPuts:
    """The stashed puts of one client (module docstring)."""

    def __init__(self, conn: Connection, state: ClientState) -> None:
        self.stashes = Stashes()
        self._conn = conn
        self._state = state  # caps.writable_puts: False once the pool could not be mapped
        self._pool: pb.PoolHandle | None = None
        self._retired: list[int] = []  # stashes to give back with the next refill
        # Keys whose commits were posted since this client's last answered call: the read
        # table may not list them yet, so a put of one commits with a call, whose answer
        # (after the posted commits, on the same connection) says whether it was created.
        self._unseen: set[str] = set()

    def put(
        self,
        session: Any,
        items: Sequence[tuple[str, Payload]],
        checksum: bool,
        *,
        post: bool = False,
    ) -> list[bool] | None:
        """Store ``items`` (distinct keys) in one commit: per item, True if created. None,
        nothing published, when this path cannot serve them (module docstring). ``post``:
        the read table lists none of the keys, so the commit may be posted (``postable``).

        Raises:
            The commit's typed error (InvalidArgument, MetadataConflict, ChecksumMismatch,
            ...): none of the items is stored.
        """
        if not self._state.caps.writable_puts or not items or not serves(session, "stash_commit"):
            return None
        # Decided before a refill's call clears ``_unseen``: the table was read before it.
        post = post and not any(key in self._unseen for key, _ in items)
        try:
            carved = self._carve(session, [payload.nbytes for _, payload in items])
            if carved is None or self._pool is None:
                return None
            try:
                return self._write_and_commit(session, items, carved, checksum, post)
            finally:
                self.stashes.settled(carved)
        except SessionLost:
            # The session went: the stashes are this process's, not the session's, so the
            # next session of this client commits into them (a daemon that restarted
            # meanwhile answers NotFound then).
            return None
        except (NotFound, PermissionDenied):
            # The daemon restarted (the stashes are gone) or no longer knows this process.
            self.stashes.clear()
            return None

    def _write_and_commit(
        self,
        session: Any,
        items: Sequence[tuple[str, Payload]],
        carved: list[Carved],
        checksum: bool,
        post: bool,
    ) -> list[bool] | None:
        """Write each item into its carved pages, then commit them: posted where the
        daemon takes that and ``postable`` says so, else in a call."""
        assert self._pool is not None
        pool = process_writable_maps().get(self._pool)
        if pool is None:  # another /dev/shm, say: never again on this client
            self._state.caps.writable_puts = False
            self.stashes.settled(carved)
            self.give_back(session)
            return None
        puts = []
        for (key, payload), place in zip(items, carved, strict=True):
            runs = [pb.ByteRun(offset=off, length=n) for off, n in place.runs]
            crc = pool.write_runs(runs, payload.data, checksum=checksum)
            header = payload.header(key, checksum=False)
            if crc is not None:
                header.checksum = crc
            puts.append(pb.StashedPut(header=header, runs=runs))
        if post and self._may_post(session, items, carved):
            request = pb.StashCommitRequest(stash_id=carved[0].stash_id, items=puts)
            session.post(now=True, stash_commit=request)
            self._unseen.update(key for key, _ in items)
            return [True] * len(puts)
        return self._commit(session, carved, puts)

    def _may_post(
        self, session: Any, items: Sequence[tuple[str, Payload]], carved: list[Carved]
    ) -> bool:
        bounds = getattr(session, "posted_commits", None)
        if bounds is None or len(self._unseen) >= MAX_UNSEEN:
            return False  # past the bound: a call, whose answer clears ``_unseen``
        return postable(items, carved, bounds)

    def _carve(self, session: Any, sizes: list[int]) -> list[Carved] | None:
        """A place for each size, all in one stash (so that one commit takes them all),
        refilling when none has room; None when a refill is refused (no room, over the
        quota) even for just what is needed."""
        stash_id = self.stashes.fitting(self.stashes.pages_bytes(sizes))
        for _ in range(2):  # the first refill may be what tells the page size
            if stash_id is not None:
                break
            if not self._refill(session, self.stashes.pages_bytes(sizes)):
                return None
            stash_id = self.stashes.fitting(self.stashes.pages_bytes(sizes))
        if stash_id is None:
            return None
        carved = [self.stashes.carve(nbytes, stash_id) for nbytes in sizes]
        done = [place for place in carved if place is not None]
        if len(done) < len(carved):  # another thread took pages meanwhile: the other paths
            self.stashes.settled(done)
            return None
        return done

    def _refill(self, session: Any, need: int) -> bool:
        """A new stash of at least ``need`` bytes (more, up to a share of the pool, so
        that later puts need no refill); False when even ``need`` is refused. The stashes
        too small for ``need`` go back in the same call, so their leftovers are not held
        idle."""
        size = max(need, MIN_REFILL_BYTES)
        if self._pool is not None:
            size = max(need, min(REFILL_BYTES, self._pool.host_shm.size // POOL_SHARE))
        # ``need`` may evict entries; the spare pages come only from pages free now.
        for extra in (size - need, 0):
            self._retired.extend(self.stashes.retire(need))
            sid = Stashes.new_id()
            request = pb.StashRefillRequest(
                nbytes=max(need, 1), extra_bytes=extra, stash_id=sid, give_back=self._retired
            )
            try:
                reply = self._one(session, "stash_refill", request)
            except (QuotaExceeded, PoolExhausted):
                self._retired.clear()  # given back before the refill was refused
                continue
            self._retired.clear()
            self._pool = reply.pool
            runs = [(run.offset, run.length) for run in reply.runs]
            self.stashes.add(sid, runs, reply.page_bytes, reply.pool.pool_id)
            if (mapping := process_writable_maps().get(reply.pool)) is not None:
                mapping.prefault(runs)  # the next puts write these pages
            return True
        return False

    def _commit(self, session: Any, carved: list[Carved], puts: list[pb.StashedPut]) -> list[bool]:
        """One commit per stash the items were carved from (one, but for a refill taken
        half-way through a batch)."""
        out = [False] * len(puts)
        by_stash: dict[int, list[int]] = {}
        for i, place in enumerate(carved):
            by_stash.setdefault(place.stash_id, []).append(i)
        for sid, idx in by_stash.items():
            request = pb.StashCommitRequest(stash_id=sid, items=[puts[i] for i in idx])
            reply = self._one(session, "stash_commit", request)
            for i, result in zip(idx, reply.results, strict=True):
                out[i] = result.created
        return out

    def close(self) -> None:
        """The client closes: give its stashes back on its session, if one is open."""
        session = self._conn.session
        if session is not None and session.alive and (self.stashes.ids() or self._retired):
            self.give_back(session)

    def give_back(self, session: Any) -> None:
        """Give every stash back (this client closes, or stops using them): the daemon
        frees what is left of each at once. Best effort: the daemon frees them anyway once
        this process has exited."""
        retired, self._retired = [*self._retired, *self.stashes.clear()], []
        for sid in retired:
            self._give_back_one(session, sid)

    def _give_back_one(self, session: Any, sid: int) -> None:
        with contextlib.suppress(EmbCacheError, SessionLost):
            self._one(session, "put_abort", pb.PutAbortRequest(reservation_id=sid))

    def _one(self, session: Any, kind: str, request: Any) -> Any:
        """One call on ``session``: its reply, or its typed error raised."""
        result = session.call(self._conn.timeout, **{kind: request})
        self._unseen.clear()  # answered after every commit this client posted before
        if result.WhichOneof("outcome") == kind:
            return getattr(result, kind)
        raise from_call_error(result.error)
