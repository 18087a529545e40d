"""Host pages set aside for puts from a device, so that a put's copy starts first.

A put from a device returns once its copy is complete, so all the host work queued before
the copy (checking the request, searching the allocator, evicting) adds to the call. The
prealloc holds a few page runs taken from the allocator ahead of time: a put takes its pages
from it, queues its copy at once (``PutPath.take_prealloc``), and is checked, recorded
and topped up while the copy engine works. A put that turns out invalid gives its pages
back once its copy is complete; nothing of it becomes visible.

The pages are free capacity on loan: stats count them as free, and a put or fetch that
needs room takes them all back first (``drain``). The prealloc aims to hold as many pages
as the largest put it served lately, at most ``max_pages``.
"""

from __future__ import annotations

Run = tuple[int, int]  # (first page, number of pages)


class PutPrealloc:
    """Page runs on loan from the host allocator (see the module's docstring). No lock:
    every call is made under the engine's, like the host store's."""

    def __init__(self, max_pages: int) -> None:
        self.max_pages = max_pages
        self.pages = 0  # pages held now
        self.want = 0  # pages a top-up aims for: the largest put asked for lately
        self._runs: list[Run] = []

    def take(self, npages: int) -> tuple[Run, ...] | None:
        """``npages`` pages, first runs first, or None when it holds fewer (or a put that
        large is not for the prealloc: more than ``max_pages``, or none at all)."""
        if not 0 < npages <= self.max_pages:
            return None
        self.want = max(self.want, npages)
        if npages > self.pages:
            return None
        out: list[Run] = []
        left = npages
        while left:
            start, n = self._runs[0]
            if n <= left:
                del self._runs[0]
                out.append((start, n))
                left -= n
            else:
                self._runs[0] = (start + left, n - left)
                out.append((start, left))
                left = 0
        self.pages -= npages
        return tuple(out)

    def give_back(self, runs: tuple[Run, ...] | list[Run]) -> None:
        """Pages taken and not used (their copies complete): first in line again."""
        self._runs[:0] = runs
        self.pages += sum(n for _, n in runs)

    def shortfall(self) -> int:
        """Pages a top-up should add."""
        return max(0, self.want - self.pages)

    def add(self, runs: list[Run]) -> None:
        """Runs just taken from the allocator (a top-up)."""
        self._runs.extend(runs)
        self.pages += sum(n for _, n in runs)

    def drain(self) -> list[Run]:
        """Every run it holds, for the allocator to take back; ``want`` falls back to
        nothing until a put asks again."""
        runs, self._runs = self._runs, []
        self.pages = 0
        self.want = 0
        return runs
