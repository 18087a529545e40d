"""What a warm restart hands the host store to start from (``restart.py`` decides it).

Plain values: the store is built from them by ``HostStore.adopting`` and nothing else edits
its tables.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from embcache.service.host.entries import Entry
from embcache.service.host.pool_index import PoolIndex
from embcache.service.host.quarantine import Held
from embcache.service.host.write_holds import Written


@dataclass(frozen=True, slots=True)
class Adopted:
    """What a start adopted and dropped (also in the store's counters, for the stats)."""

    entries: int = 0
    nbytes: int = 0
    dropped_invalid: int = 0  # records whose runs left the pool or overlapped another
    dropped_refused: int = 0  # records a put would refuse, or that did not decode
    holds: int = 0  # holds kept for processes that still run
    write_holds: int = 0  # reservations a process that still runs may be writing
    layout_replaced: bool = False
    dropped_layout: int = 0  # entries of a segment replaced for its layout (when known)
    dropped_layout_bytes: int = 0


@dataclass(slots=True)
class Adoption:
    """A warm start's outcome: the READY entries to adopt (unverified), the holds of live
    processes on them, the pages live client processes may still write, the fresh index
    the store keeps up to date (None: none could be made) and the counters to start with."""

    index: PoolIndex | None
    adopted: Adopted = Adopted()
    entries: list[Entry] = field(default_factory=list)
    holds: list[Held] = field(default_factory=list)  # on entries of ``entries``
    writes: list[Written] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=dict)
