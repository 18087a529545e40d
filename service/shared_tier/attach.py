"""The shared tier of an engine: the hooks ``CacheEngine`` calls (``SharedTierHooks``).

- ``fetch``: local misses of every get are fetched into the host pool (owner
  ``shared-tier``), verified (CRC32 on commit) and then served as local hits;
- ``exists``: answers for local misses;
- ``on_commit``: every committed put (except the tier's own fills) is written through by
  ``WriteThrough``.

An outage never fails a local operation: every hook catches store errors, marks the tier
degraded (``health.py``) and answers as a miss; a monitor thread probes the store and
recovers by itself. The engine is given :func:`shared_tier_hooks` at construction, starts
the tier last and closes it first.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from embcache.errors import ChecksumMismatch, EmbCacheError
from embcache.service.engine import CacheEngine
from embcache.service.host.put_writer import PutHandle
from embcache.service.shared_tier.base import ByteRuns, FetchResult, Header, SharedTierBackend
from embcache.service.shared_tier.health import TierHealth
from embcache.service.shared_tier.writer import OWNER, WriteThrough
from embcache.service.tier_config import SharedTierConfig

log = logging.getLogger("embcache.tiers")


def make_backend(config: SharedTierConfig) -> SharedTierBackend:
    """The adapter the URL names; its package is imported only here (an optional extra)."""
    if config.backend == "redis":
        from embcache.service.shared_tier.redis_tier import RedisTier

        return RedisTier(config)
    from embcache.service.shared_tier.mooncake_tier import MooncakeTier

    return MooncakeTier(config)


@dataclass(frozen=True, slots=True)
class PrefetchResult:
    """What a Prefetch did, in distinct keys."""

    requested: int  # distinct keys asked for
    local: int  # already in the host pool
    fetched: int  # brought in from the shared tier now
    missing: int  # in neither tier (or corrupt, or the tier was degraded)
    resident: int  # made resident in the device pool (when a device was asked for)

    def to_dict(self) -> dict[str, int]:
        """The Prefetch reply's fields."""
        return {
            "requested": self.requested,
            "local": self.local,
            "fetched": self.fetched,
            "missing": self.missing,
            "resident": self.resident,
        }


BackendFactory = Callable[[SharedTierConfig], SharedTierBackend]


