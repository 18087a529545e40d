"""Reads that wait for the puts committed before them by a posted message.

A same-node writer commits its stashed puts with a posted ``stash_commit`` (call id 0: no
result unless it fails) and its put returns once the message is written: the message then
lies in the daemon's socket queue, and is applied when the daemon's loop reads it. A read
that reaches the daemon after that put returned, from any client on any transport, must not
miss the entry. So a read that finds one of its keys missing first waits (:meth:`settle`)
until every connection that posts commits has handled all it had received or had queued in
the kernel at that moment: what any writer wrote before the read arrived is applied before
the read is answered. Reads of keys that are all held wait for nothing, and so does every
read while no connection has posted a commit. The stats wait as a read of every key does.

The wait is bounded (``wait_s``): a writer whose connection is held back (its results go
unread, or it has its bound of calls in flight) is not waited for past it, and not waited
for again until it has caught up, so a stalled writer delays one read, not every read.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Protocol

log = logging.getLogger("embcache.session")

WAIT_S = 0.5  # the longest a read waits for the commits posted before it
SPIN_TURNS = 64  # loop turns a read waits without sleeping


class PostingConnection(Protocol):
    """A connection whose client posts commits (``session_socket/connection.py``)."""

    def written(self) -> int:
        """Bytes its client has written so far: read by the daemon or queued in the kernel."""
        ...

    def handled_through(self, mark: int) -> bool:
        """Whether every whole message within the first ``mark`` bytes has been handled (or
        the connection is closed)."""
        ...


class PostedCommits:
    """The connections that post commits, and the wait of reads behind them."""

    def __init__(self, held: Callable[[Sequence[str]], bool], wait_s: float = WAIT_S) -> None:
        self._held = held  # whether the daemon holds every one of these keys
        self._wait_s = wait_s
        self._conns: dict[PostingConnection, None] = {}
        # Connections a read waited for to the bound: not waited for again until they have
        # handled all they were sent, so a writer that stalls delays one read, not each.
        self._stalled: set[PostingConnection] = set()
        self.waits = 0  # reads that waited (one loop turn or more)
        self.overdue = 0  # reads answered at the bound with a commit still unhandled

    def add(self, conn: PostingConnection) -> None:
        self._conns[conn] = None

    def discard(self, conn: PostingConnection) -> None:
        self._conns.pop(conn, None)
        self._stalled.discard(conn)

    async def settle(self, keys: Sequence[str] | None) -> None:
        """Return once the commits posted before now are applied, or at once when the
        daemon holds every one of ``keys`` (None: a read of the whole cache, its stats)."""
        if not self._conns or (keys is not None and self._held(keys)):
            return
        marks = [(conn, conn.written()) for conn in self._conns]
        pending = [(conn, mark) for conn, mark in marks if not conn.handled_through(mark)]
        self._stalled.intersection_update(conn for conn, _ in pending)  # caught up: waited for
        pending = [(conn, mark) for conn, mark in pending if conn not in self._stalled]
        if not pending:
            return
        self.waits += 1
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._wait_s
        turns = 0
        while pending:
            if loop.time() >= deadline:
                self.overdue += 1
                self._stalled.update(conn for conn, _ in pending)
                log.info("a read waited %.1f s for posted commits; answered without them",
                         self._wait_s)  # fmt: skip
                return
            # The loop reads the writers' sockets meanwhile; past the first turns, a writer
            # held back is looked at every millisecond rather than spun on.
            turns += 1
            await asyncio.sleep(0 if turns < SPIN_TURNS else 0.001)
            pending = [(conn, mark) for conn, mark in pending if not conn.handled_through(mark)]
