"""Pages a client process may still write: kept out of reuse until it is done or has exited.

A same-node put of a large host tensor is filled by the client itself, through its own
writable mapping of the pool (``transport/session/host_puts.py``): the daemon reserves the
pages and the client copies into them. The daemon cannot stop that copy. A reservation that
ends while the client may still be copying (its session ended by force or by an operator,
its idle timeout passed, the daemon was killed) must therefore not give its pages back: the
next put would take them and the late bytes would land in its committed entry. This is the
write side of the read quarantine (``quarantine.py``), and it keys on the same thing: the
process, by pid and start time, that the kernel says is at the other end of the session.

- While a reservation is open, its pages are the reservation's; the warm-restart index has
  a ``WRITE`` record of them with the process (so a daemon killed meanwhile and started
  warm keeps them out of its allocator too, ``restart.py``).
- It ends with the client's word (its commit, which follows its copy, or its abort, which
  follows a copy that failed): the pages go to the entry or back to the allocator, and the
  record goes (``UNWRITE``).
- It ends any other way while the process runs: the pages are held here, still counted
  against the process's in-flight put quota (so a client cannot pin the pool this way
  beyond its quota), until the process has exited (the daemon's reaper) or says it is done
  with them: a ``put_abort`` of that reservation's id, on any session of that process.
"""

from __future__ import annotations

from dataclasses import dataclass

from embcache.service.host.allocator import Run
from embcache.service.host.quarantine import ProcessRef


@dataclass(frozen=True, slots=True)
class Written:
    """Pages one reservation's writer may still write after the reservation ended."""

    write_id: int  # the reservation's put id; its WRITE record's id in the index
    process: ProcessRef
    runs: tuple[Run, ...]
    owner: str | None  # whose in-flight put quota they still count against (None: adopted)
    nbytes: int  # the bytes counted against that quota
    token: int = 0  # the reservation id the client knows it by (0: none, adopted ones)


class WriteHolds:
    """The pages held for writers, by reservation and by process (module docstring). It
    does not touch the allocator: the host store does."""

    def __init__(self) -> None:
        self._held: dict[int, Written] = {}
        self._by_process: dict[ProcessRef, set[int]] = {}
        self.pages = 0  # pages held now

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, write_id: int) -> bool:
        return write_id in self._held

    def add(self, written: Written) -> None:
        self._held[written.write_id] = written
        self._by_process.setdefault(written.process, set()).add(written.write_id)
        self.pages += sum(n for _, n in written.runs)

    def pop(self, write_id: int) -> Written | None:
        written = self._held.pop(write_id, None)
        if written is not None:
            ids = self._by_process[written.process]
            ids.discard(write_id)
            if not ids:
                del self._by_process[written.process]
            self.pages -= sum(n for _, n in written.runs)
        return written

    def get(self, write_id: int) -> Written | None:
        return self._held.get(write_id)

    def find(self, process: ProcessRef, token: int) -> Written | None:
        """The hold of ``process`` that its client knows by ``token``, if any."""
        for write_id in self._by_process.get(process, ()):
            written = self._held[write_id]
            if token and written.token == token:
                return written
        return None

    def processes(self) -> list[ProcessRef]:
        """The processes something is held for."""
        return list(self._by_process)

    def pop_process(self, process: ProcessRef) -> list[Written]:
        """Forget every hold of ``process`` (it has exited)."""
        return [w for i in list(self._by_process.get(process, ())) if (w := self.pop(i))]

    def clear(self) -> list[Written]:
        """Forget every hold (the engine is closing)."""
        held = list(self._held.values())
        self._held.clear()
        self._by_process.clear()
        self.pages = 0
        return held