class SharedTier:
    """One engine's shared tier (module docstring): the adapter, its health, the
    write-through thread and the monitor that reconnects after an outage."""

    def __init__(
        self,
        engine: CacheEngine,
        config: SharedTierConfig,
        backend_factory: BackendFactory = make_backend,
    ) -> None:
        self.engine = engine
        self.config = config
        self._factory = backend_factory
        self.health = TierHealth()
        self._backend: SharedTierBackend | None = None
        self._backend_lock = threading.Lock()
        self._in_writer = threading.local()
        self._stop = threading.Event()
        self._connect()  # a store that is down now is a degraded start, not a failed one
        if self._backend is not None:
            self._probe()
        self.writer = WriteThrough(engine, self.backend, self.health, config, self._in_writer)
        self._monitor = threading.Thread(
            target=self._watch, name="embcache-shared-tier-monitor", daemon=True
        )
        self._monitor.start()

    # -- backend and recovery ------------------------------------------------------------
    def backend(self) -> SharedTierBackend | None:
        """The adapter, or None until one could be made (the store was down at start)."""
        return self._backend

    def _connect(self) -> None:
        with self._backend_lock:
            if self._backend is not None:
                return
            try:
                backend = self._factory(self.config)
                backend.attach_pool(self.engine.host_segment().array)
            except ImportError:
                raise  # the adapter's package is missing: a setup error, not an outage
            except Exception as exc:
                self.health.failed("connect", exc)
                return
            self._backend = backend

    def _probe(self) -> None:
        backend = self._backend
        if backend is None:
            return
        try:
            backend.ping()
        except Exception as exc:
            self.health.failed("ping", exc)
        else:
            self.health.recovered()

    def _watch(self) -> None:
        while not self._stop.wait(self.config.probe_interval_s):
            if not self.health.ok:
                self._connect()
                self._probe()

    # -- engine hooks --------------------------------------------------------------------
    def fetch(self, keys: list[str]) -> None:
        """Fill local misses from the shared tier; never raises."""
        if getattr(self._in_writer, "active", False):
            return  # the writer's own leases must not trigger fetches
        self._fetch(keys)

    def _fetch(self, keys: Sequence[str]) -> dict[str, FetchResult]:
        backend = self._backend
        if not keys:
            return {}
        if backend is None or not self.health.ok:
            self.health.inc("fetch_skipped_degraded", len(keys))
            return {}
        self.health.inc("fetch_keys", len(keys))
        handles: dict[str, PutHandle] = {}

        def reserve(key: str, header: Header) -> ByteRuns | None:
            try:
                h = self.engine.begin_put(
                    key,
                    header.dtype,
                    header.shape,
                    nbytes=header.nbytes,
                    checksum=header.crc32,
                    owner=OWNER,
                )
            except EmbCacheError as exc:  # pool full, limits, metadata conflict, draining
                log.debug("shared tier entry %r not admitted: %s", key, exc)
                self.health.inc("fetch_rejected")
                return None
            if h.exists_already:  # filled by someone else meanwhile
                h.skip_bytes()
                h.commit()
                return None
            handles[key] = h
            return h.byte_runs

        try:
            results = backend.get_batch(keys, reserve)
        except Exception as exc:
            for reserved in handles.values():
                reserved.abort()
            self.health.failed("fetch", exc)
            return {}
        out: dict[str, FetchResult] = {}
        corrupt: list[str] = []
        for key, result in zip(keys, results, strict=True):
            h = handles.pop(key) if key in handles else None
            if result is FetchResult.FILLED and h is not None:
                result = self._commit(h)
            elif h is not None:
                h.abort()
            if result is FetchResult.CORRUPT:
                corrupt.append(key)
            elif result is FetchResult.MISSING:
                self.health.inc("fetch_misses")
            out[key] = result
        for reserved in handles.values():  # an adapter that skipped a reserved key
            reserved.abort()
        if corrupt:
            self.health.inc("fetch_corrupt", len(corrupt))
            self._drop_corrupt(backend, corrupt)
        return out

    def _commit(self, h: PutHandle) -> FetchResult:
        try:
            h.fill_with(lambda runs: None)  # the adapter wrote the runs; now count + CRC them
            h.commit()
        except ChecksumMismatch:
            log.warning("shared tier entry %r failed its checksum; treated as a miss", h.key)
            return FetchResult.CORRUPT
        except EmbCacheError as exc:
            log.debug("shared tier fill of %r not committed: %s", h.key, exc)
            self.health.inc("fetch_rejected")
            return FetchResult.SKIPPED
        self.health.inc("fetch_hits")
        self.health.inc("fetch_bytes", h.nbytes)
        return FetchResult.FILLED

    def _drop_corrupt(self, backend: SharedTierBackend, keys: list[str]) -> None:
        """A corrupt value would be fetched (and rejected) on every miss: remove it."""
        try:
            backend.delete(keys, force=True)
        except Exception as exc:
            self.health.failed("delete", exc)

    def exists(self, keys: list[str]) -> list[bool]:
        """Answer for local misses; a miss while degraded."""
        backend = self._backend
        if backend is None or not self.health.ok:
            return [False] * len(keys)
        try:
            return backend.exists(keys)
        except Exception as exc:
            self.health.failed("exists", exc)
            return [False] * len(keys)

    def on_commit(self, key: str, owner: str) -> None:
        """Write every new local entry through."""
        if owner != OWNER and not self._stop.is_set():
            self.writer.submit(key)

    # -- operations for the transports --------------------------------------------------
    def prefetch(self, keys: Sequence[str], *, device: int | None = None) -> PrefetchResult:
        """Warm the local tiers: fetch keys missing here into the host pool and, with
        ``device``, make them resident in that device pool (leases released at once)."""
        wanted = list(dict.fromkeys(k for k in keys if isinstance(k, str)))
        self.health.inc("prefetch_keys", len(wanted))
        absent = [k for k in wanted if self.engine.entry_info(k) is None]
        results = self._fetch(absent)
        fetched = sum(1 for r in results.values() if r is FetchResult.FILLED)
        resident = 0
        if device is not None:
            present = [k for k in wanted if self.engine.entry_info(k) is not None]
            resident = self.engine.device.warm(present, device)
        local = len(wanted) - len(absent)
        return PrefetchResult(len(wanted), local, fetched, len(absent) - fetched, resident)

    @property
    def queue_depth(self) -> int:
        """Entries waiting to be written through."""
        return self.writer.depth

    def health_detail(self) -> dict[str, object]:
        """For /health and operators: state, last error, queue, backend facts (no secrets)."""
        backend = self._backend
        detail: dict[str, object] = {"enabled": True, "backend": self.config.backend}
        detail.update(self.health.detail())
        if backend is not None:
            detail.update(backend.describe())
        else:
            detail["endpoints"] = self.config.redacted_url()
        detail["ack"] = self.config.ack
        detail["queue_depth"] = self.writer.depth
        detail["queue_size"] = self.config.queue_size
        return detail

    def stats(self) -> dict[str, Any]:
        """Counters, errors by operation, queue depth and whether the tier is degraded."""
        return {
            **self.health.counters(),
            "errors": self.health.error_counts(),
            "queue_depth": self.writer.depth,
            "degraded": not self.health.ok,
        }

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until everything queued is written through; False on timeout."""
        return self.writer.flush(timeout_s)

    def close(self) -> None:
        """Write what is queued (bounded), stop the threads, close the client. Afterwards
        the hooks answer as for an outage (misses), and write nothing through."""
        if self._stop.is_set():
            return
        self._stop.set()
        self.writer.close(self.config.timeout_s)
        self._monitor.join(timeout=self.config.probe_interval_s * 2 + 1)
        with self._backend_lock:
            backend, self._backend = self._backend, None
        if backend is not None:
            backend.close()


def shared_tier_hooks(
    config: SharedTierConfig | str,
    metrics: Any = None,
    *,
    backend_factory: BackendFactory = make_backend,
) -> Callable[[CacheEngine], SharedTier]:
    """The ``shared_tier`` argument of :class:`CacheEngine`: starts the writer and monitor
    threads on the engine being made.

    ``config`` is a :class:`SharedTierConfig` or a URL; ``metrics`` (a ``Metrics``) gets the
    shared-tier families in its registry. ``backend_factory`` is for tests.
    """
    if isinstance(config, str):
        config = SharedTierConfig.from_url(config)
    tier_config = config

    def start(engine: CacheEngine) -> SharedTier:
        tier = SharedTier(engine, tier_config, backend_factory)
        if metrics is not None:
            from embcache.service.shared_tier.metrics import TierCollector

            metrics.registry.register(TierCollector(tier))
        return tier

    return start
