"""The device pool's free reserve (``DevicePool.evict_to_free_target``): after a cold get,
least recently used unleased copies are evicted until ``device_free_reserve`` of the pool is
free, so the next cold get takes its pages without evicting on its path. Leased copies are
never evicted. CPU "device" pools, as in test_tier.py."""

from __future__ import annotations

import pytest
import torch

from embcache.service.config import Settings
from embcache.service.device.pool import DevicePool
from embcache.service.engine import CacheEngine

PAGE = 4096
DEV_PAGE = 8192
DEV_PAGES = 16


def make_engine(shm_name: str, reserve: float) -> CacheEngine:
    s = Settings(
        host_pool_bytes=64 * PAGE,
        page_bytes=PAGE,
        shm_name=shm_name,
        device="cpu",
        device_free_reserve=reserve,
    )
    pool = DevicePool(torch.device("cpu"), DEV_PAGES * DEV_PAGE, DEV_PAGE)
    return CacheEngine(s, device_pools=[pool])


def blob(nbytes: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def device_bytes(e: CacheEngine, page_ids: tuple[int, ...], nbytes: int) -> torch.Tensor:
    pool = e.device_tier.pool(0)
    return pool.tensor.view(-1, pool.page_bytes)[list(page_ids)].reshape(-1)[:nbytes]


def check_tables(e: CacheEngine) -> None:
    e.device_tier.pool(0).check_tables()


def fill_device(e: CacheEngine, count: int) -> list[str]:
    """``count`` entries of two device pages, each made resident, none leased."""
    keys = [f"k{i}" for i in range(count)]
    for i, key in enumerate(keys):
        e.put(key, blob(2 * DEV_PAGE, i))
    e.device_tier.pool(0).free_target = 0  # fill the pool to the brim first
    for key in keys:
        got, _ = e.device.get([key], "fill")
        e.release([got[0].lease.lease_id])  # type: ignore[union-attr]
    return keys


def test_the_reserve_follows_the_setting(shm_name: str) -> None:
    with make_engine(shm_name, 0.25) as e:
        assert e.device_tier.pool(0).free_target == DEV_PAGES // 4
    with make_engine(shm_name + "b", 0.0) as e:
        assert e.device_tier.pool(0).free_target == 0


def test_a_cold_get_leaves_the_reserve_free(shm_name: str) -> None:
    with make_engine(shm_name, 0.25) as e:
        fill_device(e, 8)
        pool = e.device_tier.pool(0)
        assert pool.stats().free_pages == 0
        pool.free_target = 4
        e.put("new", blob(2 * DEV_PAGE, 100))
        got, _ = e.device.get(["new"], "dec")
        assert got[0] is not None and not got[0].resident_hit
        # one copy made room for "new", two more went for the reserve: LRU first
        assert pool.stats().free_pages == 4 and pool.evictions == 3
        resident = [pool.is_resident(e.host_store.peek(f"k{i}")) for i in range(8)]
        assert resident == [False] * 3 + [True] * 5
        assert torch.equal(device_bytes(e, got[0].page_ids, 2 * DEV_PAGE), blob(2 * DEV_PAGE, 100))
        check_tables(e)
        assert e.exists([f"k{i}" for i in range(8)]) == [True] * 8  # host copies stay


def test_a_cold_get_within_the_reserve_evicts_nothing_on_its_path(shm_name: str) -> None:
    with make_engine(shm_name, 0.25) as e:
        fill_device(e, 8)
        pool = e.device_tier.pool(0)
        pool.free_target = 4
        pool.evict_to_free_target()
        e.device.flush_tables(0)
        assert pool.stats().free_pages == 4
        before = pool.evictions
        seen: list[int] = []
        reserve = pool.reserve_batch

        def watched(entries):  # type: ignore[no-untyped-def]
            out = reserve(entries)
            seen.append(pool.evictions - before)
            return out

        pool.reserve_batch = watched  # type: ignore[method-assign]
        e.put("a", blob(2 * DEV_PAGE, 7))
        e.put("b", blob(DEV_PAGE + 1, 8))
        got, _ = e.device.get(["a", "b"], "dec")
        assert seen == [0]  # the reservation evicted nothing
        assert all(g is not None and not g.resident_hit for g in got)
        assert pool.stats().free_pages >= 4  # refilled behind the copies
        check_tables(e)


def test_a_deferred_get_refills_when_its_tables_are_flushed(shm_name: str) -> None:
    """The gRPC path: the reply leaves first, then one callback refills and flushes."""
    with make_engine(shm_name, 0.25) as e:
        fill_device(e, 8)
        pool = e.device_tier.pool(0)
        pool.free_target = 4
        e.put("new", blob(2 * DEV_PAGE, 100))
        p = e.device.start_get(["new"], "dec", defer_tables=True)
        results, _ = p.wait()
        assert pool.stats().free_pages == 0 and pool.evictions == 1  # only what it needed
        e.device.flush_tables(0)
        assert pool.stats().free_pages == 4 and pool.evictions == 3
        assert not pool.tables_pending
        check_tables(e)
        lease = results[0]
        assert lease is not None
        assert torch.equal(device_bytes(e, lease.page_ids, 2 * DEV_PAGE), blob(2 * DEV_PAGE, 100))


def test_the_refill_spares_leased_copies(shm_name: str) -> None:
    with make_engine(shm_name, 0.5) as e:
        keys = fill_device(e, 8)
        pool = e.device_tier.pool(0)
        pool.free_target = 8
        held, _ = e.device.get(keys[:7], "holder")  # resident hits, now leased
        assert all(h is not None and h.resident_hit for h in held)
        assert pool.evict_to_free_target() == 1  # only k7 is unleased
        e.device.flush_tables(0)
        assert pool.stats().free_pages == 2
        for i, h in enumerate(held):
            assert h is not None and pool.is_resident(h.lease.entry)
            assert torch.equal(device_bytes(e, h.page_ids, 2 * DEV_PAGE), blob(2 * DEV_PAGE, i))
        e.drop_owner("holder")
        assert pool.evict_to_free_target() == 3  # now the LRU ones go, down to the reserve
        e.device.flush_tables(0)
        assert pool.stats().free_pages == 8
        check_tables(e)


@pytest.mark.parametrize("reserve", [-0.1, 0.6])
def test_the_setting_is_bounded(shm_name: str, reserve: float) -> None:
    with pytest.raises(ValueError, match="device_free_reserve"):
        Settings(shm_name=shm_name, device="cpu", device_free_reserve=reserve)


def test_no_reserve_evicts_only_on_demand(shm_name: str) -> None:
    with make_engine(shm_name, 0.0) as e:
        fill_device(e, 8)
        pool = e.device_tier.pool(0)
        e.put("new", blob(2 * DEV_PAGE, 100))
        e.device.get(["new"], "dec")
        e.device.flush_tables(0)
        assert pool.stats().free_pages == 0 and pool.evictions == 1
