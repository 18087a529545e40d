"""This process's stashes: free pages of the daemon's host pool it fills ahead of its puts.

A same-node client of the daemon's uid writes each put straight into pages of the pool, then
commits them under the key (``stash_commit``): one call per put, or per ``put_many``, with
the bytes copied once and never sent. The pages come in batches (``stash_refill``), each a
*stash* the daemon holds for this process and counts against its in-flight put quota, so a
refill is one call for many puts. The daemon's side (``service/host/stash.py``) keeps the
pages out of reuse until this process gives them back or exits.

:class:`Stashes` is the bookkeeping only, with no I/O: which byte runs of which stash are
free, and the carving of a put's pages out of them. A put's pages come from one stash; they
leave it when carved, whatever the commit's outcome, as they leave the daemon's copy.
"""

from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass

REFILL_BYTES = 32 << 20  # a refill's size, unless a put needs more (then: what it needs)


@dataclass(frozen=True, slots=True)
class Carved:
    """A put's place in a stash: the stash, and the byte runs its bytes go to, in order."""

    stash_id: int
    runs: tuple[tuple[int, int], ...]  # (offset in the segment, bytes)


class Stashes:
    """The stashes of one connection (module docstring). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: dict[int, list[tuple[int, int]]] = {}  # stash id -> free whole-page runs
        self._busy: dict[int, int] = {}  # stash id -> its carves not yet committed or failed
        self.page_bytes = 0  # the pool's page size (0: no stash yet)
        self.pool_id = ""  # the pool they are pages of

    @staticmethod
    def new_id() -> int:
        """An id for the next stash, unique in this process (never 0)."""
        return secrets.randbits(63) or 1

    def add(
        self, stash_id: int, runs: list[tuple[int, int]], page_bytes: int, pool_id: str
    ) -> None:
        """A refill's pages (whole pages), as the daemon answered them."""
        with self._lock:
            if pool_id != self.pool_id:  # another pool (a restarted daemon): start over
                self._free.clear()
                self._busy.clear()
                self.pool_id = pool_id
            self.page_bytes = page_bytes
            self._free[stash_id] = sorted(runs)

    def free_bytes(self) -> int:
        """Bytes free in every stash together."""
        with self._lock:
            return sum(n for runs in self._free.values() for _, n in runs)

    def pages_bytes(self, sizes: list[int]) -> int:
        """The bytes of whole pages entries of ``sizes`` take (their sum where no page size
        is known yet)."""
        pb = self.page_bytes
        return sum(-(-n // pb) * pb for n in sizes) if pb else sum(sizes)

    def fitting(self, nbytes: int) -> int | None:
        """A stash with at least ``nbytes`` of whole pages free, if any."""
        with self._lock:
            for stash_id, free in self._free.items():
                if sum(n for _, n in free) >= nbytes:
                    return stash_id
            return None

    def carve(self, nbytes: int, stash_id: int) -> Carved | None:
        """Pages for a put of ``nbytes`` out of stash ``stash_id``, taken out of it; None
        when it has too few (or is gone)."""
        with self._lock:
            free = self._free.get(stash_id)
            if free is None or not self.page_bytes:
                return None
            need = -(-nbytes // self.page_bytes) * self.page_bytes
            if sum(n for _, n in free) < need:
                return None
            self._busy[stash_id] = self._busy.get(stash_id, 0) + 1
            return Carved(stash_id, tuple(_take(free, need, nbytes)))

    def settled(self, carved: list[Carved]) -> None:
        """These carves were committed, or failed: their stashes may be given back."""
        with self._lock:
            for place in carved:
                left = self._busy.get(place.stash_id, 0) - 1
                if left > 0:
                    self._busy[place.stash_id] = left
                else:
                    self._busy.pop(place.stash_id, None)

    def retire(self, below: int) -> list[int]:
        """Forget the stashes with fewer than ``below`` bytes free and no carve in flight;
        their ids, to give back (what is left of them would only sit idle: a put's pages
        come from one stash)."""
        with self._lock:
            out = [
                sid
                for sid, free in self._free.items()
                if sid not in self._busy and sum(n for _, n in free) < below
            ]
            for sid in out:
                del self._free[sid]
            return out

    def ids(self) -> list[int]:
        """Every stash id held now."""
        with self._lock:
            return list(self._free)

    def clear(self) -> list[int]:
        """Forget every stash (the connection closes, or its daemon went); their ids."""
        with self._lock:
            ids = list(self._free)
            self._free.clear()
            self._busy.clear()
            return ids


def _take(free: list[tuple[int, int]], need: int, nbytes: int) -> list[tuple[int, int]]:
    """Take ``need`` bytes of whole pages from the front of ``free`` (sorted runs), as the
    byte runs of an entry of ``nbytes``: the last run ends where the entry does."""
    runs: list[tuple[int, int]] = []
    left, used = nbytes, 0
    while used < need:
        offset, length = free[0]
        take = min(length, need - used)
        if take == length:
            free.pop(0)
        else:
            free[0] = (offset + take, length - take)
        used += take
        if left > 0:
            runs.append((offset, min(take, left)))
            left -= take
    return runs
