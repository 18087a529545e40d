"""Lease table: who holds which entry, until when, and how much each owner holds.

Ids are random 63-bit integers (from the OS's random source) so one client cannot guess
another's lease. Expiry uses a heap of ``(expires_at, lease_id)``; renewing pushes a new
item and stale items are skipped when popped, so every operation is O(log n).

Each owner's leases are counted, with the bytes of the distinct entries they hold (two
leases of one entry pin its pages once), so a get that would take an owner past its caps
(:class:`LeaseCaps`) is refused before anything is leased.
"""

from __future__ import annotations

import heapq
import os
from dataclasses import dataclass

import numpy as np

from embcache.errors import LeaseLimitExceeded
from embcache.service.host.allocator import page_byte_runs
from embcache.service.host.entries import Entry


@dataclass(slots=True, eq=False)
class Lease:
    """One hold on an entry: while it lives, the entry's pages are neither evicted nor
    reused. What transports describe to clients (its byte runs, metadata, id)."""

    lease_id: int
    entry: Entry
    owner: str
    expires_at: float
    page_bytes: int
    _byte_runs: tuple[tuple[int, int], ...] | None = None

    @property
    def byte_runs(self) -> tuple[tuple[int, int], ...]:
        """``(offset, length)`` in the host pool that hold the entry's bytes, in order."""
        if self._byte_runs is None:
            entry = self.entry
            self._byte_runs = tuple(page_byte_runs(entry.runs, self.page_bytes, entry.nbytes))
        return self._byte_runs

    @property
    def key(self) -> str:
        return self.entry.key

    @property
    def dtype(self) -> str:
        return self.entry.dtype.name

    @property
    def shape(self) -> tuple[int, ...]:
        return self.entry.shape

    @property
    def nbytes(self) -> int:
        return self.entry.nbytes

    @property
    def contiguous(self) -> bool:
        """True when the entry is one byte run (a client gets a view, not a gathered copy)."""
        return len(self.byte_runs) <= 1


@dataclass(frozen=True, slots=True)
class LeaseCaps:
    """The most leases, and bytes of distinct leased entries, one owner may hold."""

    leases: int
    nbytes: int


class RandomIds:
    """Unguessable 63-bit ids from the OS's random source (the table skips 0), read 512 at
    a time (one ``os.urandom`` call per id costs a system call; a batch get takes one id per
    key)."""

    BATCH = 512

    def __init__(self) -> None:
        self._ids: list[int] = []

    def next(self) -> int:
        """One id (may be 0 or taken: the table draws again)."""
        if not self._ids:
            raw = np.frombuffer(os.urandom(8 * self.BATCH), dtype=np.uint64) >> np.uint64(1)
            self._ids = raw.tolist()
        return self._ids.pop()


