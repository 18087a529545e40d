"""Hooks, write-through, back-pressure, retries and degraded mode against an in-memory store.

The real stores are exercised in test_redis_tier.py / test_mooncake_tier.py; here a fake
backend makes failures and slowness deterministic.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence

import pytest
from prometheus_client import generate_latest
from tier_helpers import new_node, payload, read_entry

from embcache.service.engine import CacheEngine
from embcache.service.observability.metrics import Metrics
from embcache.service.shared_tier import SharedTier, SharedTierConfig
from embcache.service.shared_tier.base import (
    HEADER_BYTES,
    FetchResult,
    Header,
    PutItem,
    Reserve,
    SharedTierBackend,
    TierError,
    key_digest,
    scatter,
)


class MemoryTier(SharedTierBackend):
    """A dict as a shared tier; ``down`` makes every call fail, ``gate`` holds puts."""

    name = "memory"

    def __init__(self, store: dict[str, bytes]) -> None:
        self.store = store
        self.down = False
        self.gate: threading.Event | None = None
        self.put_calls = 0

    def _check(self) -> None:
        if self.down:
            raise TierError("store is down")

    def attach_pool(self, pool) -> None:  # type: ignore[no-untyped-def]
        self.pool = pool

    def put_batch(self, items: Sequence[PutItem]) -> list[bool]:
        self.put_calls += 1
        if self.gate is not None:
            self.gate.wait(5)
        self._check()
        for item in items:
            data = b"".join(self.pool[o : o + n].tobytes() for o, n in item.runs)
            self.store[item.key] = item.header.pack() + data
        return [True] * len(items)

    def get_batch(self, keys: Sequence[str], reserve: Reserve) -> list[FetchResult]:
        self._check()
        out = []
        for key in keys:
            value = self.store.get(key)
            header = Header.unpack(value) if value else None
            if header is None:
                out.append(FetchResult.MISSING if value is None else FetchResult.CORRUPT)
                continue
            runs = reserve(key, header)
            if runs is None:
                out.append(FetchResult.SKIPPED)
                continue
            scatter(self.pool, runs, [memoryview(value)[HEADER_BYTES:]])
            out.append(FetchResult.FILLED)
        return out

    def exists(self, keys: Sequence[str]) -> list[bool]:
        self._check()
        return [k in self.store for k in keys]

    def delete(self, keys: Sequence[str], *, force: bool = False) -> int:
        self._check()
        return sum(self.store.pop(k, None) is not None for k in keys)

    def ping(self) -> None:
        self._check()

    def describe(self) -> dict[str, object]:
        return {"backend": "memory"}

    def close(self) -> None:
        pass


Made = tuple[CacheEngine, SharedTier, MemoryTier]


@pytest.fixture
def make() -> Iterator[Callable[..., Made]]:
    store: dict[str, bytes] = {}
    made: list[tuple[CacheEngine, SharedTier]] = []

    def build(tag: str = "m", **knobs: object) -> Made:
        knobs = {"timeout_s": 0.5, "probe_interval_s": 0.05, **knobs}
        config = SharedTierConfig.from_url("redis://127.0.0.1:1", **knobs)  # type: ignore[arg-type]
        backend = MemoryTier(store)
        engine, tier = new_node(tag, config, backend_factory=lambda _: backend)
        made.append((engine, tier))
        return engine, tier, backend

    yield build
    for engine, tier in made:
        tier.close()
        engine.close()


def test_header_round_trip_and_rejects() -> None:
    h = Header("float16", (3, 5), 30, 1234, key_digest("k"), 4096, 2, 99)
    raw = h.pack()
    assert len(raw) == HEADER_BYTES and Header.unpack(raw) == h
    assert Header.unpack(raw[:100]) is None
    bad = bytearray(raw)
    bad[20] ^= 1
    assert Header.unpack(bytes(bad)) is None  # header CRC
    assert Header.unpack(b"X" * HEADER_BYTES) is None


def test_config_urls() -> None:
    c = SharedTierConfig.from_url("redis://u:s3cret@10.0.0.1:7000,10.0.0.2/2?chunk=1MiB&ttl=5")
    assert c.backend == "redis" and c.hosts == (("10.0.0.1", 7000), ("10.0.0.2", 6379))
    assert c.username == "u" and c.password == "s3cret" and c.db == 2
    assert c.size_option("chunk", 0) == 1024 * 1024 and "s3cret" not in repr(c)
    assert "s3cret" not in c.redacted_url()
    assert SharedTierConfig.from_url("rediss://h:1").tls
    m = SharedTierConfig.from_url("mooncake://[::1]:50051?segment=1GiB", ack="sync")
    assert m.hosts == (("::1", 50051),) and m.ack == "sync"
    for bad in ("http://x", "mooncake://a:1,b:2", "redis://:0", "redis://h?x=1"):
        if bad == "redis://h?x=1":
            assert SharedTierConfig.from_url(bad).option("x", "") == "1"
            continue
        with pytest.raises(ValueError):
            SharedTierConfig.from_url(bad)
    with pytest.raises(ValueError):
        SharedTierConfig.from_url("redis://h", ack="later")  # type: ignore[arg-type]

    class S:
        shared_tier = "redis://h:1"
        shared_tier_ack = "sync"
        shared_tier_queue = 7
        shared_tier_timeout_s = 0.5
        shared_tier_retries = 1

    s = SharedTierConfig.from_settings(S())
    assert s is not None and (s.ack, s.queue_size, s.timeout_s, s.retries) == ("sync", 7, 0.5, 1)
    assert SharedTierConfig.from_settings(object()) is None


def test_write_through_fetch_and_no_write_back(make: Callable[..., Made]) -> None:
    a, ta, store = make("a")
    b, tb, _ = make("b")
    t = payload(100_000, seed=1)
    a.put("k", t)
    assert ta.flush(5) and "k" in store.store
    assert read_entry(b, "k") == t.numpy().tobytes()
    assert tb.flush(5) and tb.stats()["writes_ok"] == 0  # fetched entries are not written back
    assert ta.stats()["writes_ok"] == 1 and ta.stats()["write_bytes"] == 100_000


def test_prefetch(make: Callable[..., Made]) -> None:
    a, ta, _ = make("a")
    b, tb, _ = make("b")
    a.put("k", payload(10_000, seed=2))
    assert ta.flush(5)
    r = tb.prefetch(["k", "nope", "k"])
    assert r.to_dict() == {"requested": 2, "local": 0, "fetched": 1, "missing": 1, "resident": 0}
    assert b.entry_info("k") is not None
    assert tb.prefetch(["k"]).local == 1


def test_back_pressure_when_the_queue_is_full(make: Callable[..., Made]) -> None:
    a, ta, backend = make("a", queue_size=1, batch_max=1, timeout_s=0.2)
    backend.gate = threading.Event()
    t0 = time.monotonic()
    for i in range(4):  # 1 in flight, 1 queued, then the queue is full
        a.put(f"k{i}", payload(4096, seed=i))
    elapsed = time.monotonic() - t0
    c = ta.stats()
    assert c["queue_full"] >= 1 and c["queue_dropped"] >= 1
    assert 0.2 <= elapsed < 3  # puts waited (back-pressure) but never failed
    backend.gate.set()
    assert ta.flush(5)
    assert all(read_entry(a, f"k{i}") is not None for i in range(4))  # local puts all fine


def test_retries_then_degraded_then_recovery(make: Callable[..., Made]) -> None:
    a, ta, backend = make("a", retries=2)
    backend.down = True
    a.put("k", payload(4096, seed=3))
    assert ta.flush(5)
    c = ta.stats()
    assert c["write_failed"] == 1 and c["write_retries"] == 2 and c["outages"] == 1
    assert not ta.health.ok and ta.health_detail()["state"] == "degraded"
    # While degraded, misses do not touch the store and exists answers locally.
    calls = backend.put_calls
    assert read_entry(a, "absent") is None and a.exists(["absent", "k"]) == [False, True]
    assert ta.stats()["fetch_skipped_degraded"] >= 1 and backend.put_calls == calls
    backend.down = False
    deadline = time.monotonic() + 5
    while not ta.health.ok and time.monotonic() < deadline:
        time.sleep(0.02)
    assert ta.health.ok and ta.stats()["recoveries"] == 1
    a.put("k2", payload(4096, seed=4))
    assert ta.flush(5) and "k2" in backend.store


def test_sync_ack_waits_for_the_store(make: Callable[..., Made]) -> None:
    a, _, backend = make("a", ack="sync")
    backend.gate = threading.Event()
    threading.Timer(0.3, backend.gate.set).start()
    t0 = time.monotonic()
    a.put("k", payload(4096, seed=5))
    assert time.monotonic() - t0 >= 0.25 and "k" in backend.store


def test_fetch_rejected_when_the_pool_cannot_hold_it(make: Callable[..., Made]) -> None:
    b, tb, backend = make("b")
    backend.store["huge"] = (
        Header("uint8", (64 * 1024 * 1024,), 64 * 1024 * 1024, 0, key_digest("huge")).pack() + b"\0"
    )
    assert read_entry(b, "huge") is None and tb.stats()["fetch_rejected"] == 1
    assert b.stats().entries_filling == 0


def test_metrics_families() -> None:
    metrics = Metrics()
    config = SharedTierConfig.from_url("redis://127.0.0.1:1", probe_interval_s=0.05)
    engine, tier = new_node(
        "metrics", config, metrics=metrics, backend_factory=lambda _: MemoryTier({})
    )
    metrics.watch_engine(engine)
    try:
        engine.put("k", payload(4096, seed=6))
        assert tier.flush(5)
        read_entry(engine, "absent")
        text = generate_latest(metrics.registry).decode()
        assert 'embcache_shared_tier_writes_total{result="ok"} 1.0' in text
        assert 'embcache_shared_tier_fetch_keys_total{result="miss"} 1.0' in text
        assert "embcache_shared_tier_degraded 0.0" in text
        assert "embcache_shared_tier_queue_depth 0.0" in text
    finally:
        tier.close()
        engine.close()
