"""The background pass that checks every entry adopted at a warm restart against its CRC32.

Adopted entries are READY but unverified (``host/restart.py``): one served first is checked
by ``HostStore.lookup``; this pass checks the rest at ISA-L speed, a slice at a time under
the engine's gate, so that gets and puts wait at most one slice for it.
"""

from __future__ import annotations

import logging
import threading

from embcache.service.engine.gate import Gate
from embcache.service.host.entries import EntryState
from embcache.service.host.store import HostStore

log = logging.getLogger("embcache.service.host.restart")

_VERIFY_SLICE = 64 << 20  # bytes checked per hold of the engine's gate


class Verifier:
    """The pass (module docstring): ``store.verify`` on each adopted entry, a slice of
    ``_VERIFY_SLICE`` bytes per hold of ``gate``, until none is left or the engine closed."""

    def __init__(self, store: HostStore, gate: Gate) -> None:
        self._store = store
        self._gate = gate
        self._todo = store.unverified()
        self.thread = threading.Thread(target=self._run, name="embcache-verify", daemon=True)

    @property
    def pending(self) -> int:
        """Adopted entries not checked yet (an estimate, read without the lock)."""
        return sum(e.unverified for e in self._todo)

    def start(self) -> None:
        """Start the pass (once; nothing to do when nothing was adopted)."""
        if self._todo and self.thread.ident is None:
            self.thread.start()

    def _run(self) -> None:
        todo = self._todo
        at = 0
        while at < len(todo):
            with self._gate:
                if self._gate.closed:
                    return
                done = 0
                while at < len(todo) and done < _VERIFY_SLICE:
                    entry = todo[at]
                    at += 1
                    if entry.unverified and entry.state is EntryState.READY:
                        self._store.verify(entry)
                        done += entry.nbytes
        dropped = self._store.counter("adopt_dropped_checksum")
        log.info("warm restart: checked %d adopted entries, %d dropped", len(todo), dropped)
