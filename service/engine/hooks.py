"""What the engine is built from: its host pool, its device tier (with one pool per served
GPU), and the shared tier's hooks."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from embcache.service.config import Settings
from embcache.service.device.copier import CopyObserver
from embcache.service.device.pool import DevicePool
from embcache.service.device.tier import DeviceTier
from embcache.service.engine.gate import Gate
from embcache.service.host.adoption import Adopted
from embcache.service.host.host_pool import SHM_DIR, HostPool, unique_host_pool
from embcache.service.host.leases import LeaseCaps
from embcache.service.host.pool_index import index_path
from embcache.service.host.read_table import ReadTable, buckets_for
from embcache.service.host.restart import WarmStart, find_stale
from embcache.service.host.shm_files import UntrustedFile, clear_own
from embcache.service.host.store import HostStore

log = logging.getLogger("embcache.service.engine")


class PrefetchCounts(Protocol):
    """What a shared tier's prefetch returns: counts, as the Prefetch call reports them."""

    def to_dict(self) -> dict[str, int]: ...


class SharedTierHooks(Protocol):
    """The calls the engine makes to a shared tier across nodes (``shared_tier/``).

    None of them may fail a local operation: an outage is a miss."""

    def fetch(self, keys: list[str]) -> None:
        """Bring local misses into the host pool, if the shared tier has them."""

    def exists(self, keys: list[str]) -> list[bool]:
        """Whether the shared tier holds each of these local misses."""
        ...

    def on_commit(self, key: str, owner: str) -> None:
        """A new local entry (to write through)."""

    def prefetch(self, keys: Sequence[str], *, device: int | None = None) -> PrefetchCounts:
        """Warm the local tiers; the counts the Prefetch call reports."""
        ...

    def close(self) -> None:
        """Stop: write what is queued (bounded) and let go of the store."""


class SharedCalls:
    """The engine's calls to its shared tier, if it has one: an outage of the tier is
    logged and answered as a miss, never raised into a local operation. ``store`` and
    ``gate`` are the engine's (misses are looked up under the gate, fetched outside it)."""

    def __init__(self, store: HostStore, gate: Gate, hooks: SharedTierHooks | None = None) -> None:
        self._store = store
        self._gate = gate
        self.hooks = hooks

    def fill_misses(self, keys: Sequence[str]) -> None:
        """Ask the shared tier (if any) for keys missing here; never raises. It may wait
        on the network: callers on an event loop run it in a thread."""
        if self.hooks is not None:
            with self._gate:
                found = self._store.peek
                missing = [k for k in keys if isinstance(k, str) and found(k) is None]
            self.fetch(missing)

    def fetch(self, missing: list[str]) -> None:
        """Ask the tier for local misses (each once); a failure is logged, never raised."""
        if self.hooks is None or not missing:
            return
        try:
            self.hooks.fetch(list(dict.fromkeys(missing)))
        except Exception:
            log.warning("shared tier fetch failed for %d keys", len(missing), exc_info=True)

    def exists(self, keys: Sequence[object], local: list[bool]) -> list[bool]:
        """``local`` with each local miss answered by the shared tier."""
        if self.hooks is None or all(local):
            return local
        out = list(local)
        idx = [i for i, hit in enumerate(out) if not hit and isinstance(keys[i], str)]
        try:
            for i, hit in zip(idx, self.hooks.exists([str(keys[i]) for i in idx]), strict=True):
                out[i] = bool(hit)
        except Exception:
            log.warning("shared tier exists failed", exc_info=True)
            return local
        return out

    def on_commit(self, key: str, owner: str) -> None:
        """Tell the tier of a new entry (write-through); a failure is logged, never raised."""
        if self.hooks is None:
            return
        try:
            self.hooks.on_commit(key, owner)
        except Exception:  # the write-through never fails the put
            log.exception("shared tier write-through failed for %r", key)

    def prefetch(
        self,
        keys: Sequence[str],
        device: int | None,
        exists: Callable[[list[str]], list[bool]],
        warm: Callable[[list[str], int], int],
    ) -> dict[str, int]:
        """The Prefetch call's counts: the shared tier's, or without one, of the keys found
        here (``exists``) and made resident in ``device`` (``warm``)."""
        if self.hooks is not None:
            return self.hooks.prefetch(keys, device=device).to_dict()
        wanted = list(dict.fromkeys(k for k in keys if isinstance(k, str)))
        present = [k for k, hit in zip(wanted, exists(wanted), strict=True) if hit]
        resident = warm(present, device) if device is not None else 0
        return {
            "requested": len(wanted),
            "local": len(present),
            "fetched": 0,
            "missing": len(wanted) - len(present),
            "resident": resident,
        }

    def close(self) -> None:
        """Stop the tier (it writes what it has queued while the pool is still mapped)."""
        hooks, self.hooks = self.hooks, None
        if hooks is not None:
            hooks.close()


