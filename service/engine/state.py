"""The state every part of :class:`~embcache.service.engine.CacheEngine` shares.

The engine is one object made of parts, each in a module of its own: puts
(``engine_puts.py``), gets, leases and reading bytes (``engine_leases.py``), exists and
eviction (``engine_evict.py``). They share the tables below, guarded by ``_lock`` (see
``engine.py``), and call each other only through the methods declared here.
"""

from __future__ import annotations

import itertools
import threading
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from embcache.service.config import Settings
from embcache.service.host.allocator import PageRunAllocator
from embcache.service.host.entries import Entry, EntryTable
from embcache.service.host.host_pool import HostPool
from embcache.service.host.leases import LeaseTable
from embcache.service.host.prealloc import PutLanding

if TYPE_CHECKING:
    from embcache.service.device.tier import DeviceTier


class EngineState:
    """Attributes made by ``CacheEngine.__init__``, and the methods the parts share."""

    settings: Settings
    host_pool: HostPool
    device_tier: DeviceTier
    _clock: Callable[[], float]
    _lock: threading.RLock
    _alloc: PageRunAllocator
    _landing: PutLanding  # host pages on loan to puts from a device (put_landing.py)
    _entries: EntryTable
    _filling: dict[int, tuple[Entry, str]]  # put id -> (entry, owner)
    _put_ids: itertools.count[int]
    _inflight: Counter[str]  # owner -> bytes reserved in open puts
    _leases: LeaseTable
    _runs_hist: Counter[str]
    _counters: Counter[str]
    _draining: bool
    _closed: bool
    miss_fetcher: Callable[[list[str]], None] | None
    remote_exists: Callable[[list[str]], list[bool]] | None
    commit_listeners: list[Callable[[str, str], None]]
    shared_tier: Any

    @property
    def closed(self) -> bool:
        return self._closed

    if TYPE_CHECKING:  # defined by the part named; declared here for the type checker

        def _check_open(self) -> None: ...  # engine.py

        def _expire_locked(self, now: float) -> int: ...  # engine_leases.py

        def _evict_locked(self, entry: Entry) -> None: ...  # engine_evict.py
