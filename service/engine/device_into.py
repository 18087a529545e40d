"""A get-into whose copies are queued: what :meth:`DeviceSide.start_into` hands back.

The leases it holds keep the entries' pages from being freed or rewritten while the copies
read them; :meth:`PendingInto.finish` ends them, and must run only once the copies are
complete (``done()`` True, or after ``wait()``). A transport can poll ``done()`` between
its loop's other callbacks instead of blocking a thread in ``wait()``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from embcache.service.engine.gate import Gate
from embcache.service.host.leases import Lease


class PendingInto:
    """The copies of one get-into, queued; per key its lease (None: a miss)."""

    def __init__(
        self,
        leases: list[Lease | None],
        event: torch.cuda.Event | None,
        release: Callable[[Sequence[int]], object],
        observe: Callable[[str, int, float], None],
        gate: Gate,
    ) -> None:
        self.leases = leases
        self._event = event  # fires once the copies are complete (None: complete already)
        self._release = release
        self._observe = observe
        self._gate = gate  # the engine's lock, to end the leases under
        self._start = time.perf_counter()
        self._finished = False

    @property
    def loaded_bytes(self) -> int:
        """Bytes copied into the destination (named as a get's and a put's are, for
        ``wait_copies``' estimate of how long the copies take)."""
        return sum(x.nbytes for x in self.leases if x is not None)

    def done(self) -> bool:
        """True once the copies are complete (never blocks)."""
        return self._event is None or self._event.query()

    def wait(self) -> None:
        """Block until the copies are complete."""
        if self._event is not None:
            self._event.synchronize()

    def finish(self) -> None:
        """End the leases and report the copy time (once; the copies must be complete)."""
        if self._finished:
            return
        self._finished = True
        self._observe("h2d", self.loaded_bytes, time.perf_counter() - self._start)
        ids = [x.lease_id for x in self.leases if x is not None]
        with self._gate:
            self._release(ids)
