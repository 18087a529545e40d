"""Coalesced page-table updates (``device_table_flush_s``, ``DevicePool.flush_if_due``): gets
queue their table updates, which are launched together once the oldest has waited the
interval (or too many wait); whoever reads the tables flushes first, so a reader never sees
them behind. CPU "device" pools, as in test_tier.py."""

from __future__ import annotations

import pytest
import torch

from embcache.service.config import Settings
from embcache.service.device import table_updates
from embcache.service.device.pool import DevicePool
from embcache.service.engine import CacheEngine

PAGE = 4096
DEV_PAGE = 8192
DEV_PAGES = 32


class Clock:
    """Stands in for ``time`` in table_updates: the tests move it by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(table_updates, "time", c)
    return c


def make_engine(shm_name: str, flush_s: float) -> CacheEngine:
    s = Settings(
        host_pool_bytes=64 * PAGE,
        page_bytes=PAGE,
        shm_name=shm_name,
        device="cpu",
        device_free_reserve=0,
        device_table_flush_s=flush_s,
    )
    pool = DevicePool(torch.device("cpu"), DEV_PAGES * DEV_PAGE, DEV_PAGE)
    return CacheEngine(s, device_pools=[pool])


def blob(nbytes: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def bound_pages(pool: DevicePool) -> set[int]:
    return {p for p in pool.v2p.tolist() if p >= 0}


def cold_get(e: CacheEngine, key: str) -> tuple[int, ...]:
    got, _ = e.device.get([key], "dec")
    assert got[0] is not None and not got[0].resident_hit
    e.release([got[0].lease.lease_id])
    return got[0].page_ids


def test_the_interval_follows_the_setting(shm_name: str) -> None:
    with make_engine(shm_name, 0.5) as e:
        assert e.device_tier.pool(0).flush_every_s == 0.5
    with pytest.raises(ValueError):
        Settings(device_table_flush_s=-1)


def test_gets_queue_updates_until_the_interval_has_passed(shm_name: str, clock: Clock) -> None:
    with make_engine(shm_name, 0.5) as e:  # binary fractions: exact sums on the clock
        pool = e.device_tier.pool(0)
        for i in range(3):
            e.put(f"k{i}", blob(2 * DEV_PAGE, i))
        first = cold_get(e, "k0")
        clock.now += 0.25
        second = cold_get(e, "k1")
        # bookkeeping moved on, the tables did not: nothing launched yet
        assert pool.tables_pending and bound_pages(pool) == set()
        assert pool.stats().free_pages == DEV_PAGES - 4
        clock.now += 0.25  # the oldest update is 0.5 s old: the next get launches them all
        third = cold_get(e, "k2")
        assert not pool.tables_pending
        assert bound_pages(pool) == set(first + second + third)
        pool.check_tables()


def test_zero_flushes_after_every_get(shm_name: str, clock: Clock) -> None:
    with make_engine(shm_name, 0.0) as e:
        pool = e.device_tier.pool(0)
        e.put("k", blob(3 * DEV_PAGE, 1))
        pages = cold_get(e, "k")
        assert not pool.tables_pending and bound_pages(pool) == set(pages)


def test_a_copy_bound_and_evicted_between_flushes_never_reaches_the_tables(
    shm_name: str, clock: Clock
) -> None:
    with make_engine(shm_name, 1.0) as e:
        pool = e.device_tier.pool(0)
        e.put("k", blob(2 * DEV_PAGE, 1))
        cold_get(e, "k")
        e.evict(["k"])  # its device copy goes too
        assert pool.tables_pending and pool.resident_entries == 0
        clock.now += 1.0
        assert pool.flush_if_due()  # the net change is nothing: no kernel runs
        assert not pool.tables_pending and bound_pages(pool) == set()
        assert set(pool.p2v.tolist()) == {-1}
        pool.check_tables()


def test_too_many_queued_updates_flush_at_once(
    shm_name: str, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(table_updates, "MAX_QUEUED_UPDATES", 3)
    with make_engine(shm_name, 1.0) as e:
        pool = e.device_tier.pool(0)
        for i in range(3):
            e.put(f"k{i}", blob(DEV_PAGE, i))
        cold_get(e, "k0")
        cold_get(e, "k1")
        assert pool.tables_pending
        cold_get(e, "k2")  # the third update reaches the cap
        assert not pool.tables_pending and len(bound_pages(pool)) == 3


def test_a_read_table_flushes_first(shm_name: str, clock: Clock) -> None:
    with make_engine(shm_name, 1.0) as e:
        for i in range(2):
            e.put(f"k{i}", blob(3 * DEV_PAGE, i))
        first = cold_get(e, "k0")
        got, table = e.device.get(["k1", "k0"], "dec", read_table=True)
        assert table is not None and got[0] is not None and got[1] is not None
        assert table.tolist() == [list(got[0].page_ids), list(first)]
        e.release([g.lease.lease_id for g in got if g is not None])


def test_settle_waits_for_the_interval_and_flush_does_not(shm_name: str, clock: Clock) -> None:
    with make_engine(shm_name, 0.5) as e:
        pool = e.device_tier.pool(0)
        e.put("k", blob(2 * DEV_PAGE, 1))
        pending = e.device.start_get(["k"], "dec", defer_tables=True)
        pending.wait()
        e.device.housekeeping(0)
        assert pool.tables_pending  # queued 0 s ago
        clock.now += 0.5
        e.device.housekeeping(0)
        assert not pool.tables_pending and len(bound_pages(pool)) == 2
        e.release([d.lease.lease_id for d in pending.results if d is not None])
        e.put("j", blob(DEV_PAGE, 2))
        pending = e.device.start_get(["j"], "dec", defer_tables=True)
        pending.wait()
        e.device.flush_tables(0)  # explicit: now
        assert not pool.tables_pending and len(bound_pages(pool)) == 3
        e.release([d.lease.lease_id for d in pending.results if d is not None])


def test_the_reaper_call_catches_up_once_gets_stop(shm_name: str, clock: Clock) -> None:
    with make_engine(shm_name, 0.5) as e:
        pool = e.device_tier.pool(0)
        e.put("k", blob(2 * DEV_PAGE, 1))
        pages = cold_get(e, "k")
        assert e.device_tier.flush_due() == 0 and pool.tables_pending
        clock.now += 0.5
        assert e.device_tier.flush_due() == 1
        assert not pool.tables_pending and bound_pages(pool) == set(pages)
        assert e.device_tier.flush_due() == 0  # nothing left


def test_the_reaper_outlives_a_failing_flush() -> None:
    """A flush that raises (not a device error, which takes a pool out of service) is
    logged; the daemon's reaper goes on expiring leases."""
    import asyncio
    from types import SimpleNamespace

    from embcache.service.daemon import Daemon

    expired = []

    def flush_due() -> int:
        raise RuntimeError("a bug in a flush (test)")

    engine = SimpleNamespace(
        expire_leases=lambda: expired.append(1) or 0,
        device=SimpleNamespace(flush_due=flush_due),
        quarantine=SimpleNamespace(reap=lambda: 0),
    )

    async def run() -> None:
        task = asyncio.create_task(Daemon(Settings(lease_ttl_s=1.0), None)._reap(engine))  # type: ignore[arg-type]
        while len(expired) < 3 and not task.done():
            await asyncio.sleep(0.05)
        assert not task.done(), task
        task.cancel()

    asyncio.run(asyncio.wait_for(run(), timeout=10))
    assert len(expired) >= 3
