"""The engine's device side (``engine.device``): gets into device pools and client buffers,
puts from device memory, and the pools' housekeeping.

It works on the engine's own parts, under the engine's gate (``gate.py``: its one lock):
the gate pins entries in the host store, the device tier places them and queues the
copies, the store leases them, and the lock is let go before anything waits for a copy.
Puts go through the engine's ``PutPath``. Owned and built by :class:`CacheEngine`, which
hands it its parts; it holds no state of its own and no reference to the engine.

Devices are named by pool index (``index_for`` maps a GPU's uuid to one); an index is the
pool's place in the device tier, not a CUDA ordinal. Every call that names a pool raises
DeviceUnavailable when there is none, and the calls that copy into it also when a device
error took it out of service. Calls that lease or reserve raise Draining once the engine
drains. Puts from device memory are described in ``device_puts.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from embcache.errors import InvalidArgument
from embcache.service.device.into import check_destination
from embcache.service.device.pending_get import DeviceLease, PendingGet, Placement
from embcache.service.device.pool import DevicePool
from embcache.service.device.tier import DeviceTier
from embcache.service.engine.device_into import PendingInto
from embcache.service.engine.device_puts import PendingPut, PutTarget, start_puts
from embcache.service.engine.gate import Gate
from embcache.service.engine.hooks import SharedCalls
from embcache.service.host.leases import Lease
from embcache.service.host.store import SHARED_TIER_OWNER, EvictOutcome, EvictResults, HostStore


class DeviceSide:
    """The device calls of the engine (module docstring)."""

    def __init__(
        self,
        store: HostStore,
        tier: DeviceTier,
        gate: Gate,
        *,
        shared: SharedCalls,
        puts: PutTarget,
    ) -> None:
        self._store = store
        self._tier = tier
        self._gate = gate  # the lock; checks the engine is open, expires leases, pins
        self._fill_misses = shared.fill_misses  # the shared tier, outside the lock
        self._puts = puts  # the engine's put path, for puts from a device

    # -- pools ---------------------------------------------------------------------------
    @property
    def pools(self) -> tuple[DevicePool, ...]:
        """Every device pool, in service or not, by index."""
        return tuple(self._tier.pools)

    def pool(self, device: int) -> DevicePool:
        """Device pool ``device`` (in service or not), to describe it to clients."""
        return self._tier.at(device)

    def index_for(self, gpu_uuid: str) -> int:
        """The index of the device pool serving this GPU; DeviceUnavailable if none does."""
        return self._tier.pool_for(gpu_uuid)[0]

    # -- get to device -------------------------------------------------------------------
    def get(
        self,
        keys: Sequence[str],
        owner: str,
        *,
        ttl_s: float | None = None,
        device: int = 0,
        read_table: bool = False,
    ) -> tuple[list[DeviceLease | None], torch.Tensor | None]:
        """Lease each key and make it resident in device pool ``device``; returns once the
        copies are complete. Misses are asked of the shared tier first, if there is one.

        Args:
            owner: who holds the leases; they end with it (or by ``ttl_s``, or release).
            read_table: also build the batch's physical page table on the device.
        Returns:
            Per key its DeviceLease (None for a miss) and, with ``read_table``, the table
            ``build_read_table`` made (one row per found entry), else None.
        Raises:
            PoolExhausted: the pool cannot hold the batch (every other copy is leased).
            DeviceUnavailable: no such pool, or a device error took it out of service.
            InvalidArgument: a bad ``ttl_s``. On any error no lease is left behind.
        """
        placement, pending = self._start(keys, owner, ttl_s, device, True, False)
        try:
            table = None
            if read_table:
                with self._gate:
                    table = self._tier.read_table(placement)
            self._tier.wait(pending, device)
            if not all(d is None or d.resident_hit for d in pending.results):
                with self._gate:  # the copies are complete: same-node clients may read them
                    self._tier.offer_done(device)
            return pending.results, table
        except BaseException:  # nobody receives these leases
            with self._gate:
                self._store.release(d.lease.lease_id for d in pending.results if d is not None)
            raise

    def start_get(
        self,
        keys: Sequence[str],
        owner: str,
        *,
        ttl_s: float | None = None,
        device: int = 0,
        fill_misses: bool = True,
        defer_tables: bool = False,
    ) -> PendingGet:
        """:meth:`get` without waiting for the copies, for callers that wait their own way
        (an event loop).

        Args:
            fill_misses: False when the caller asked the shared tier already (that may wait
                on the network; this call then waits only for the lock).
            defer_tables: leave the page-table updates and the free-reserve evictions for
                :meth:`housekeeping`, run later, off the caller's critical path.
        Returns:
            The pending get. Hand out ``pending.results`` only once ``pending.done()`` or
            ``pending.wait()``; the leases are the caller's either way (release them if it
            gives up).
        Raises:
            As :meth:`get`, before anything is leased.
        """
        return self._start(keys, owner, ttl_s, device, fill_misses, defer_tables)[1]

    def _start(
        self,
        keys: Sequence[str],
        owner: str,
        ttl_s: float | None,
        device: int,
        fill_misses: bool,
        defer_tables: bool,
    ) -> tuple[Placement, PendingGet]:
        if fill_misses:
            self._fill_misses(keys)
        ttl = self._gate.expiry(ttl_s)
        with self._gate:
            entries = self._gate.pin(keys, owner)
            try:
                placement = self._tier.place(entries, device, defer_tables=defer_tables)
            except BaseException:
                self._store.unpin(entries)
                raise
            leases = self._store.lease(entries, owner, self._store.clock() + ttl)
            return placement, self._tier.pending(placement, leases)

    def warm(self, keys: Sequence[str], device: int) -> int:
        """Make ``keys`` resident in device pool ``device`` (no lease is kept, and the
        gets are not counted as hits); returns how many were found. Raises as :meth:`get`."""
        if not keys:
            return 0
        placed, _ = self.get(keys, SHARED_TIER_OWNER, device=device)
        with self._gate:
            self._store.release(p.lease.lease_id for p in placed if p is not None)
        return sum(1 for p in placed if p is not None)

    def ready_event(self, pending: PendingGet, device: int = 0) -> bytes | None:
        """For a client that waits on the GPU: an interprocess event handle that fires once
        ``pending``'s copies are complete (None: complete already, or not on a GPU), so the
        reply need not wait for them (``device/ready_events.py``)."""
        return self._tier.ready_event(pending, device)

    # -- housekeeping --------------------------------------------------------------------
    def flush_tables(self, device: int = 0) -> None:
        """Evict device ``device``'s copies down to its free reserve, then launch its queued
        page-table updates now (tests call it before they read the tables)."""
        with self._gate:
            self._tier.flush_tables(device)

    def housekeeping(self, device: int = 0) -> None:
        """After a ``defer_tables`` get's reply: evict device ``device``'s copies down to its
        free reserve, and launch its page-table updates once they are due."""
        with self._gate:
            self._tier.flush_tables(device, when_due=True)

    def flush_due(self) -> int:
        """Launch the page-table updates that are due in any pool (the daemon's reaper calls
        this, so the tables catch up once gets stop); returns how many pools did. A device
        error takes that pool out of service instead of raising."""
        with self._gate:
            return self._tier.flush_due()

    def evict(self, keys: Sequence[str], device: int) -> EvictResults:
        """Drop each key's copy in device pool ``device``; its host copy stays.

        Returns:
            Per key EVICTED; NOT_FOUND (no such entry, or no copy there); or LEASED
            (refused, never forced); and ``freed_bytes`` of that pool's pages.
        """
        with self._gate:
            self._store.expire(self._store.clock())
            out = self._store.evictable(keys)
            todo = [entry for _, entry in out if entry is not None]
            freed = self._tier.evict_copies(todo, device)
            had = iter(freed)
            outcomes = [
                EvictOutcome.NOT_FOUND if entry is not None and next(had) is None else outcome
                for outcome, entry in out
            ]
            return EvictResults(outcomes, sum(n for n in freed if n is not None))

    def evict_bytes(self, device: int, nbytes: int) -> tuple[int, int]:
        """Free ``nbytes`` of device pool ``device`` by LRU over its unleased copies (host
        copies stay); returns ``(entries, bytes of pages freed)``. InvalidArgument for
        ``nbytes`` < 0."""
        if nbytes < 0:
            raise InvalidArgument("nbytes must be >= 0", nbytes=nbytes)
        with self._gate:
            self._store.expire(self._store.clock())
            return self._tier.evict_pool_bytes(device, nbytes)

    def page_states(self, device: int = 0) -> np.ndarray:
        """One uint8 per page of device pool ``device``: 0 free, 1 resident, 2 leased (a pool
        out of service holds nothing). DeviceUnavailable when there is no such pool."""
        self._tier.at(device)
        with self._gate:
            return self._tier.page_states(device)

    # -- get into a client buffer --------------------------------------------------------
    def get_into(
        self,
        keys: Sequence[str],
        owner: str,
        dest: torch.Tensor,
        offsets: Sequence[int],
        *,
        device: int | None = None,
        dest_ready: bool = False,
    ) -> list[Lease | None]:
        """Copy each entry found into ``dest`` at its offset and return once the copies are
        complete: :meth:`start_into` (``dest_ready`` as there), then wait and finish.
        Returns per key its lease (ended by the time this returns), or None for a miss."""
        pending = self.start_into(keys, owner, dest, offsets, device=device, dest_ready=dest_ready)
        try:
            pending.wait()
        finally:
            pending.finish()
        return pending.leases

    def start_into(
        self,
        keys: Sequence[str],
        owner: str,
        dest: torch.Tensor,
        offsets: Sequence[int],
        *,
        device: int | None = None,
        fill_misses: bool = True,
        dest_ready: bool = False,
    ) -> PendingInto:
        """Lease the entries found and queue their copies into ``dest`` at their offsets,
        from device pool ``device`` where they are resident there (and loaded), else from
        the host pool; the caller finishes the result once its copies are complete.

        Args:
            dest: a flat contiguous uint8 buffer (a client's memory the daemon mapped, or
                this process's own); ``offsets``: one byte offset per key.
            device: the pool on ``dest``'s GPU, if there is one (None: host copies only).
            fill_misses: fetch misses from the shared tier first (False: the caller did).
            dest_ready: nothing in this process writes ``dest`` on its current stream (a
                client's buffer, ordered by the client's event), so the copies follow
                nothing; by default they follow the work queued on it so far.
        Raises:
            InvalidArgument: a bad ``dest``, an offset count that is not one per key, or a
                slot that does not fit or overlaps another (checked before any copy; no
                lease is left behind).
            DeviceUnavailable: no pool ``device``, or out of service.
        """
        check_destination(dest, len(keys), len(offsets))
        if device is not None:
            self._tier.pool(device)  # no such pool: fail before anything else
        if fill_misses:
            self._fill_misses(keys)
        ttl = self._gate.expiry(None)
        with self._gate:
            entries = self._gate.pin(keys, owner)
            leases = self._store.lease(entries, owner, self._store.clock() + ttl)
            try:
                stream = self._tier.queue_into(leases, dest, offsets, device, dest_ready=dest_ready)
                event = self._tier.copier.record(stream)
            except BaseException:
                self._store.release([x.lease_id for x in leases if x is not None])
                raise
        observe = self._tier.copier.observe
        return PendingInto(leases, event, self._store.release, observe, self._gate)

    # -- puts from device memory (device_puts.py) ----------------------------------------
    def put(
        self,
        key: str,
        src: torch.Tensor,
        *,
        owner: str = "local",
        checksum: int | None = None,
        src_ready: bool = False,
    ) -> bool:
        """Store a (device) tensor; returns once its bytes are in the host pool.

        Args:
            src: a contiguous tensor, on a GPU or the CPU. Its copy follows the work queued
                so far on the current stream.
            checksum: a CRC32 the copied bytes must match (None: not checked).
            src_ready: the caller knows ``src`` is written already (e.g. it waited for its
                producer's event), so the copy follows nothing.
        Returns:
            True if created, False if an identical entry existed already.
        Raises:
            InvalidArgument: a dtype the cache does not take, or a tensor not contiguous.
            ChecksumMismatch: the copied bytes do not match ``checksum``.
            And the errors of :meth:`CacheEngine.begin_put`; nothing becomes visible.
        """
        items = [(key, src)]
        pending = start_puts(self._puts, self._tier, items, owner, [checksum], src_ready=src_ready)
        return pending.finish()[0]

    def put_many(
        self,
        items: Sequence[tuple[str, torch.Tensor]],
        *,
        owner: str = "local",
        checksums: Sequence[int | None] | None = None,
        src_ready: bool = False,
    ) -> list[bool]:
        """Store several (device) tensors, ``(key, tensor)`` each, with one wait; all or
        nothing: an error (a checksum mismatch included) leaves none of the batch visible.

        Args:
            items: distinct keys, each with a tensor as :meth:`put` takes.
            checksums: a CRC32 or None per item (None: none checked).
        Returns:
            Per item, True if created, False if an identical entry existed already.
        Raises:
            InvalidArgument: a key twice, a checksum count that does not match, or an item
                :meth:`put` would refuse. ChecksumMismatch, and ``begin_put``'s errors.
        """
        pending = start_puts(self._puts, self._tier, items, owner, checksums, src_ready=src_ready)
        return pending.finish()

    def start_put_many(
        self,
        items: Sequence[tuple[str, torch.Tensor]],
        *,
        owner: str = "local",
        checksums: Sequence[int | None] | None = None,
        src_ready: bool = False,
    ) -> PendingPut:
        """:meth:`put_many` without waiting for the copies (an event loop polls).

        Returns:
            The pending batch: ``pending.finish()`` (once ``pending.done()``, or it waits)
            checks the checksums and commits, ``pending.abort()`` gives it up. The tensors
            must stay readable until either returns.
        Raises:
            As :meth:`put_many` but ChecksumMismatch, which ``finish()`` raises; nothing
            stays reserved then.
        """
        return start_puts(self._puts, self._tier, items, owner, checksums, src_ready=src_ready)
