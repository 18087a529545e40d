"""CacheEngine: the one API every transport uses.

The engine is a facade: it builds its parts, owns them and calls them, and none of them
holds a reference back to it. The host store (pages, entries, reservations, leases) and
the device tier (pools and copies) keep the state; the ``Gate`` (gate.py) is the one plain
lock with the open/draining state and the pin every get starts with; the ``PutPath``
(put_path.py) validates, reserves, commits and aborts puts; ``DeviceSide`` serves the
device calls over the same gate, store, tier and put path. A call takes the gate for its
bookkeeping and lets go before it waits: bytes copied into a FILLING reservation have one
writer, and a leased entry is never freed, so neither needs the lock. Leases also expire
lazily inside calls. Reads are in reads.py, snapshots in stats.py::

    transports ──▶ CacheEngine ─┬─ PutPath ──────────────▶ HostStore  (host/)
                    │           ├─ .device: DeviceSide ──▶ DeviceTier (device/)
                    │           ├─ .stash: StashPath ────▶ HostStore (puts clients write)
                    │           ├─ .quarantine, Verifier     (and HostStore, PutPath)
                    │           └─ SharedCalls ──▶ SharedTierHooks (shared_tier/, optional)
                    └─ Gate: the lock every part above takes
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np
import torch

from embcache.errors import InvalidArgument, LeaseExpired
from embcache.proto.dtypes import from_torch
from embcache.service.config import Settings
from embcache.service.device.copier import CopyObserver
from embcache.service.device.pool import DevicePool
from embcache.service.device.tier import DeviceTier
from embcache.service.engine import listing, reads
from embcache.service.engine.device_side import DeviceSide
from embcache.service.engine.gate import Gate
from embcache.service.engine.hooks import (
    SharedCalls,
    SharedTierHooks,
    build_host_pool,
    build_store,
    build_tier,
    cuda_wanted,
)
from embcache.service.engine.put_path import PutPath
from embcache.service.engine.quarantine import QuarantineSide
from embcache.service.engine.reads import TouchWindow
from embcache.service.engine.stash_path import StashPath
from embcache.service.engine.stats import EngineStats, EntryInfo, engine_stats
from embcache.service.engine.verifier import Verifier
from embcache.service.host.host_pool import HostPool, SegmentInfo
from embcache.service.host.leases import Lease
from embcache.service.host.read_table import ReadTable
from embcache.service.host.restart import WarmStart
from embcache.service.host.store import EvictResults, HostStore, raise_for_evict

log = logging.getLogger("embcache.service.engine")


class CacheEngine:
    """The engine (module docstring). Thread-safe. Calls that reserve pages or take leases
    raise ``Draining`` once the engine drains or closes; releases and reads still work."""

    def __init__(
        self,
        settings: Settings,
        *,
        clock: Callable[[], float] = time.monotonic,
        device_pools: Sequence[DevicePool] | None = None,
        copy_observer: CopyObserver | None = None,
        shared_tier: SharedTierFactory | None = None,
        defer_verify: bool = False,
    ) -> None:
        """Allocate the host pool and the device pools (``device_pools``, closed with the
        engine; None: one per served GPU), then start the shared tier ``shared_tier`` builds.
        ``clock``: the time leases expire by; ``copy_observer``: told of every finished copy
        ``(direction, nbytes, seconds)``. ``defer_verify``: start the background check of
        entries adopted at a warm restart only at :meth:`start_verifier` (the daemon does,
        once it is ready: the pass would otherwise slow its start). PoolInUseError: a live
        daemon owns the segment."""
        self.settings = settings
        self._clock = clock
        self._uses_cuda = cuda_wanted(settings)
        warm = WarmStart(settings)
        pool = build_host_pool(settings, self._uses_cuda, warm if settings.warm_restart else None)
        try:
            self._tier = build_tier(settings, pool, device_pools, copy_observer)
        except BaseException:
            pool.close()
            raise
        self._store, self.adopted = build_store(settings, pool, self._tier, warm, clock)
        self._tier.offer_copies(self._store.reads)  # resident copies, in the read table
        self._gate = Gate(self._store, settings, clock, settings.quarantine_limit)
        self.verifier: Verifier | None = None  # checks adopted entries' bytes (verifier.py)
        if settings.warm_restart:
            self.verifier = Verifier(self._store, self._gate)
            if not defer_verify:
                self.verifier.start()
        # The parts, for tests, benchmarks and debugging; transports use the methods.
        self.host_pool: HostPool = pool
        self.host_store: HostStore = self._store
        self.device_tier: DeviceTier = self._tier
        self.quarantine = QuarantineSide(self._store, self._gate)
        self._shared = SharedCalls(self._store, self._gate)
        self._puts = PutPath(settings, self._store, self._tier, self._gate, self._shared.on_commit)
        self.begin_put = self._puts.begin  # validate a put and reserve its pages
        self.device = DeviceSide(
            self._store, self._tier, self._gate, shared=self._shared, puts=self._puts
        )
        self.stash = StashPath(settings, self._store, self._tier, self._gate, self._shared)
        self.shared_tier: SharedTierHooks | None = None  # what the factory started, if any
        if shared_tier is not None:
            try:
                self.shared_tier = self._shared.hooks = shared_tier(self)
            except BaseException:
                self.close()
                raise

    def start_verifier(self) -> None:
        """Start the background CRC32 check of adopted entries (with ``defer_verify``);
        entries read first are checked then anyway. Idempotent."""
        if self.verifier is not None and not self.verifier.thread.is_alive():
            self.verifier.start()

    def host_segment(self) -> SegmentInfo:
        """The host pool's shared-memory segment, as clients map it."""
        return self._store.pool.info()

    # -- puts (put_path.py: begin_put is the put path's own begin) ----------------------
    def put(self, key: str, tensor: torch.Tensor, *, owner: str = "local") -> bool:
        """Store a CPU tensor in one call. True if created, False if it already existed."""
        dt = from_torch(tensor.dtype)
        if dt is None:
            raise InvalidArgument("unsupported dtype", dtype=str(tensor.dtype))
        handle = self.begin_put(key, dt.name, tuple(tensor.shape), owner=owner)
        with handle:
            handle.write(tensor.detach().cpu().contiguous())
            return handle.commit()

    # -- gets and leases -----------------------------------------------------------------
    def get(
        self, keys: Sequence[str], owner: str, *, ttl_s: float | None = None
    ) -> list[Lease | None]:
        """Lease every key found (with a shared tier, local misses are fetched first);
        leased entries are never evicted.

        Args:
            owner: who holds the leases (a session id, ...); they end with it.
            ttl_s: lease lifetime (the settings' ``lease_ttl_s`` when None).
        Returns:
            Per key, its lease, or None for a miss.
        Raises:
            InvalidArgument: ``ttl_s`` is not positive, or above ``max_lease_ttl_s``.
        """
        self.fill_misses(keys)
        expires = self._gate.expiry(ttl_s)
        with self._gate:
            entries = self._gate.pin(keys, owner)
            return self._store.lease(entries, owner, self._clock() + expires)

    def fill_misses(self, keys: Sequence[str]) -> None:
        """Ask the shared tier (if any) for keys missing here; never raises. It may wait
        on the network: callers on an event loop run it in a thread."""
        self._shared.fill_misses(keys)

    @property
    def fetches_misses(self) -> bool:
        """True when gets may wait on the shared tier for local misses."""
        return self._shared.hooks is not None

    def touch(self, keys: Sequence[str], window: TouchWindow | None = None) -> int:
        """Count hits that same-node clients served from the read table and mark those
        entries just used (``docs/same_node_reads.md``); returns how many are still here.
        ``window``: the session's, so that it counts each key once a window (reads.py)."""
        with self._gate:
            now = self._clock()
            if window is None:
                return self._store.touch(keys, now)
            cached = [k for k in keys if self._store.peek(k) is not None]
            self._store.touch(window.fresh(cached, now), now)
            return len(cached)

    @property
    def read_table(self) -> ReadTable | None:
        """The read table same-node clients copy entries from (None: off, or it could not
        be made)."""
        return self._store.reads

    def release(self, lease_ids: Iterable[int], owner: str | None = None) -> int:
        """End leases (with ``owner``: its own only; others skipped); returns how many."""
        with self._gate:
            return self._store.release(lease_ids, owner)

    def renew(
        self, lease_ids: Iterable[int], ttl_s: float | None = None, owner: str | None = None
    ) -> int:
        """Push back the expiry of live leases (with ``owner``: its own) to ``ttl_s`` from
        now; returns how many."""
        expires = self._gate.expiry(ttl_s)
        with self._gate:
            now = self._clock()
            self._store.expire(now)
            return self._store.renew(lease_ids, now + expires, owner)

    def lease_alive(self, lease: Lease) -> bool:
        with self._gate:
            return self._store.alive(lease, self._clock())

    def drop_owner(self, owner: str) -> int:
        """End every lease of ``owner`` by force (``quarantine.end_owner``); how many ended."""
        return self.quarantine.end_owner(owner)

    def lease_owners(self, prefixes: tuple[str, ...]) -> dict[str, tuple[int, int]]:
        """``(leases, leased bytes)`` of every owner named with one of ``prefixes`` that holds
        leases (operators list the callers without a session this way)."""
        with self._gate:
            table = self._store.leases
            return {owner: table.usage(owner) for owner in table.owners_named(prefixes)}

    def lease_usage(self, owner: str) -> tuple[int, int]:
        """``(leases, bytes of the distinct entries leased)`` that ``owner`` holds."""
        with self._gate:
            return self._store.leases.usage(owner)

    def expire_leases(self) -> int:
        """End the leases whose TTL has passed (the daemon's reaper calls this)."""
        with self._gate:
            return self._store.expire(self._clock())

    # -- reading bytes (reads.py) --------------------------------------------------------
    def tensor(self, lease: Lease) -> torch.Tensor:
        """The entry: a view of the pool (one run) or a copy; LeaseExpired once it ended."""
        self._require(lease)
        out = reads.as_tensor(self._store.pool, lease)
        self._require(lease)  # copied while the lease lived, so no page was reused
        return out

    def iter_bytes(
        self, lease: Lease, offset: int = 0, length: int | None = None,
        chunk_bytes: int = 1 << 20, copy: Callable[[memoryview], bytes] = bytes,
    ) -> Iterator[bytes]:  # fmt: skip
        """The entry's bytes ``[offset, offset+length)`` in chunks, each ``copy`` of a view of
        the pool made while the lease lives (``proto.framing.encode_chunk``: the chunk as a
        serialized message). Raises InvalidArgument (range outside the entry), LeaseExpired."""
        pool, require = self._store.pool, self._require
        return reads.iter_bytes(pool, lease, offset, length, chunk_bytes, require, copy)

    def _require(self, lease: Lease) -> None:
        if not self.lease_alive(lease):
            raise LeaseExpired("lease has ended", lease_id=lease.lease_id, key=lease.key)

    # -- exists and eviction -------------------------------------------------------------
    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key can be served; with a shared tier, local misses ask it too."""
        with self._gate:
            found = self._store.lookup  # an adopted entry is checked first (restart.py)
            out = [isinstance(k, str) and found(k) is not None for k in keys]
        return self._shared.exists(keys, out)

    def held(self, keys: Sequence[object]) -> bool:
        """Whether this daemon holds every one of ``keys`` now (no shared tier asked)."""
        with self._gate:
            found = self._store.lookup
            return all(isinstance(k, str) and found(k) is not None for k in keys)

    def evict(self, keys: Sequence[str]) -> EvictResults:
        """Evict each key unless it is leased (never forced); with the host bytes freed."""
        with self._gate:
            return self._store.evict_keys(keys, self._clock())

    def evict_one(self, key: str) -> int:
        """Evict one key (the host bytes freed): NotFound if absent, EntryLeased if leased."""
        out = self.evict([key])
        raise_for_evict(key, out[0])
        return out.freed_bytes

    def evict_bytes(self, nbytes: int) -> tuple[int, int]:
        """Evict LRU entries until ``nbytes`` are freed or none is left: (entries, bytes)."""
        if nbytes < 0:
            raise InvalidArgument("nbytes must be >= 0", nbytes=nbytes)
        with self._gate:
            self._store.expire(self._clock())
            return self._store.evict_bytes(nbytes)

    def prefetch(self, keys: Sequence[str], *, device: int | None = None) -> dict[str, int]:
        """Warm the local tiers: fetch misses from the shared tier and, with ``device``, make
        the keys resident there. Returns the Prefetch counts; raises for a bad ``device`` only."""
        return self._shared.prefetch(keys, device, self.exists, self.device.warm)

    # -- introspection -------------------------------------------------------------------
    def stats(self) -> EngineStats:
        with self._gate:
            self._store.expire(self._clock())
            return engine_stats(self._store.counts(), self._tier, draining=self._gate.draining)

    def entry_info(self, key: str) -> EntryInfo | None:
        """Metadata, page runs, residency and lease holders of one READY entry."""
        with self._gate:
            return listing.entry_detail(self._store, self._tier, self._clock(), key)

    def list_entries(
        self, offset: int = 0, limit: int = 100, state: str | None = None,
        *, tier: str | None = None, sort: str = "none",
    ) -> tuple[int, list[EntryInfo]]:  # fmt: skip
        """``(total, entries[offset:offset+limit])`` of those in ``state`` with a copy on
        ``tier``, ordered by ``sort`` (``listing.Query``); the lock is held a slice at a time."""
        query = listing.Query(offset, limit, state, tier, sort)
        return listing.list_entries(self._gate, self._store, self._tier, self._clock, query)

    def page_states(self) -> np.ndarray:
        """One uint8 per host page: 0 free, 1 filling, 2 ready, 3 leased."""
        with self._gate:
            return self._store.page_states()

    # -- life cycle ----------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        """Pools allocated (and registered with CUDA where CUDA is used), not draining."""
        pool = self._store.pool
        pinned = pool.registered or not self._uses_cuda
        return not self._gate.closed and not self._gate.draining and not pool.closed and pinned

    @property
    def draining(self) -> bool:
        return self._gate.draining

    @property
    def closed(self) -> bool:
        return self._gate.closed

    def begin_drain(self) -> None:
        """Refuse new puts and gets; in-flight puts may still commit."""
        with self._gate:
            self._gate.draining = True
            if self._store.reads is not None:
                self._store.reads.shut()  # clients' gets are calls again: refused while draining

    def close(self, *, keep_segment: bool = False) -> None:
        """Stop the shared tier, drop every lease and reservation, and remove the
        shared-memory segment and its index (``keep_segment``: leave both for a warm
        restart, ``docs/restart.md``). Idempotent."""
        self._shared.close()
        with self._gate:
            if self._gate.closed:
                return
            self._gate.closed = True
            self._gate.draining = True
            index = self._store.drop_all()  # lets go of the index first: its holds stay
        keep = keep_segment and index is not None and index.active
        if index is not None:
            index.close() if keep else index.remove()
        if self._store.reads is not None:
            self._store.reads.remove()
        self._tier.close()
        self._store.pool.close(unlink=not keep)

    def __enter__(self) -> CacheEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# Builds the shared tier's hooks for an engine being made (the tier fills and reads it).
SharedTierFactory = Callable[[CacheEngine], SharedTierHooks]