def cuda_wanted(settings: Settings) -> bool:
    """Whether the engine uses CUDA: ``device`` is cuda, or auto and a GPU is visible."""
    if settings.device == "cpu":
        return False
    available = torch.cuda.is_available()
    if settings.device == "cuda" and not available:
        raise RuntimeError("device=cuda but no CUDA device is available")
    return available


def default_device_pools(settings: Settings) -> list[DevicePool]:
    """One device pool per served GPU when a device pool size is set and CUDA is used."""
    if settings.device_pool_bytes == 0 or not cuda_wanted(settings):
        return []
    gpus = settings.gpu_indices(torch.cuda.device_count())
    pools: list[DevicePool] = []
    try:
        for index, gpu in enumerate(gpus):
            pools.append(
                DevicePool(
                    torch.device("cuda", gpu),
                    settings.device_pool_bytes,
                    settings.device_page_bytes,
                    ipc_mode=settings.ipc_mode,
                    index=index,
                    peers=[g for g in gpus if g != gpu],
                )
            )
    except BaseException:
        for pool in pools:
            pool.close()
        raise
    return pools


def build_tier(
    settings: Settings,
    host: HostPool,
    device_pools: Sequence[DevicePool] | None,
    copy_observer: CopyObserver | None,
) -> DeviceTier:
    """The device tier over ``device_pools`` (the default ones when None). If it cannot be
    built, the default pools made here are closed; a caller's pools stay the caller's."""
    pools: Sequence[DevicePool] = ()
    try:
        pools = default_device_pools(settings) if device_pools is None else device_pools
        return DeviceTier(pools, host, settings.device_config(), copy_observer=copy_observer)
    except BaseException:
        if device_pools is None:
            for pool in pools:
                pool.close()
        raise


def build_host_pool(settings: Settings, uses_cuda: bool, warm: WarmStart | None = None) -> HostPool:
    """The host pool's shared-memory segment, registered with CUDA when it is used: named
    ``shm_name`` when one is set, else ``embcache-<port>-<random>`` (``unique_host_pool``).
    With ``warm``, a stale segment whose index ``warm`` accepts is adopted (without a
    ``shm_name``: the newest stale one of this port); without, a stale index goes."""
    size, page, mode = settings.host_pool_bytes, settings.page_bytes, int(settings.shm_mode, 8)
    name = settings.shm_name
    if warm is not None and not name:
        name = find_stale(settings.shm_prefix, SHM_DIR) or ""
    if name:
        keep = warm.keep(SHM_DIR / name) if warm is not None else None
        pool = HostPool(name, size, page, register_cuda=uses_cuda, mode=mode, keep=keep)
        if keep is None:  # ours now (locked), and cold: an old index would lie
            try:
                clear_own(index_path(pool.path))
            except UntrustedFile as exc:  # another user's: left alone, never read
                log.error("warm-restart index beside %s: %s", pool.name, exc)
        return pool
    return unique_host_pool(settings.shm_prefix, size, page, register_cuda=uses_cuda, mode=mode)


def open_read_table(pool: HostPool, settings: Settings) -> ReadTable | None:
    """The read table beside ``pool``'s segment, readable as the segment is; None (gets are
    calls, as with ``read_table`` off) when it cannot be made, which is logged."""
    try:
        return ReadTable.create(
            pool.path,
            num_buckets=buckets_for(settings.entry_limit),
            page_bytes=pool.page_bytes,
            mode=int(settings.shm_mode, 8),
        )
    except OSError as exc:
        log.warning("no read table beside %s (gets stay calls): %s", pool.name, exc)
        return None


def build_store(
    settings: Settings,
    pool: HostPool,
    tier: DeviceTier,
    warm: WarmStart,
    clock: Callable[[], float],
) -> tuple[HostStore, Adopted]:
    """The engine's host store over ``pool`` (``tier`` drops an entry's device copies
    before it is evicted): with warm restart on, built from what ``warm`` adopts of the
    segment the pool kept, else empty. On an error the tier and the pool are closed (the
    segment kept for the next start)."""
    parts = dict(
        prealloc_pages=settings.device_put_prealloc_bytes // settings.page_bytes,
        on_evict=tier.drop,
        clock=clock,
        caps=LeaseCaps(settings.max_leases_per_owner, settings.leased_bytes_limit),
        max_entries=settings.entry_limit,
        reads=open_read_table(pool, settings) if settings.read_table else None,
    )
    if not settings.warm_restart:
        return HostStore(pool, **parts), Adopted()  # type: ignore[arg-type]
    try:
        adoption = warm.attach(pool)
    except BaseException:
        tier.close()
        pool.close(unlink=False)
        raise
    return HostStore.adopting(pool, adoption, clock(), **parts), adoption.adopted
