"""The engine's quarantine calls (``engine.quarantine``): which process owns a session's
leases, the processes that have exited, and the bound on what one process may keep held.

A lease that ends by force while its owner's process may still read the pages keeps them
out of reuse (``service/host/quarantine.py``). The transports tell the engine which process
a session belongs to (the session socket's peer credentials); the daemon's reaper frees what
exited processes held. One process may keep at most ``max_quarantine_bytes_per_owner`` held
this way: past it, its new gets are refused with ``QuotaExceeded`` (``Gate.pin``) until its
old views are gone (the client releases them) or it exits, so the guarantee is never broken
and the pool is never pinned without bound. Works under the engine's gate (``gate.py``).
"""

from __future__ import annotations

from embcache.service.engine.gate import Gate
from embcache.service.host.quarantine import ProcessRef
from embcache.service.host.store import HostStore


class QuarantineSide:
    """The quarantine calls of the engine (module docstring)."""

    def __init__(self, store: HostStore, gate: Gate) -> None:
        self._store = store
        self._gate = gate  # the engine's lock; the bound on held bytes is checked there

    def bind(self, owner: str, pid: int) -> bool:
        """Tie ``owner``'s leases (a session) to the running process ``pid``, so a forced
        end of them keeps their pages out of reuse while it runs; False (nothing tied) when
        there is no such process here."""
        process = ProcessRef.of(pid)  # reads /proc: outside the lock
        if process is None:
            return False
        with self._gate:
            self._store.bind_process(owner, process)
        return True

    def end_owner(self, owner: str) -> int:
        """End every lease of ``owner`` by force, under the guarantee: those its process may
        still read are quarantined until it exits or releases them (an operator's drop of a
        session, the end of a session). Returns how many leases ended."""
        with self._gate:
            process = self._store.processes.get(owner)
        if process is not None and not process.alive():  # exited: nothing to keep
            with self._gate:
                self._store.bind_process(owner, None)
        with self._gate:
            return self._store.end_owner(owner)

    def reap(self) -> int:
        """Free what processes that have exited held, for their views and for their writes
        (the daemon's reaper calls this); returns how many holds ended."""
        with self._gate:
            processes = self._store.held_for()
        gone = [p for p in processes if not p.alive()]  # reads /proc: outside the lock
        if not gone:
            return 0
        with self._gate:
            store = self._store
            return sum(store.free_quarantine(p) + store.free_written(p) for p in gone)

    def held_for(self, pid: int) -> int:
        """Bytes held for the process ``pid`` now (for tests and operators)."""
        with self._gate:
            quarantine = self._store.quarantine
            return sum(quarantine.bytes_of(p) for p in quarantine.processes() if p.pid == pid)
