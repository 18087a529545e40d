"""Where an entry's copy lies in one device pool (its pages, their physical runs, the event
of the copy that filled them): the record a pool keeps per resident entry, and what its
read-table offers (``published.py``) wait on."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True, eq=False)
class Residency:
    """Where an entry's copy lies in one pool: ``npages`` virtual pages from ``vstart``,
    the physical page runs bound to them, and the event of the copy that filled them (a
    reader that cannot wait for it reads the host copy instead)."""

    vstart: int
    npages: int
    runs: tuple[tuple[int, int], ...]  # physical page runs
    event: torch.cuda.Event | None = None  # recorded after the copy that filled the pages

    @property
    def contiguous(self) -> bool:
        """One physical run: clients get a view at a byte offset instead of page ids."""
        return len(self.runs) <= 1
