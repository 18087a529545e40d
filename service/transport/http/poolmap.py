"""What the pool-map page draws: downsampled page states and a short history of rates.

A pool has up to hundreds of thousands of pages; the page draws at most a few thousand
cells, so pages are grouped into equal cells and each cell shows its most telling state.
The history is a small ring of cumulative counters sampled by the app; rates are the
differences between neighbouring samples, so a missed sample only widens one interval.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from embcache.proto.records import doc

HOST_STATES = ("free", "filling", "ready", "leased")
DEVICE_STATES = ("free", "resident", "leased")
# When a cell mixes states, the one drawn is the most frequent; ties go to the state an
# operator most needs to see (leased pins memory, filling is transient, free is background).
_PRIORITY = {"leased": 3, "filling": 2, "ready": 1, "resident": 1, "free": 0}


@dataclass(frozen=True, slots=True)
class DownsampledPool:
    """A pool's page states as the page draws them: cells of ``pages_per_cell`` pages
    (the REST model ``PoolMapTier`` derives from these fields)."""

    num_pages: int
    pages_per_cell: int
    cells: str = field(  # the index into ``states`` of the state drawn
        metadata=doc("One digit per cell: the state drawn for that group of pages.")
    )
    counts: dict[str, int] = field(metadata=doc("Pages per state over the whole pool."))


def downsample(states: np.ndarray, names: Sequence[str], max_cells: int) -> DownsampledPool:
    """Group ``states`` (one small int per page) into at most ``max_cells`` cells."""
    if max_cells < 1:
        raise ValueError(f"max_cells must be positive, got {max_cells}")
    if len(names) > 10:
        raise ValueError("at most 10 states fit the one-digit cell encoding")
    flat = np.asarray(states).reshape(-1).astype(np.int64, copy=False)
    num_pages = int(flat.size)
    n_states = len(names)
    # Unknown values count as the last state rather than being dropped silently.
    flat = np.clip(flat, 0, n_states - 1)
    counts = np.bincount(flat, minlength=n_states)
    if num_pages == 0:
        return DownsampledPool(0, 1, "", {n: 0 for n in names})
    per_cell = max(1, math.ceil(num_pages / max_cells))
    num_cells = math.ceil(num_pages / per_cell)
    # Pad the last cell with a sentinel (n_states) that bincount per row ignores below.
    padded = np.full(num_cells * per_cell, n_states, dtype=np.int64)
    padded[:num_pages] = flat
    rows = padded.reshape(num_cells, per_cell)
    offsets = (np.arange(num_cells, dtype=np.int64) * (n_states + 1))[:, None]
    per = np.bincount((rows + offsets).ravel(), minlength=num_cells * (n_states + 1))
    per = per.reshape(num_cells, n_states + 1)[:, :n_states]
    # Count dominates (priorities are < 16); priority only breaks ties.
    priority = np.array([_PRIORITY.get(n, 0) for n in names], dtype=np.int64)
    score = per * 16 + priority[None, :]
    drawn = np.argmax(score, axis=1)
    cells = "".join(map(str, drawn.tolist()))
    return DownsampledPool(
        num_pages=num_pages,
        pages_per_cell=per_cell,
        cells=cells,
        counts={name: int(c) for name, c in zip(names, counts.tolist(), strict=True)},
    )


@dataclass(frozen=True, slots=True)
class Counters:
    """Cumulative counters as the history reads them."""

    hits: int
    misses: int
    copied: dict[str, float]  # bytes per copy direction (device copies)
    host_in: int = 0  # bytes of committed puts
    host_out: int = 0  # bytes of the entries hits handed out
    operations: tuple[int, ...] = ()  # data calls per latency bucket (``latency_bounds_s``)


@dataclass(frozen=True, slots=True)
class Sample:
    """Cumulative counters at one moment."""

    t: float  # monotonic seconds
    wall: float  # unix seconds, for the page's time axis
    counters: Counters


@dataclass(frozen=True, slots=True)
class Series:
    """Rates between neighbouring samples, for the page's charts (the REST model
    ``PoolMapHistory`` derives from these fields)."""

    t: list[float] = field(metadata=doc("Unix time at the end of each interval."))
    hit_rate: list[float | None] = field(metadata=doc("Per interval; null when nothing was read."))
    bandwidth: dict[str, list[float]] = field(metadata=doc("Bytes per second per copy direction."))
    host_in: list[float] = field(metadata=doc("Bytes per second stored by puts."))
    host_out: list[float] = field(metadata=doc("Bytes per second of entries handed out by hits."))
    ops: list[float] = field(
        metadata=doc("Data operations (puts, gets, reads, releases, ...) per second.")
    )
    p50_s: list[float | None] = field(
        metadata=doc("Median latency of those operations, seconds (null: none finished).")
    )
    p99_s: list[float | None] = field(metadata=doc("99th percentile latency, seconds."))


def bucket_quantile(q: float, bounds: Sequence[float], counts: Sequence[int]) -> float | None:
    """The ``q`` quantile of observations counted per bucket (``counts[i]``: values in
    (bounds[i-1], bounds[i]]; the last count is above every bound), interpolated linearly
    inside its bucket as Prometheus' ``histogram_quantile`` does; None without any. A value
    in the open top bucket is reported as the highest bound."""
    total = sum(counts)
    if total <= 0:
        return None
    rank = q * total
    seen = 0.0
    for i, n in enumerate(counts):
        if n > 0 and seen + n >= rank:
            if i >= len(bounds):
                return bounds[-1]
            low = bounds[i - 1] if i else 0.0
            return low + (bounds[i] - low) * (rank - seen) / n
        seen += n
    return bounds[-1]


class History:
    """Ring of cumulative samples; ``series()`` turns neighbours into rates."""

    def __init__(
        self,
        read: Callable[[], Counters | tuple[int, int, dict[str, float]]],
        *,
        interval_s: float = 2.0,
        window_s: float = 300.0,
        latency_bounds_s: Sequence[float] = (),
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if interval_s <= 0 or window_s < interval_s:
            raise ValueError(f"need 0 < interval_s <= window_s, got {interval_s}, {window_s}")
        self._read = read
        self.interval_s = interval_s
        self.window_s = window_s
        self._bounds = tuple(latency_bounds_s)
        self._clock = clock
        self._wall = wall_clock
        self._samples: deque[Sample] = deque(maxlen=int(window_s / interval_s) + 1)

    def sample(self) -> None:
        """Read the counters now (the oldest sample beyond the window goes)."""
        raw = self._read()
        counters = raw if isinstance(raw, Counters) else Counters(*raw)
        self._samples.append(Sample(self._clock(), self._wall(), counters))

    def maybe_sample(self) -> None:
        """Sample if the newest sample is at least one interval old (or there is none)."""
        if not self._samples or self._clock() - self._samples[-1].t >= self.interval_s * 0.95:
            self.sample()

    def series(self) -> Series:
        """Hit rate, bandwidth, host bytes, operations and their latency per interval
        between the samples held."""
        samples = list(self._samples)
        directions = sorted({d for s in samples for d in s.counters.copied})
        out = Series([], [], {d: [] for d in directions}, [], [], [], [], [])
        for prev_s, cur_s in itertools.pairwise(samples):
            dt = cur_s.t - prev_s.t
            if dt <= 0:
                continue
            prev, cur = prev_s.counters, cur_s.counters
            lookups = (cur.hits - prev.hits) + (cur.misses - prev.misses)
            out.t.append(round(cur_s.wall, 3))
            out.hit_rate.append(
                None if lookups <= 0 else round((cur.hits - prev.hits) / lookups, 4)
            )
            for d in directions:
                delta = cur.copied.get(d, 0.0) - prev.copied.get(d, 0.0)
                out.bandwidth[d].append(round(max(delta, 0.0) / dt, 1))
            out.host_in.append(round(max(cur.host_in - prev.host_in, 0) / dt, 1))
            out.host_out.append(round(max(cur.host_out - prev.host_out, 0) / dt, 1))
            done = [
                max(c - p, 0)
                for c, p in itertools.zip_longest(cur.operations, prev.operations, fillvalue=0)
            ]
            out.ops.append(round(sum(done) / dt, 2))
            for q, column in ((0.5, out.p50_s), (0.99, out.p99_s)):
                value = bucket_quantile(q, self._bounds, done) if self._bounds else None
                column.append(None if value is None else round(value, 6))
        return out