class LeaseTable:
    """Leases by id and by owner, and the expiry heap (module docstring). It does not
    touch the entries' reference counts: the host store does."""

    def __init__(self) -> None:
        self._ids = RandomIds()
        self._leases: dict[int, Lease] = {}
        self._by_owner: dict[str, set[int]] = {}
        self._held: dict[str, dict[Entry, int]] = {}  # owner -> entry -> its leases on it
        self._held_bytes: dict[str, int] = {}  # owner -> bytes of the distinct entries held
        self._heap: list[tuple[float, int]] = []

    def __len__(self) -> int:
        return len(self._leases)

    def get(self, lease_id: int) -> Lease | None:
        return self._leases.get(lease_id)

    def add(self, entry: Entry, owner: str, expires_at: float, page_bytes: int) -> Lease:
        """A new lease with a fresh unguessable id (never 0, never one in use)."""
        lease_id = self._ids.next()
        while lease_id == 0 or lease_id in self._leases:
            lease_id = self._ids.next()
        lease = Lease(lease_id, entry, owner, expires_at, page_bytes)
        self._leases[lease_id] = lease
        self._by_owner.setdefault(owner, set()).add(lease_id)
        held = self._held.setdefault(owner, {})
        if not held.get(entry):
            self._held_bytes[owner] = self._held_bytes.get(owner, 0) + entry.nbytes
        held[entry] = held.get(entry, 0) + 1
        heapq.heappush(self._heap, (expires_at, lease_id))
        return lease

    def pop(self, lease_id: int) -> Lease | None:
        """Forget a lease (None: unknown id); its stale heap item is skipped later."""
        lease = self._leases.pop(lease_id, None)
        if lease is not None:
            owner, entry = lease.owner, lease.entry
            ids = self._by_owner[owner]
            ids.discard(lease_id)
            if not ids:
                del self._by_owner[owner]
            held = self._held[owner]
            held[entry] -= 1
            if not held[entry]:
                del held[entry]
                self._held_bytes[owner] -= entry.nbytes
            if not held:
                del self._held[owner], self._held_bytes[owner]
        return lease

    def renew(self, lease: Lease, expires_at: float) -> None:
        """Move a lease's expiry (the old heap item goes stale)."""
        lease.expires_at = expires_at
        heapq.heappush(self._heap, (expires_at, lease.lease_id))

    def holders(self, entry: Entry, now: float) -> tuple[tuple[str, float], ...]:
        """(owner, seconds left) of every lease on ``entry``; O(leases), for operators."""
        if not entry.ref_cnt:
            return ()
        return tuple(
            (lease.owner, max(0.0, lease.expires_at - now))
            for lease in self._leases.values()
            if lease.entry is entry
        )

    def all_ids(self) -> list[int]:
        return list(self._leases)

    def owned_by(self, owner: str) -> list[int]:
        """Ids of ``owner``'s leases (a session that ended, say)."""
        return list(self._by_owner.get(owner, ()))

    def owners(self) -> int:
        """How many owners hold a lease."""
        return len(self._by_owner)

    def owners_named(self, prefixes: tuple[str, ...]) -> list[str]:
        """The owners holding leases whose names start with one of ``prefixes`` (callers
        without a session, say); O(owners)."""
        return [owner for owner in self._by_owner if owner.startswith(prefixes)]

    def usage(self, owner: str) -> tuple[int, int]:
        """``(leases, bytes of the distinct entries leased)`` of ``owner``."""
        return len(self._by_owner.get(owner, ())), self._held_bytes.get(owner, 0)

    def check_caps(self, owner: str, entries: list[Entry | None], caps: LeaseCaps) -> None:
        """LeaseLimitExceeded if leasing ``entries`` (None: a miss) would take ``owner``
        past ``caps``; nothing is changed either way."""
        found = [e for e in entries if e is not None]
        count, nbytes = self.usage(owner)
        if count + len(found) > caps.leases:
            raise LeaseLimitExceeded(
                "too many leases for one owner",
                owner=owner, leases=count, asked=len(found), limit=caps.leases,
            )  # fmt: skip
        held = self._held.get(owner, {})
        new = {id(e): e.nbytes for e in found if e not in held}
        if nbytes + sum(new.values()) > caps.nbytes:
            raise LeaseLimitExceeded(
                "too many leased bytes for one owner",
                owner=owner, leased_bytes=nbytes, asked_bytes=sum(new.values()),
                limit=caps.nbytes,
            )  # fmt: skip

    def pop_expired(self, now: float) -> list[Lease]:
        """Forget and return the leases whose expiry is ``now`` or earlier."""
        expired: list[Lease] = []
        heap = self._heap
        while heap and heap[0][0] <= now:
            expires_at, lease_id = heapq.heappop(heap)
            lease = self._leases.get(lease_id)
            if lease is not None and lease.expires_at == expires_at:
                expired.append(self.pop(lease_id))  # type: ignore[arg-type]
        if len(heap) > 64 and len(heap) > 4 * len(self._leases):
            # Renewals and releases leave stale items behind; rebuild now and then.
            self._heap = [(lease.expires_at, i) for i, lease in self._leases.items()]
            heapq.heapify(self._heap)
        return expired
