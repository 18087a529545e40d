"""The engine's one lock, with what every call checks while it holds it.

The engine owns one :class:`Gate` and hands it to the parts that work on its host store and
device tier (``DeviceSide``, ``PutPath``, ``QuarantineSide``, ``Verifier``): they take the
lock with ``with gate:``, and under it ask it whether the engine is still open and to pin
keys for a get (open, the owner's process within its quarantine share, expired leases
ended first). The gate holds no reference to the engine, so none of those parts can call
back up into it. The lock is plain (not re-entrant): a call takes it for its bookkeeping
and lets go before it waits for a copy or the network.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from embcache.errors import Draining, QuotaExceeded
from embcache.service.config import Settings
from embcache.service.host import admission
from embcache.service.host.entries import Entry
from embcache.service.host.store import HostStore


class Gate:
    """The lock and the open/draining state of one engine (module docstring).

    ``store``: the engine's host store, which the gate pins entries in; ``clock``: the time
    leases expire by; ``quarantine_limit``: the bytes one process may keep held by views of
    leases that ended by force before its new gets are refused.
    """

    def __init__(
        self,
        store: HostStore,
        settings: Settings,
        clock: Callable[[], float],
        quarantine_limit: int,
    ) -> None:
        self._lock = threading.Lock()
        self._store = store
        self._settings = settings
        self.clock = clock
        self.quarantine_limit = quarantine_limit
        self.closed = False  # set under the lock; read without it where a stale read is safe
        self.draining = False

    def __enter__(self) -> Gate:
        self._lock.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

    def check_open(self) -> None:
        """Caller holds the gate: Draining once the engine drains or has closed."""
        if self.closed:
            raise Draining("engine is closed")
        if self.draining:
            raise Draining("daemon is draining")

    def expiry(self, ttl_s: float | None) -> float:
        """A request's lease TTL, checked (the settings' default when None)."""
        return admission.check_ttl(ttl_s, self._settings)

    def pin(self, keys: Sequence[str], owner: str) -> list[Entry | None]:
        """Caller holds the gate: pin each key found (``HostStore.pin``) for a get of
        ``owner``; Draining when closed, QuotaExceeded when its process keeps more than
        its share held (``quarantine.py``)."""
        self.check_open()
        self._check_quarantine(owner)
        return self._store.pin(keys, owner, self.clock())

    def _check_quarantine(self, owner: str) -> None:
        """Refuse a get of an owner whose process keeps more than its share held."""
        store = self._store
        process = store.processes.get(owner)
        if process is None:
            return
        held = store.quarantine.bytes_of(process)
        if held >= self.quarantine_limit:
            raise QuotaExceeded(
                "this process keeps too many pages held by views of leases that ended by "
                "force; release them (drop the tensors) or exit",
                quarantined_bytes=held,
                limit=self.quarantine_limit,
                pid=process.pid,
            )
