"""The leases of the host store's entries, and the holds kept after a forced end.

A part of :class:`~embcache.service.host.store.HostStore`, which owns it and calls it: a
lease is the reference a get's pin became; it ends when its owner releases it, or by force
(a TTL, the end of a session, an operator). While the owner's process may still read the
pages through views, a forced end moves the hold to the quarantine (``quarantine.py``),
recorded in the warm-restart index, until that process releases it or exits. No lock.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from embcache.service.host.entries import Entry
from embcache.service.host.leases import Lease, LeaseCaps, LeaseTable
from embcache.service.host.quarantine import Held, ProcessRef, Quarantine
from embcache.service.host.tables import Tables

SHARED_TIER_OWNER = "shared-tier"  # owner of the shared tier's own leases and fills


class LeaseBook:
    """Leases, quarantined holds and the processes of owners (module docstring)."""

    def __init__(self, tables: Tables, caps: LeaseCaps | None) -> None:
        self._t = tables
        self.caps = caps  # each owner's most leases and leased bytes (None: no bound)
        self.page_bytes = tables.page_bytes
        self.leases = LeaseTable()
        self.quarantine = Quarantine()  # holds of leases that ended by force (quarantine.py)
        self.processes: dict[str, ProcessRef] = {}  # owner -> its process, where known

    def pin(self, keys: Sequence[str], owner: str, now: float) -> list[Entry | None]:
        """Look ``keys`` up, count hits and misses, and take a reference on each entry
        found, so nothing evicts it; a pin becomes a lease (:meth:`lease`) or is undone
        (:meth:`unpin`)."""
        self.expire(now)
        counted = owner != SHARED_TIER_OWNER  # write-through reads are not client hits
        found = self._t.lookup
        out = [found(key) if isinstance(key, str) else None for key in keys]
        if counted and self.caps is not None:
            self.leases.check_caps(owner, out, self.caps)  # refused: nothing pinned
        for entry in out:
            if entry is None:
                self._t.counters["misses"] += counted
                continue
            self._t.counters["hits"] += counted
            self._t.counters["hit_bytes"] += entry.nbytes if counted else 0
            self._t.entries.acquire(entry)
            entry.last_access = now
        return out

    def unpin(self, entries: Iterable[Entry | None]) -> None:
        """Undo :meth:`pin` for entries that will not be leased (a failed placement)."""
        for entry in entries:
            if entry is not None:
                self._t.entries.release(entry)

    def lease(
        self, entries: Sequence[Entry | None], owner: str, expires_at: float
    ) -> list[Lease | None]:
        """One lease per pinned entry (the pin becomes the lease's reference)."""
        add, page = self.leases.add, self.page_bytes
        out = [None if e is None else add(e, owner, expires_at, page) for e in entries]
        process = self.processes.get(owner)
        if self._t.index is not None and process is not None:  # views may outlive this daemon
            with self._t.index.batch():
                for lease in out:
                    if lease is not None:
                        self._t.index.hold(lease.lease_id, process, lease.key)
        return out

    def end_lease(self, lease_id: int, owner: str | None = None) -> bool:
        """End one lease and drop its reference; False for an unknown or ended id, or one
        ``owner`` (when given) does not hold. An id that ended by force and was quarantined
        ends its hold now (the views are gone) when ``owner`` is of the same process."""
        lease = self.leases.get(lease_id)
        if lease is None:
            self._end_held(lease_id, owner)
            return False
        if owner is not None and lease.owner != owner:
            return False
        self.leases.pop(lease_id)
        self._t.entries.release(lease.entry)
        if self._t.index is not None:
            self._t.index.unhold(lease_id)
        return True

    def _end_held(self, lease_id: int, owner: str | None) -> None:
        """The client's views of a quarantined lease are gone: end its hold, if ``owner``
        (when given) is the process it was kept for (no other client may end it)."""
        held = self.quarantine.get(lease_id)
        if held is None or (owner is not None and self.processes.get(owner) != held.process):
            return
        self.quarantine.pop(lease_id)
        self._t.release_hold(held.entry)
        if self._t.index is not None:
            self._t.index.unhold(lease_id)

    def end_by_force(self, lease: Lease) -> None:
        """End a lease its owner did not release (a TTL, the end of its session, an
        operator): while the owner's process may still read the pages, its hold moves to
        the quarantine (quarantine.py), else it ends."""
        process = self.processes.get(lease.owner)
        if process is None:
            self._t.entries.release(lease.entry)
            return
        nbytes = lease.entry.num_pages * self.page_bytes
        self.quarantine.add(Held(lease.lease_id, lease.entry, process, nbytes))
        if self._t.index is not None:  # kept across a restart too, until the process exits
            self._t.index.hold(lease.lease_id, process, lease.key)
        self._t.counters["leases_quarantined"] += 1

    def end_owner(self, owner: str) -> int:
        """End every lease of ``owner`` by force and forget its process; returns how many."""
        ids = self.leases.owned_by(owner)
        for lease_id in ids:
            lease = self.leases.pop(lease_id)
            assert lease is not None, "owner's lease missing from the table"
            self.end_by_force(lease)
        self.processes.pop(owner, None)
        return len(ids)

    def free_quarantine(self, process: ProcessRef) -> int:
        """``process`` has exited: end every hold kept for it; returns how many."""
        held = self.quarantine.pop_process(process)
        for h in held:
            self._t.release_hold(h.entry)
            if self._t.index is not None:
                self._t.index.unhold(h.lease_id)
        return len(held)

    def release(self, lease_ids: Iterable[int], owner: str | None = None) -> int:
        """End these leases (unknown ids, and with ``owner`` others' ids, skipped); returns
        how many ended."""
        if self._t.index is None:
            return sum(self.end_lease(i, owner) for i in lease_ids)
        with self._t.index.batch():
            return sum(self.end_lease(i, owner) for i in lease_ids)

    def renew(self, lease_ids: Iterable[int], expires_at: float, owner: str | None = None) -> int:
        """Move the expiry of the live ones (with ``owner``: of its own only) to
        ``expires_at``; returns how many."""
        renewed = 0
        for lease_id in lease_ids:
            lease = self.leases.get(lease_id)
            if lease is not None and (owner is None or lease.owner == owner):
                self.leases.renew(lease, expires_at)
                renewed += 1
        return renewed

    def alive(self, lease: Lease, now: float) -> bool:
        """Whether ``lease`` is still held and not past its expiry (its pages are its own)."""
        return self.leases.get(lease.lease_id) is lease and lease.expires_at > now

    def expire(self, now: float) -> int:
        """End the leases whose TTL has passed; returns how many."""
        expired = self.leases.pop_expired(now)
        for lease in expired:
            self.end_by_force(lease)
        self._t.counters["leases_expired"] += len(expired)
        return len(expired)

    def clear(self) -> None:
        """The store is closing: end every lease and hold (the index was let go first)."""
        for lease_id in self.leases.all_ids():
            self.end_lease(lease_id)
        for held in self.quarantine.clear():
            self._t.release_hold(held.entry)
        self.processes.clear()
