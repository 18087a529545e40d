"""Shared-tier health and counters: degraded mode, outages, and what the metrics read.

A failed store operation marks the tier *degraded*: fetches and exists answer "miss" at
once and the writer holds off, so an outage costs local operations nothing after the call
that found it. A monitor probes the store every ``probe_interval_s`` and marks it healthy
again on the first answer (automatic recovery). Transitions are logged once, not per call.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable

log = logging.getLogger("embcache.tiers")

COUNTERS = (
    "fetch_keys",  # keys looked up in the shared tier on a local miss (or a prefetch)
    "fetch_hits",  # ... filled into the host pool and committed
    "fetch_misses",  # ... not in the shared tier
    "fetch_corrupt",  # ... checksum/header/size mismatch: a miss, never served
    "fetch_rejected",  # ... header fine but the local pool refused it (full, limits)
    "fetch_bytes",
    "fetch_skipped_degraded",  # keys not looked up because the tier was degraded
    "writes_ok",
    "write_bytes",
    "write_failed",  # entries given up after all retries
    "write_retries",
    "write_skipped_evicted",  # evicted locally before the writer got to them
    "queue_full",  # puts that found the write-through queue full (back-pressure)
    "queue_dropped",  # entries never written because the queue stayed full
    "ack_timeouts",  # sync acks that gave up waiting
    "outages",
    "recoveries",
    "prefetch_keys",
)


class TierHealth:
    """Degraded or not, the counters, and the last error (module docstring); thread-safe."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._counters: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()  # by operation
        self._degraded_since: float | None = None
        self.last_error: str | None = None
        self.last_error_at: float | None = None

    @property
    def ok(self) -> bool:
        """False while degraded."""
        return self._degraded_since is None

    def inc(self, name: str, n: int = 1) -> None:
        """Add ``n`` to counter ``name`` (one of :data:`COUNTERS`)."""
        with self._lock:
            self._counters[name] += n

    def failed(self, op: str, exc: BaseException) -> None:
        """An operation failed against the store: count it and enter degraded mode."""
        message = f"{type(exc).__name__}: {exc}"
        with self._lock:
            self.errors[op] += 1
            self.last_error = message[:500]
            self.last_error_at = self._clock()
            first = self._degraded_since is None
            if first:
                self._degraded_since = self.last_error_at
                self._counters["outages"] += 1
        if first:
            log.warning("shared tier degraded (%s failed): %s", op, message)

    def recovered(self) -> None:
        """The store answered again: leave degraded mode (logged once)."""
        with self._lock:
            if self._degraded_since is None:
                return
            down = self._clock() - self._degraded_since
            self._degraded_since = None
            self._counters["recoveries"] += 1
        log.warning("shared tier recovered after %.1f s", down)

    def counters(self) -> dict[str, int]:
        """Every counter of :data:`COUNTERS`, zeros included."""
        with self._lock:
            return {name: self._counters[name] for name in COUNTERS}

    def error_counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self.errors)

    def detail(self) -> dict[str, object]:
        """The state for health pages: since when degraded, the last error, outages."""
        with self._lock:
            since = self._degraded_since
            return {
                "state": "ok" if since is None else "degraded",
                "degraded_since": since,
                "degraded_for_s": None if since is None else round(self._clock() - since, 3),
                "last_error": self.last_error,
                "last_error_at": self.last_error_at,
                "outages": self._counters["outages"],
                "errors": dict(self.errors),
            }
