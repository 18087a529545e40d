"""Which of a device pool's copies the read table offers to same-node clients.

A client on the node that maps a device pool can copy a resident entry device to device
(a few microseconds for 4 MiB) instead of asking the daemon (hundreds). The read table says
where: the entry's slot carries, per pool, the page runs of its copy there
(``proto/read_table.py``, ``docs/same_node_reads.md``, "Device-resident hits").

Two rules keep a client from ever reading bytes that are not the entry's:
- a copy is offered only once the copy that filled its pages is complete (its event has
  fired): :meth:`PublishedCopies.offer_done` looks, and is called under the engine's lock by
  the tier after each get's copies are queued, after a get has waited, from the pool's
  housekeeping and from the daemon's reaper (at least once a second);
- it is withdrawn by :meth:`PublishedCopies.forget`, which the pool calls before the pages
  go back to its allocator (every eviction, a drop, its close), so the slot's sequence
  number changes before any later copy can even be queued into them. A pool taken out of
  service (which may happen outside the engine's lock, after a wait) reuses no page again;
  its copies are withdrawn by the tier's next sweep under the lock (at least once a second).

One per pool, owned by it; no lock (the engine's), no reference to the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from embcache.service.host.entries import Entry
from embcache.service.host.read_table import ReadTable

if TYPE_CHECKING:
    from embcache.service.device.residency import Residency


class PublishedCopies:
    """The copies of pool ``index`` the read table ``reads`` offers, and those waiting for
    their copy to complete before they can be (module docstring)."""

    def __init__(self, reads: ReadTable, index: int) -> None:
        self._reads = reads
        self._index = index
        self._waiting: dict[Entry, Residency] = {}  # loaded; offered once the event fired
        self._offered: set[Entry] = set()

    @property
    def waiting(self) -> int:
        """Copies not offered yet because their copy may still run."""
        return len(self._waiting)

    def loaded(self, entry: Entry, res: Residency) -> None:
        """``entry`` got a copy in the pool (``res``), whose filling copy is queued: offer
        it once ``res.event`` has fired."""
        self._waiting[entry] = res

    def offer_done(self) -> int:
        """Offer every waiting copy whose copy is complete (each event is asked once);
        returns how many the table took. A device error raises, as the event's query does."""
        if not self._waiting:
            return 0
        fired: dict[int, bool] = {}
        offered = 0
        for entry, res in list(self._waiting.items()):
            event = res.event
            if event is not None:
                done = fired.get(id(event))
                if done is None:
                    done = fired[id(event)] = bool(event.query())
                if not done:
                    continue
            del self._waiting[entry]
            if self._reads.place(entry, self._index, res.runs):
                self._offered.add(entry)
                offered += 1
        return offered

    def forget(self, entry: Entry) -> None:
        """``entry``'s copy leaves the pool: withdraw it from the table now, before its
        pages can be reused."""
        self._waiting.pop(entry, None)
        if entry in self._offered:
            self._offered.discard(entry)
            self._reads.unplace(entry, self._index)

    def forget_all(self) -> None:
        """The pool forgets every copy (a device error, or its close)."""
        self._waiting.clear()
        for entry in self._offered:
            self._reads.unplace(entry, self._index)
        self._offered.clear()
