from __future__ import annotations

import threading
import zlib
from collections.abc import Callable

import numpy as np
import pytest
import torch

from embcache.errors import (
    ChecksumMismatch,
    Draining,
    EntryLeased,
    EntryTooLarge,
    InvalidArgument,
    LeaseExpired,
    MetadataConflict,
    NotFound,
    PoolExhausted,
    QuotaExceeded,
)
from embcache.service.config import Settings
from embcache.service.engine import CacheEngine, EvictOutcome

PAGE = 4096


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def engine(shm_name: str, clock: FakeClock):
    s = Settings(
        host_pool_bytes=64 * PAGE,
        page_bytes=PAGE,
        shm_name=shm_name,
        max_entry_bytes=48 * PAGE,
        lease_ttl_s=10,
        max_key_bytes=64,
        max_leased_bytes_per_owner=64 * PAGE,  # these tests lease the whole pool on purpose
    )
    with CacheEngine(s, clock=clock) as e:
        yield e


def rand(shape: tuple[int, ...], dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int8])
def test_put_get_roundtrip(engine: CacheEngine, dtype: torch.dtype) -> None:
    t = rand((33, 37), dtype)  # odd row size
    assert engine.put("k", t) is True
    [lease] = engine.get(["k"], "o")
    assert lease is not None and lease.dtype == str(dtype).removeprefix("torch.")
    assert lease.shape == (33, 37) and lease.nbytes == t.numel() * t.element_size()
    out = engine.tensor(lease)
    assert torch.equal(out.view(torch.uint8), t.view(torch.uint8))
    assert out.data_ptr() == engine.host_pool.tensor.data_ptr() + lease.byte_runs[0][0]
    assert (
        b"".join(engine.iter_bytes(lease, chunk_bytes=1000)) == t.numpy().tobytes()
        if dtype is not torch.bfloat16
        else True
    )
    assert engine.release([lease.lease_id]) == 1
    assert engine.release([lease.lease_id]) == 0


def test_iter_bytes_ranges(engine: CacheEngine) -> None:
    data = np.random.default_rng(1).integers(0, 256, 3 * PAGE + 17, dtype=np.uint8)
    h = engine.begin_put("r", "uint8", (data.size,))
    h.write(data[:5000])
    h.write(memoryview(data[5000:].tobytes()))
    assert h.commit()
    [lease] = engine.get(["r"], "o")
    assert lease is not None
    for off, length in [(0, None), (4095, 2), (100, 9000), (data.size, 0)]:
        got = b"".join(engine.iter_bytes(lease, off, length, chunk_bytes=777))
        end = data.size if length is None else off + length
        assert got == data[off:end].tobytes()
    with pytest.raises(InvalidArgument):
        list(engine.iter_bytes(lease, 10, data.size))


def test_idempotent_and_collision_guard(engine: CacheEngine) -> None:
    t = rand((4, 8))
    assert engine.put("k", t)
    free = engine.stats().host.free_pages
    assert engine.put("k", t) is False
    with engine.begin_put("k", "float32", (4, 8)) as h:
        assert h.exists_already
        h.write(t)
        assert h.commit() is False
    assert engine.stats().host.free_pages == free
    with pytest.raises(MetadataConflict) as info:
        engine.begin_put("k", "float16", (4, 8))
    assert info.value.details["existing_dtype"] == "float32"
    with pytest.raises(MetadataConflict):
        engine.put("k", rand((8, 4)))


