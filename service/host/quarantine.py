"""The quarantine: pages a client process may still read after its lease ended by force.

A client's views (a private mapping of host pages, a view of a device pool) read the pages of
the entry they were handed, and they stay alive for as long as the caller holds them; the
client releases a lease once the views are gone (``docs/contract.md``, "What a caller
holds"). A lease that ends by force instead (its TTL passed while the client was stopped,
its session ended while the process lives, an operator ended it) must not let those pages be
reused: the process would read another entry's bytes through an old view. So its hold on the
entry (one reference: the host pages and every device copy stay) moves here, keyed by lease
id and by the owner's process, until that process has exited (``/proc/<pid>/stat``, with its
start time, so a reused pid is never taken for it) or the client releases the id (its views
are gone).

Only owners whose process the daemon knows are quarantined: sessions on the session socket,
whose peer credentials give the pid. Others (gRPC, REST) end as before.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from embcache.service.host.entries import Entry

PROC = Path("/proc")


@dataclass(frozen=True, slots=True)
class ProcessRef:
    """One process, told apart from a later one with the same pid by its start time."""

    pid: int
    start: int  # clock ticks after boot (field 22 of /proc/<pid>/stat)

    @classmethod
    def of(cls, pid: int, proc: Path = PROC) -> ProcessRef | None:
        """The running process ``pid``; None if there is none (or it is a zombie)."""
        start = start_time(pid, proc)
        return None if start is None else cls(pid, start)

    def alive(self, proc: Path = PROC) -> bool:
        """Whether this very process still runs (not exited, not a zombie, pid not reused)."""
        return start_time(self.pid, proc) == self.start


def start_time(pid: int, proc: Path = PROC) -> int | None:
    """Process ``pid``'s start time in clock ticks, or None if it has exited (a zombie
    counts as exited: its memory is gone) or cannot be read."""
    if pid <= 0:
        return None
    try:
        text = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: count after the last ')'.
    fields = text[text.rfind(")") + 2 :].split()
    if len(fields) < 20 or fields[0] in ("Z", "X", "x"):
        return None
    return int(fields[19])  # fields[0] is field 3 (the state); field 22 is the start time


@dataclass(frozen=True, slots=True)
class Held:
    """One lease's hold on an entry, kept after the lease ended by force."""

    lease_id: int
    entry: Entry
    process: ProcessRef
    nbytes: int  # the pages held, in bytes


class Quarantine:
    """Holds by lease id and by process (module docstring). It does not touch the entries'
    reference counts: the host store does."""

    def __init__(self) -> None:
        self._held: dict[int, Held] = {}
        self._by_process: dict[ProcessRef, set[int]] = {}
        # Per process: holds per entry (by id) and the bytes of the distinct entries, so
        # that many holds of one entry count its pages once, as the lease caps do.
        self._entries: dict[ProcessRef, Counter[int]] = {}
        self._bytes: Counter[ProcessRef] = Counter()

    def __len__(self) -> int:
        return len(self._held)

    @property
    def nbytes(self) -> int:
        """Bytes of pages held, per process the distinct entries' pages, summed."""
        return sum(self._bytes.values())

    def bytes_of(self, process: ProcessRef) -> int:
        """Bytes of the pages of the distinct entries held for ``process``."""
        return self._bytes.get(process, 0)

    def add(self, held: Held) -> None:
        self._held[held.lease_id] = held
        self._by_process.setdefault(held.process, set()).add(held.lease_id)
        entries = self._entries.setdefault(held.process, Counter())
        entries[id(held.entry)] += 1
        if entries[id(held.entry)] == 1:
            self._bytes[held.process] += held.nbytes

    def get(self, lease_id: int) -> Held | None:
        """The hold kept for ``lease_id``, if any."""
        return self._held.get(lease_id)

    def pop(self, lease_id: int) -> Held | None:
        """Forget one hold (the client's views are gone); None if there is none."""
        held = self._held.pop(lease_id, None)
        if held is not None:
            ids = self._by_process[held.process]
            ids.discard(lease_id)
            entries = self._entries[held.process]
            entries[id(held.entry)] -= 1
            if not entries[id(held.entry)]:
                del entries[id(held.entry)]
                self._bytes[held.process] -= held.nbytes
            if not ids:
                del self._by_process[held.process]
                del self._entries[held.process]
                del self._bytes[held.process]
        return held

    def processes(self) -> list[ProcessRef]:
        """The processes something is held for."""
        return list(self._by_process)

    def pop_process(self, process: ProcessRef) -> list[Held]:
        """Forget every hold of ``process`` (it has exited)."""
        return [h for i in list(self._by_process.get(process, ())) if (h := self.pop(i))]

    def clear(self) -> list[Held]:
        """Forget every hold (the engine is closing)."""
        held = list(self._held.values())
        self._held.clear()
        self._by_process.clear()
        self._entries.clear()
        self._bytes.clear()
        return held
