"""Page-run allocator: hands out runs of consecutive pages and coalesces them on free.

Free runs live in three structures kept in step:
  ``_by_start``  start -> length   (find the right neighbour in O(1))
  ``_by_end``    end   -> start    (find the left neighbour in O(1); end is exclusive)
  ``_by_size``   SortedList of (length, start) for best fit in O(log n)
An allocation touches one entry per run it returns, never one per page, so a 64 MiB
entry in one run costs the same as a 256 KiB one.
"""

from __future__ import annotations

from collections.abc import Sequence

from sortedcontainers import SortedList

Run = tuple[int, int]  # (first page, number of pages)


class PageRunAllocator:
    """Free runs of a pool of ``num_pages`` pages (module docstring); host bookkeeping only."""

    def __init__(self, num_pages: int) -> None:
        assert num_pages > 0, f"num_pages must be positive, got {num_pages}"
        self.num_pages = num_pages
        self.num_free_pages = num_pages
        self._by_start: dict[int, int] = {0: num_pages}
        self._by_end: dict[int, int] = {num_pages: 0}
        self._by_size: SortedList = SortedList([(num_pages, 0)])

    @classmethod
    def with_used(cls, num_pages: int, used: list[Run]) -> PageRunAllocator:
        """An allocator whose free pages are all but ``used`` (runs inside the pool that
        overlap none other: a warm restart's adopted entries), in O(n log n)."""
        alloc = cls(num_pages)
        alloc._by_start.clear()
        alloc._by_end.clear()
        alloc._by_size.clear()
        at = 0
        for start, length in sorted(used):
            assert start >= at and length > 0 and start + length <= num_pages, (start, length)
            if start > at:
                alloc._insert(at, start - at)
            at = start + length
        if at < num_pages:
            alloc._insert(at, num_pages - at)
        alloc.num_free_pages = num_pages - sum(n for _, n in used)
        return alloc

    # -- queries -------------------------------------------------------------------------
    @property
    def num_free_runs(self) -> int:
        """How many free runs there are (a measure of fragmentation)."""
        return len(self._by_start)

    @property
    def largest_free_run(self) -> int:
        """Pages in the longest free run: the largest allocation that stays one run."""
        return self._by_size[-1][0] if self._by_size else 0

    def free_runs(self) -> list[Run]:
        """Every free run, by start (tests and debugging)."""
        return sorted(self._by_start.items())

    # -- allocation ----------------------------------------------------------------------
    def allocate(self, n: int) -> list[Run] | None:
        """Reserve ``n`` pages in as few runs as possible; None if fewer than n are free.

        One run when any free run is large enough (best fit, lowest address on ties);
        otherwise the largest runs until the remainder fits in one, then the best fit
        for the remainder: that is the fewest runs that can cover n.
        """
        assert n >= 0, f"cannot allocate {n} pages"
        if n == 0:
            return []
        if n > self.num_free_pages:
            return None
        runs: list[Run] = []
        remaining = n
        by_size = self._by_size
        while remaining:
            if by_size[-1][0] < remaining:  # no run fits the rest: take the largest whole
                length, start = by_size.pop()  # cheaper than remove(): no search
                del self._by_start[start]
                del self._by_end[start + length]
                runs.append((start, length))
                remaining -= length
                continue
            length, start = by_size[by_size.bisect_left((remaining, -1))]
            self._take(start, length, remaining)
            runs.append((start, remaining))
            remaining = 0
        self.num_free_pages -= n
        runs.sort()
        return runs

    def _take(self, start: int, length: int, n: int) -> None:
        """Remove the first ``n`` pages of the free run (start, length)."""
        self._by_size.remove((length, start))
        del self._by_start[start]
        del self._by_end[start + length]
        if n < length:
            self._insert(start + n, length - n)

    def _insert(self, start: int, length: int) -> None:
        self._by_start[start] = length
        self._by_end[start + length] = start
        self._by_size.add((length, start))

    # -- free ----------------------------------------------------------------------------
    def free(self, runs: list[Run] | tuple[Run, ...]) -> None:
        """Return runs to the pool, merging each with free neighbours on both sides."""
        for start, length in runs:
            assert length > 0 and start >= 0 and start + length <= self.num_pages, (
                f"run ({start}, {length}) is outside the pool of {self.num_pages} pages"
            )
            end = start + length
            assert start not in self._by_start and end not in self._by_end, (
                f"double free of run ({start}, {length})"
            )
            left = self._by_end.get(start)
            if left is not None:
                left_len = start - left
                self._by_size.remove((left_len, left))
                del self._by_start[left]
                del self._by_end[start]
                start, length = left, length + left_len
            right_len = self._by_start.get(end)
            if right_len is not None:
                self._by_size.remove((right_len, end))
                del self._by_start[end]
                del self._by_end[end + right_len]
                length += right_len
            self._insert(start, length)
        self.num_free_pages += sum(length for _, length in runs)
        assert self.num_free_pages <= self.num_pages, "more pages free than exist"


def page_byte_runs(runs: Sequence[Run], page_bytes: int, nbytes: int) -> list[tuple[int, int]]:
    """Byte ranges ``(offset, length)`` holding the first ``nbytes`` of page ``runs``."""
    out: list[tuple[int, int]] = []
    left = nbytes
    for start, length in runs:
        take = min(left, length * page_bytes)
        if take <= 0:
            break
        out.append((start * page_bytes, take))
        left -= take
    assert left <= 0, f"runs hold fewer than {nbytes} bytes"
    return out