@pytest.mark.parametrize(
    ("key", "dtype", "shape", "nbytes", "exc"),
    [
        ("", "float32", (1,), None, InvalidArgument),
        ("x" * 65, "float32", (1,), None, InvalidArgument),
        ("a\x00b", "float32", (1,), None, InvalidArgument),
        (5, "float32", (1,), None, InvalidArgument),
        ("k", "complex64", (1,), None, InvalidArgument),
        ("k", "float32", (-1, 2), None, InvalidArgument),
        ("k", "float32", (2, 2), 15, InvalidArgument),
        ("k", "float32", (1,) * 9, None, InvalidArgument),
        ("k", "float32", (2**40, 2**40), None, InvalidArgument),
        ("k", "float32", "12", None, InvalidArgument),
        ("k", "float32", (1.5,), None, InvalidArgument),
        ("k", "float32", (49 * PAGE // 4,), None, EntryTooLarge),
    ],
)
def test_admission_errors_reserve_nothing(
    engine: CacheEngine, key, dtype, shape, nbytes, exc
) -> None:
    with pytest.raises(exc):
        engine.begin_put(key, dtype, shape, nbytes=nbytes)
    s = engine.stats()
    assert s.host.free_pages == s.host.total_pages and s.entries_filling == 0


def test_filling_is_invisible_and_abort_frees(engine: CacheEngine) -> None:
    h = engine.begin_put("f", "uint8", (3 * PAGE,))
    h.write(b"\1" * PAGE)
    assert engine.exists(["f"]) == [False]
    assert engine.get(["f"], "o") == [None]
    assert engine.stats().entries_filling == 1
    assert engine.list_entries(state="filling")[0] == 1
    h.abort()
    h.abort()
    s = engine.stats()
    assert s.host.free_pages == s.host.total_pages and s.puts_aborted == 1
    with pytest.raises(LeaseExpired):
        h.write(b"x")


def test_short_long_and_corrupt_puts_leave_nothing(engine: CacheEngine) -> None:
    h = engine.begin_put("s", "uint8", (100,))
    h.write(b"x" * 99)
    with pytest.raises(InvalidArgument, match="before all bytes"):
        h.commit()
    h = engine.begin_put("l", "uint8", (100,))
    with pytest.raises(InvalidArgument, match="more bytes"):
        h.write(b"x" * 101)
    h.abort()
    payload = b"y" * 100
    h = engine.begin_put("c", "uint8", (100,), checksum=zlib.crc32(payload) ^ 1)
    h.write(payload)
    with pytest.raises(ChecksumMismatch):
        h.commit()
    h = engine.begin_put("ok", "uint8", (100,), checksum=zlib.crc32(payload))
    h.write(payload)
    assert h.commit()
    assert engine.exists(["s", "l", "c", "ok"]) == [False, False, False, True]
    assert engine.stats().host.used_pages == 1


def test_context_manager_aborts_on_error(engine: CacheEngine) -> None:
    with pytest.raises(RuntimeError), engine.begin_put("e", "uint8", (10,)) as h:
        h.write(b"12345")
        raise RuntimeError("client went away")
    assert engine.stats().host.used_pages == 0


def test_lru_eviction_skips_leased(engine: CacheEngine, clock: FakeClock) -> None:
    blob = rand((16 * PAGE // 4,))  # 16 pages each; the pool holds 4
    for k in "abcd":
        engine.put(k, blob)
        clock.now += 1
    [lease_a] = engine.get(["a"], "o")  # a is leased: not evictable
    engine.get(["b"], "o2")
    engine.drop_owner("o2")  # b is now the most recently used unleased entry
    engine.put("e", blob)  # evicts c (oldest unleased)
    assert engine.exists(list("abcde")) == [True, True, False, True, True]
    engine.put("f", blob)  # evicts d
    assert engine.exists(list("abcdef")) == [True, True, False, False, True, True]
    assert engine.stats().evictions == 2
    engine.put("g", blob)  # evicts b
    assert engine.exists(list("abefg")) == [True, False, True, True, True]
    engine.get(["e", "f", "g"], "o")  # now every entry is leased
    with pytest.raises(PoolExhausted):
        engine.put("h", blob)
    assert lease_a is not None and engine.exists(list("aefg")) == [True] * 4


def test_pool_exhausted_when_all_leased(engine: CacheEngine) -> None:
    blob = rand((16 * PAGE // 4,))
    for k in "abcd":
        engine.put(k, blob)
    leases = engine.get(list("abcd"), "o")
    with pytest.raises(PoolExhausted):
        engine.put("x", blob)
    assert engine.exists(list("abcd")) == [True] * 4
    engine.release(lease.lease_id for lease in leases if lease)
    assert engine.put("x", blob)


def test_evict_api(engine: CacheEngine) -> None:
    engine.put("a", rand((10,)))
    engine.put("b", rand((10,)))
    [lease] = engine.get(["b"], "o")
    assert engine.evict(["a", "b", "zz"]) == [
        EvictOutcome.EVICTED,
        EvictOutcome.LEASED,
        EvictOutcome.NOT_FOUND,
    ]
    with pytest.raises(EntryLeased):
        engine.evict_one("b")
    with pytest.raises(NotFound):
        engine.evict_one("a")
    engine.release([lease.lease_id])  # type: ignore[union-attr]
    engine.evict_one("b")
    assert engine.stats().host.used_pages == 0
    for i in range(6):
        engine.put(f"k{i}", rand((PAGE // 4,)))
    assert engine.evict_bytes(2 * PAGE + 1) == (3, 3 * PAGE)
    assert engine.exists([f"k{i}" for i in range(6)]) == [False] * 3 + [True] * 3
    assert engine.evict_bytes(0) == (0, 0)
    # a key named twice goes once (its pages are freed once); the second time it is gone
    assert engine.evict(["k3", "k3"]) == [EvictOutcome.EVICTED, EvictOutcome.NOT_FOUND]
    assert engine.stats().host.used_pages == 2


def test_ttl_expiry_and_renew(engine: CacheEngine, clock: FakeClock) -> None:
    engine.put("a", rand((10,)))
    [lease] = engine.get(["a"], "o")
    [short] = engine.get(["a"], "o", ttl_s=1)
    assert lease is not None and short is not None
    clock.now += 5
    assert engine.expire_leases() == 1
    assert engine.renew([lease.lease_id], ttl_s=100) == 1
    clock.now += 50
    assert engine.expire_leases() == 0
    assert engine.lease_alive(lease)
    clock.now += 51
    assert not engine.lease_alive(lease)
    with pytest.raises(LeaseExpired):
        engine.tensor(lease)
    with pytest.raises(LeaseExpired):
        list(engine.iter_bytes(lease))
    assert engine.stats().leases_active == 0
    for bad in (0, -1, float("inf"), float("nan"), 10**9):
        with pytest.raises(InvalidArgument):
            engine.get(["a"], "o", ttl_s=bad)
    assert engine.stats().leases_active == 0


def test_drop_owner(engine: CacheEngine) -> None:
    engine.put("a", rand((10,)))
    engine.get(["a", "a", "missing"], "client-1")
    engine.get(["a"], "client-2")
    assert engine.stats().leases_active == 3
    assert engine.drop_owner("client-1") == 2
    assert engine.drop_owner("client-1") == 0
    assert engine.evict(["a"]) == [EvictOutcome.LEASED]
    engine.drop_owner("client-2")
    assert engine.evict(["a"]) == [EvictOutcome.EVICTED]
    s = engine.stats()
    assert (s.hits, s.misses) == (3, 1)


def test_fragmented_entry_gathers(engine: CacheEngine) -> None:
    small = rand((PAGE // 4,))
    for i in range(64):
        engine.put(f"s{i}", small)
    engine.evict([f"s{i}" for i in range(0, 64, 2)])  # 32 one-page holes
    big = rand((5, PAGE // 4), seed=3)
    engine.evict_bytes(0)
    assert engine.put("big", big)
    info = engine.entry_info("big")
    assert info is not None and len(info.page_runs) == 5
    [lease] = engine.get(["big"], "o")
    assert lease is not None and not lease.contiguous
    assert torch.equal(engine.tensor(lease), big)
    assert b"".join(engine.iter_bytes(lease)) == big.numpy().tobytes()
    assert engine.stats().runs_per_entry["5-8"] == 1


def test_quota(shm_name: str) -> None:
    s = Settings(
        host_pool_bytes=64 * PAGE,
        page_bytes=PAGE,
        shm_name=shm_name,
        max_inflight_bytes_per_client=8 * PAGE,
    )
    with CacheEngine(s) as e:
        h = e.begin_put("a", "uint8", (6 * PAGE,), owner="c1")
        with pytest.raises(QuotaExceeded):
            e.begin_put("b", "uint8", (3 * PAGE,), owner="c1")
        e.begin_put("b", "uint8", (3 * PAGE,), owner="c2").abort()
        h.abort()
        e.begin_put("b", "uint8", (8 * PAGE,), owner="c1").abort()


def test_concurrent_puts_of_one_key(engine: CacheEngine) -> None:
    t = rand((100,))
    h1 = engine.begin_put("k", "float32", (100,))
    h2 = engine.begin_put("k", "float32", (100,))
    h1.write(t)
    h2.write(t)
    assert h2.commit() is True
    assert h1.commit() is False
    assert engine.stats().host.used_pages == 1
    h3 = engine.begin_put("j", "float32", (100,))
    h4 = engine.begin_put("j", "float32", (100,))
    h3.write(t)
    h3.commit()
    h4.abort()
    assert engine.stats().host.used_pages == 2


def test_drain_and_close(engine: CacheEngine) -> None:
    h = engine.begin_put("a", "uint8", (10,))
    engine.begin_drain()
    with pytest.raises(Draining):
        engine.get(["a"], "o")
    with pytest.raises(Draining):
        engine.begin_put("b", "uint8", (10,))
    h.write(b"0123456789")
    assert h.commit()  # in-flight puts may finish while draining
    assert engine.stats().draining


def test_page_states_and_listing(engine: CacheEngine) -> None:
    engine.put("a", rand((PAGE // 4 * 2,)))
    engine.put("b", rand((PAGE // 4,)))
    engine.get(["b"], "o")
    h = engine.begin_put("c", "uint8", (PAGE,))
    states = engine.page_states()
    assert list(states[:5]) == [2, 2, 3, 1, 0]
    total, infos = engine.list_entries()
    assert total == 3 and {i.key: i.state for i in infos} == {
        "a": "ready",
        "b": "ready",
        "c": "filling",
    }
    assert engine.list_entries(offset=1, limit=1)[1][0].key == "b"
    info = engine.entry_info("b")
    assert info is not None and info.leases == 1 and info.to_dict()["page_runs"] == [[2, 1]]
    h.abort()


def test_threads_hammering(engine: CacheEngine) -> None:
    errors: list[BaseException] = []

    def worker(n: int) -> None:
        try:
            for i in range(60):
                key = f"t{n}-{i % 7}"
                t = torch.full((PAGE // 4,), float(i % 7 + n), dtype=torch.float32)
                try:
                    engine.put(key, t)
                except PoolExhausted:
                    continue
                for lease in engine.get([key], f"w{n}"):
                    if lease is not None:
                        assert torch.equal(engine.tensor(lease), t)
                        engine.release([lease.lease_id])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    s = engine.stats()
    assert s.leases_active == 0 and s.entries_filling == 0
    assert s.host.used_pages == s.entries_ready


def test_entry_info_lease_holders_and_ready(engine: CacheEngine, clock: FakeClock) -> None:
    assert engine.ready
    engine.put("a", rand((10,)))
    engine.get(["a"], "decoder-7", ttl_s=30)
    clock.now += 10
    info = engine.entry_info("a")
    assert info is not None and info.lease_holders == (("decoder-7", 20.0),)
    assert info.to_dict()["lease_holders"] == [{"owner": "decoder-7", "expires_in_s": 20.0}]
    assert engine.entry_info("missing") is None
    engine.begin_drain()
    assert not engine.ready


class FakeSharedTier:
    """The shared tier's hooks, with the functions behind them swapped by the test."""

    def __init__(self) -> None:
        self.fetch_fn: Callable[[list[str]], None] = lambda keys: None
        self.exists_fn: Callable[[list[str]], list[bool]] = lambda keys: [False] * len(keys)
        self.listeners: list[Callable[[str, str], object]] = []

    def fetch(self, keys: list[str]) -> None:
        self.fetch_fn(keys)

    def exists(self, keys: list[str]) -> list[bool]:
        return self.exists_fn(keys)

    def on_commit(self, key: str, owner: str) -> None:
        for listener in self.listeners:
            listener(key, owner)

    def prefetch(self, keys: object, *, device: int | None = None) -> object:
        raise AssertionError("not used here")

    def close(self) -> None:
        pass


def test_shared_tier_hooks(shm_name: str, clock: FakeClock) -> None:
    tier = FakeSharedTier()
    s = Settings(host_pool_bytes=64 * PAGE, page_bytes=PAGE, shm_name=shm_name, lease_ttl_s=10)
    with CacheEngine(s, clock=clock, shared_tier=lambda _engine: tier) as engine:
        _shared_tier_hooks(engine, tier)


def _shared_tier_hooks(engine: CacheEngine, tier: FakeSharedTier) -> None:
    remote = {"r": rand((10,), seed=9)}
    seen: list[tuple[str, str]] = []
    fetched: list[list[str]] = []

    def fetch(keys: list[str]) -> None:
        fetched.append(keys)
        for k in keys:
            if k in remote:
                engine.put(k, remote[k], owner="shared-tier")

    tier.fetch_fn = fetch
    tier.exists_fn = lambda keys: [k in remote for k in keys]
    tier.listeners.append(lambda key, owner: seen.append((key, owner)))
    engine.put("a", rand((10,)))
    assert seen == [("a", "local")]
    assert engine.exists(["a", "r", "zz"]) == [True, True, False]
    [la, lr, lz] = engine.get(["a", "r", "zz"], "dec")
    assert fetched == [["r", "zz"]]
    assert la is not None and lz is None and lr is not None
    assert torch.equal(engine.tensor(lr), remote["r"])
    assert seen[-1] == ("r", "shared-tier")

    def broken(keys: list[str]) -> None:
        raise ConnectionError("shared tier down")

    tier.fetch_fn = broken
    tier.exists_fn = lambda keys: (_ for _ in ()).throw(ConnectionError("down"))
    assert engine.get(["nope"], "dec") == [None]  # an outage is a miss, never an error
    assert engine.exists(["a", "nope"]) == [True, False]
    tier.listeners.append(lambda key, owner: 1 / 0)
    assert engine.put("b", rand((3,))) is True  # a failing listener never fails the put
