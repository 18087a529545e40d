"""Dealing a batch's physical page runs out to its entries (``DevicePool.reserve_batch``)."""

from __future__ import annotations

import bisect


def assign_runs(runs: list[tuple[int, int]], sizes: list[int]) -> list[tuple[tuple[int, int], ...]]:
    """Cut the batch's physical runs into one page list per entry (``sum(sizes)`` pages).

    Entries that fit in one piece come first, largest first, each taking the smallest piece
    that holds it whole (so it stays one run: a zero-copy view for clients). Entries no
    piece holds are cut anyway; they take what is left, largest pieces first. The pieces
    stay sorted by size (one sort, then a bisection per step), so a fragmented batch costs
    no sort per entry.
    """
    if len(runs) == 1:  # one piece holds the batch (the usual case): entries in order
        start = runs[0][0]
        out1: list[tuple[tuple[int, int], ...]] = []
        for need in sizes:
            out1.append(((start, need),) if need else ())
            start += need
        return out1
    pieces = sorted(([s, k] for s, k in runs if k), key=_minus_size)  # largest first
    largest = pieces[0][1] if pieces else 0
    out: list[tuple[tuple[int, int], ...]] = [()] * len(sizes)
    order = sorted(range(len(sizes)), key=lambda j: (sizes[j] > largest, -sizes[j]))
    if min((n for n in sizes if n), default=0) > largest:
        _cut_all(pieces, sizes, order, out)  # no piece holds any entry whole
        return out
    for i in order:
        need = sizes[i]
        if not need:
            continue
        j = bisect.bisect_right(pieces, -need, key=_minus_size) - 1  # smallest that holds it
        if j >= 0:
            out[i] = ((pieces[j][0], need),)
            _take(pieces, j, need)
            continue
        mine: list[tuple[int, int]] = []
        while need:
            take = min(need, pieces[0][1])
            mine.append((pieces[0][0], take))
            _take(pieces, 0, take)
            need -= take
        out[i] = tuple(mine)
    return out


def _cut_all(
    pieces: list[list[int]],
    sizes: list[int],
    order: list[int],
    out: list[tuple[tuple[int, int], ...]],
) -> None:
    """Every entry is cut (none fits in one piece): walk the pieces largest first, each
    entry taking what is left of the current piece, then the next ones. The same pieces in
    the same order as the general loop when they are all one size (the fragmented pool's
    usual state), without re-sorting what is left of a piece."""
    i, (start, left) = 0, pieces[0]
    for j in order:
        need = sizes[j]
        mine: list[tuple[int, int]] = []
        while need:
            if not left:
                i += 1
                start, left = pieces[i]
            take = min(need, left)
            mine.append((start, take))
            start, left, need = start + take, left - take, need - take
        out[j] = tuple(mine)


def _minus_size(piece: list[int]) -> int:
    return -piece[1]


def _take(pieces: list[list[int]], j: int, n: int) -> None:
    """Use the first ``n`` pages of ``pieces[j]``; keep the list sorted largest first."""
    piece = pieces.pop(j)
    piece[0] += n
    piece[1] -= n
    if piece[1]:
        bisect.insort(pieces, piece, key=_minus_size)
