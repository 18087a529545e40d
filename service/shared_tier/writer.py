"""Write-through: every committed local put is written to the shared tier by one thread.

The queue holds keys, not bytes: the writer leases each entry when its turn comes and
hands the store the entry's page runs (the lease keeps the pages from being reused while
the store reads them). An entry evicted before its turn is skipped and counted.

Back-pressure: a put that finds the queue full waits up to ``timeout_s`` for room (counted
as ``queue_full``), then the entry is dropped from write-through (``queue_dropped``); while
the tier is degraded nothing waits. With ``ack="sync"`` the committing put also waits until
its entry is in the shared tier, or until the writer gave up on it (never while degraded).
Failed batches are retried ``retries`` times with exponential backoff.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from embcache.errors import EmbCacheError
from embcache.service.shared_tier.base import (
    Header,
    PutItem,
    SharedTierBackend,
    key_digest,
    payload_crc,
)
from embcache.service.shared_tier.health import TierHealth
from embcache.service.tier_config import SharedTierConfig

if TYPE_CHECKING:
    from embcache.service.engine import CacheEngine
    from embcache.service.host.leases import Lease

log = logging.getLogger("embcache.tiers")

OWNER = "shared-tier"


@dataclass(slots=True)
class _Item:
    key: str
    done: threading.Event | None = None
    enqueued_at: float = field(default_factory=time.monotonic)


class WriteThrough:
    """The write-through queue and its thread (module docstring)."""

    def __init__(
        self,
        engine: CacheEngine,
        backend: Callable[[], SharedTierBackend | None],
        health: TierHealth,
        config: SharedTierConfig,
        in_writer: threading.local,
    ) -> None:
        self._engine = engine
        self._backend = backend
        self._health = health
        self._config = config
        self._in_writer = in_writer  # tells the miss fetcher to ignore the writer's gets
        self._queue: queue.Queue[_Item] = queue.Queue(maxsize=config.queue_size)
        self._stop = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._thread = threading.Thread(
            target=self._run, name="embcache-shared-tier-writer", daemon=True
        )
        self._thread.start()

    @property
    def depth(self) -> int:
        """Entries queued now."""
        return self._queue.qsize()

    # -- producer side (commit listener) -------------------------------------------------
    def submit(self, key: str) -> None:
        """Queue a committed entry for writing (the committing put waits as the module
        docstring says: for room, and with ``ack="sync"`` for the write)."""
        sync = self._config.ack == "sync" and self._health.ok
        item = _Item(key, threading.Event() if sync else None)
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self._health.inc("queue_full")
            if not self._health.ok or self._stop.is_set():
                self._health.inc("queue_dropped")
                return
            try:
                self._queue.put(item, timeout=self._config.timeout_s)
            except queue.Full:
                self._health.inc("queue_dropped")
                return
        if item.done is not None:
            c = self._config
            # Longest a batch can take: every attempt times out, plus the backoffs between.
            limit = c.timeout_s * (c.retries + 2) + sum(_backoff(a) for a in range(c.retries + 1))
            if not item.done.wait(limit):
                self._health.inc("ack_timeouts")

    # -- consumer side -------------------------------------------------------------------
    def _take(self) -> list[_Item]:
        try:
            first = self._queue.get(timeout=self._config.probe_interval_s)
        except queue.Empty:
            return []
        batch = [first]
        while len(batch) < self._config.batch_max:
            try:
                batch.append(self._queue.get_nowait())
            except queue.Empty:
                break
        return batch

    def _run(self) -> None:
        self._in_writer.active = True
        while True:
            self._idle.set()
            if self._stop.is_set() and self._queue.empty():
                return
            batch = self._take()
            if not batch:
                continue
            self._idle.clear()
            try:
                self._write_with_retries(batch)
            except Exception:  # never let the writer thread die
                log.exception("shared tier writer failed on a batch of %d", len(batch))
                self._health.inc("write_failed", len(batch))
            finally:
                for item in batch:
                    if item.done is not None:
                        item.done.set()

    def _write_with_retries(self, batch: list[_Item]) -> None:
        retries = self._config.retries
        for attempt in range(retries + 1):
            if attempt:
                self._health.inc("write_retries")
                if self._stop.wait(_backoff(attempt)) and not self._health.ok:
                    break  # shutting down with the tier down: give up now
            backend = self._backend()
            if backend is None or (not self._health.ok and attempt < retries):
                continue  # degraded: wait for the monitor's probe rather than hammer the store
            try:
                self._write(backend, batch)
                return
            except Exception as exc:
                self._health.failed("write", exc)
        self._health.inc("write_failed", len(batch))

    def _write(self, backend: SharedTierBackend, batch: list[_Item]) -> None:
        engine = self._engine
        keys = list(dict.fromkeys(item.key for item in batch))
        try:
            leases = engine.get(keys, OWNER)
        except EmbCacheError:  # draining or closed: nothing left to write from
            self._health.inc("queue_dropped", len(keys))
            return
        try:
            items: list[PutItem] = []
            pool = engine.host_segment().array
            for lease in leases:
                if lease is None:
                    self._health.inc("write_skipped_evicted")
                    continue
                items.append(_put_item(lease, pool))
            if not items:
                return
            ok = backend.put_batch(items)
        finally:
            engine.release([lease.lease_id for lease in leases if lease is not None])
        stored = [i for i, good in zip(items, ok, strict=True) if good]
        self._health.inc("writes_ok", len(stored))
        self._health.inc("write_bytes", sum(i.header.nbytes for i in stored))
        if len(stored) < len(items):
            self._health.inc("write_failed", len(items) - len(stored))

    # -- life cycle ----------------------------------------------------------------------
    def flush(self, timeout_s: float) -> bool:
        """Wait until the queue is empty and no batch is in flight (tests, shutdown)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._queue.empty() and self._idle.is_set():
                return True
            time.sleep(0.01)
        return False

    def close(self, drain_s: float) -> None:
        """Write what is queued (for up to ``drain_s``), then stop the thread."""
        self.flush(drain_s)
        self._stop.set()
        dropped = 0
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            dropped += 1
            if item.done is not None:
                item.done.set()
        if dropped:
            self._health.inc("queue_dropped", dropped)
        self._thread.join(timeout=drain_s + self._config.timeout_s * 2)


def _put_item(lease: Lease, pool: object) -> PutItem:
    entry = lease.entry
    runs = lease.byte_runs
    # A checksum the client sent was verified on commit; otherwise compute one here.
    crc = entry.checksum if entry.checksum is not None else payload_crc(pool, runs)  # type: ignore[arg-type]
    header = Header(lease.dtype, lease.shape, lease.nbytes, crc, key_digest(lease.key))
    return PutItem(lease.key, header, runs)


def _backoff(attempt: int) -> float:
    return 0.0 if attempt <= 0 else min(0.25 * 2 ** (attempt - 1), 2.0)
