"""Random put/abort/get/release/evict/expire sequences against a model of the cache.

Puts from a "device" (CPU tensors here) go through the put landing when they fit in it
(``put_landing.py``): its pages must never overlap an entry's, and must count as free."""

from __future__ import annotations

import uuid

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from embcache.errors import MetadataConflict, PoolExhausted, QuotaExceeded
from embcache.service.config import Settings
from embcache.service.engine import CacheEngine, EvictOutcome

PAGE = 4096
NUM_PAGES = 32
KEYS = [f"key-{i}" for i in range(10)]
# Each key has fixed metadata (the collision guard is tested separately below).
SIZES = {k: (i * 5003) % (11 * PAGE) for i, k in enumerate(KEYS)}


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


class CacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        s = Settings(
            host_pool_bytes=NUM_PAGES * PAGE,
            page_bytes=PAGE,
            lease_ttl_s=5,
            shm_name=f"embcache-sm-{uuid.uuid4().hex[:12]}",
        )
        self.engine = CacheEngine(s, clock=self.clock)
        # A landing of a quarter of the pool (the engine caps it at 1/16: 2 pages here), so
        # most keys' puts from a device fit in it and it is often drained for room.
        self.engine.host_store.prealloc.max_pages = NUM_PAGES // 4
        self.content: dict[str, bytes] = {}  # what a reader must see for each visible key
        self.leases: list = []  # live leases (not released, maybe expired)
        self.handles: list = []  # open puts: (handle, payload)
        self.rng = np.random.default_rng(0)

    def payload(self, key: str) -> bytes:
        return self.rng.integers(0, 256, SIZES[key], dtype=np.uint8).tobytes()

    # -- rules ---------------------------------------------------------------------------
    @rule(key=st.sampled_from(KEYS), from_device=st.booleans())
    def put(self, key: str, from_device: bool) -> None:
        self.sync()
        data = self.payload(key)
        try:
            if from_device:  # a CPU "device" tensor, through the put landing when it fits
                created = self.engine.device.put(key, torch.tensor(np.frombuffer(data, np.uint8)))
            else:
                h = self.engine.begin_put(key, "uint8", (len(data),))
                h.write(data)
                created = h.commit()
        except PoolExhausted:
            assert self.pinned_pages() + self.filling_pages() + self.pages(key) > NUM_PAGES
            return
        except QuotaExceeded:
            assert (self.filling_pages() + self.pages(key)) * PAGE > NUM_PAGES * PAGE - PAGE
            return
        if created:
            assert key not in self.content
            self.content[key] = data

    @rule(key=st.sampled_from(KEYS), fraction=st.floats(0, 1))
    def begin_partial(self, key: str, fraction: float) -> None:
        data = self.payload(key)
        try:
            h = self.engine.begin_put(key, "uint8", (len(data),))
        except (PoolExhausted, QuotaExceeded):  # quota = pool size by default
            return
        h.write(data[: int(len(data) * fraction)])
        self.handles.append((h, data))

    @precondition(lambda self: self.handles)
    @rule(i=st.integers(0, 100), commit=st.booleans())
    def finish_partial(self, i: int, commit: bool) -> None:
        self.sync()
        h, data = self.handles.pop(i % len(self.handles))
        if not commit:
            h.abort()
            return
        h.write(data[h.written :])
        if h.commit():
            self.content[h.key] = data
        # False: an identical entry existed at begin_put (it may have been evicted since)

    @rule(
        keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4),
        ttl=st.sampled_from([None, 1.0, 20.0]),
    )
    def get(self, keys: list[str], ttl: float | None) -> None:
        self.sync()
        for key, lease in zip(keys, self.engine.get(keys, "owner", ttl_s=ttl), strict=True):
            assert (lease is not None) == (key in self.content)
            if lease is not None:
                self.leases.append(lease)
                assert (
                    bytes(
                        self.engine.tensor(lease)
                        .view(-1)
                        .view(dtype=__import__("torch").uint8)
                        .numpy()
                    )
                    == self.content[key]
                )

    @precondition(lambda self: self.leases)
    @rule(i=st.integers(0, 100))
    def release(self, i: int) -> None:
        lease = self.leases.pop(i % len(self.leases))
        alive = lease.expires_at > self.clock.now
        assert self.engine.release([lease.lease_id]) in ((1,) if alive else (0, 1))

    @rule(key=st.sampled_from(KEYS))
    def evict(self, key: str) -> None:
        self.sync()
        [outcome] = self.engine.evict([key])
        leased = any(ls.key == key and ls.expires_at > self.clock.now for ls in self.leases)
        if key not in self.content:
            assert outcome is EvictOutcome.NOT_FOUND
        elif leased:
            assert outcome is EvictOutcome.LEASED
        else:
            assert outcome is EvictOutcome.EVICTED
            del self.content[key]

    @rule(nbytes=st.integers(0, 8 * PAGE))
    def evict_bytes(self, nbytes: int) -> None:
        self.engine.evict_bytes(nbytes)
        self.sync()

    @rule(dt=st.sampled_from([0.5, 2.0, 6.0]))
    def advance_clock(self, dt: float) -> None:
        self.clock.now += dt

    @rule()
    def expire(self) -> None:
        self.engine.expire_leases()
        self.leases = [ls for ls in self.leases if ls.expires_at > self.clock.now]

    @rule()
    def drop_owner(self) -> None:
        self.engine.drop_owner("owner")
        self.leases.clear()

    @rule(key=st.sampled_from(KEYS))
    def conflicting_put(self, key: str) -> None:
        self.sync()
        if key in self.content:
            with pytest.raises(MetadataConflict):
                self.engine.begin_put(key, "uint8", (SIZES[key] + 1,))

    # -- model helpers -------------------------------------------------------------------
    def pages(self, key: str) -> int:
        return -(-SIZES[key] // PAGE)

    def pinned_pages(self) -> int:
        live = {ls.key for ls in self.leases if ls.expires_at > self.clock.now}
        return sum(self.pages(k) for k in live)

    def filling_pages(self) -> int:
        return sum(-(-h.nbytes // PAGE) for h, _ in self.handles if not h.exists_already)

    def sync(self) -> None:
        """Drop model keys the engine evicted to make room (only unleased ones may go)."""
        present = dict(zip(KEYS, self.engine.exists(KEYS), strict=True))
        for key in list(self.content):
            if not present[key]:
                assert not any(
                    ls.key == key and ls.expires_at > self.clock.now for ls in self.leases
                ), f"leased {key} was evicted"
                del self.content[key]
        assert {k for k, p in present.items() if p} == set(self.content)

    # -- invariants ----------------------------------------------------------------------
    @invariant()
    def no_shared_pages_and_accounting(self) -> None:
        e = self.engine
        seen = np.zeros(NUM_PAGES, dtype=np.int32)
        _, infos = e.list_entries(limit=10**6)
        for info in infos:
            for start, n in info.page_runs:
                seen[start : start + n] += 1
        assert seen.max(initial=0) <= 1, "two live entries share a page"
        s = e.stats()
        assert s.host.used_pages == int(seen.sum()) <= s.host.total_pages
        landing = np.zeros(NUM_PAGES, dtype=np.int32)
        for start, n in e.host_store.prealloc._runs:
            landing[start : start + n] += 1
        assert int(landing.sum()) == e.host_store.prealloc.pages == s.put_landing_bytes // PAGE
        assert (seen + landing).max(initial=0) <= 1, "the landing lends a page in use"
        assert e.host_store._t.alloc.num_pages - e.host_store._t.alloc.num_free_pages == int(
            seen.sum() + landing.sum()
        )
        assert s.host.used_bytes <= s.host.capacity_bytes
        assert s.host.free_pages + s.host.used_pages == NUM_PAGES

    @invariant()
    def filling_invisible(self) -> None:
        self.sync()  # the visible keys are exactly the committed ones the model knows
        for h, _ in self.handles:
            if h.key not in self.content:
                assert self.engine.get([h.key], "peek") == [None]

    @invariant()
    def leased_entries_readable(self) -> None:
        for lease in self.leases:
            if lease.expires_at > self.clock.now:
                assert self.engine.lease_alive(lease)
                data = b"".join(self.engine.iter_bytes(lease))
                assert data == self.content[lease.key]

    def teardown(self) -> None:
        try:
            for h, _ in self.handles:
                h.abort()
            self.engine.release(ls.lease_id for ls in self.leases)
            self.engine.evict(KEYS)
            s = self.engine.stats()
            assert s.host.free_pages == NUM_PAGES, "pages leaked"  # the landing's count free
            assert s.leases_active == 0 and s.entries_filling == 0 and s.entries_ready == 0
        finally:
            self.engine.close()


# Derandomized: CI runs the same 300 sequences every time. A random run once failed in CI
# with hypothesis's FlakyStrategyDefinition while choosing the very first rule, before any
# engine call (not reproduced in three local runs); a fixed seed makes every run repeatable.
CacheMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestCacheMachine = CacheMachine.TestCase
