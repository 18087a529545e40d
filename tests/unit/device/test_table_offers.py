"""Device-resident copies in the read table, on a CPU "device" (service/device/published.py,
service/host/read_table.py's device sections, clients/device/read_table.py's parse).

A copy is offered once its filling copy is complete and withdrawn, with a sequence bump,
before its pages can be reused: by a device eviction, LRU room for another get, a host
eviction, the pool's failure. A reader that located the old runs and copies from reused
pages is refused by its check afterwards. The same code runs on a GPU (tests/gpu).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from embcache.clients.device import read_table as client_table
from embcache.clients.device.read_table import DevicePlacement, Located, ReadTable, ReadTables
from embcache.clients.device.table_device import TablePools, _byte_runs, placement_on
from embcache.proto import read_table as rt
from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.service.config import Settings
from embcache.service.device.pool import DevicePool
from embcache.service.device.published import PublishedCopies
from embcache.service.engine import CacheEngine
from embcache.service.host.entries import Entry
from embcache.service.transport.handlers.device import DevicePlane, pool_handle_of
from embcache.service.transport.render import LocationRenderer
from embcache.service.transport.session.service import read_table_info

PAGE = 4096
DEV_PAGE = 8192
pytestmark = pytest.mark.skipif(not client_table.ORDERED_STORES, reason="x86-64 only")


def make_engine(shm_name: str, pools: int = 1, dev_pages: int = 8) -> CacheEngine:
    s = Settings(
        host_pool_bytes=64 * PAGE,
        page_bytes=PAGE,
        shm_name=shm_name,
        device="cpu",
        warm_restart=False,
    )
    made = [
        DevicePool(torch.device("cpu"), dev_pages * DEV_PAGE, DEV_PAGE, index=i)
        for i in range(pools)
    ]
    return CacheEngine(s, device_pools=made)


@pytest.fixture
def engine(shm_name: str) -> Iterator[CacheEngine]:
    with make_engine(shm_name) as e:
        yield e


def reader(engine: CacheEngine) -> ReadTable:
    host = pool_handle_of(LocationRenderer(engine, engine.settings).host_pool())
    info = read_table_info(engine.read_table, host)
    assert info is not None
    table = ReadTables().get(info)
    assert table is not None
    return table


def blob(nbytes: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def located(table: ReadTable, key: str) -> Located:
    found = table.locate(key)
    assert found is not None
    return found


def device_copy(engine: CacheEngine, found: Located, placement: DevicePlacement) -> torch.Tensor:
    """What a client's device-to-device copy of ``placement`` reads (the CPU pool's bytes)."""
    pool = engine.device_tier.at(placement.pool)
    runs = _byte_runs(placement.runs, pool.page_bytes, found.nbytes, pool.nbytes)
    assert runs is not None
    out = torch.empty(found.nbytes, dtype=torch.uint8)
    for start, take, at in runs:
        out[at : at + take] = pool.tensor[start : start + take]
    return out


def entry(engine: CacheEngine, key: str) -> Entry:
    found = engine.host_store.peek(key)
    assert found is not None
    return found


def counts(engine: CacheEngine) -> tuple[int, int, int]:
    t = engine.stats().read_table
    return t["device_published"], t["device_withdrawn"], t["device_skipped"]


def test_a_loaded_copy_is_offered_and_reads_bit_for_bit(engine: CacheEngine) -> None:
    a = blob(3 * PAGE + 5, 1)  # two device pages
    engine.put("a", a)
    table = reader(engine)
    assert located(table, "a").devices == ()  # host only so far
    (dl,), _ = engine.device.get(["a"], "dec")
    assert dl is not None
    found = located(table, "a")
    pool = engine.device_tier.pool(0)
    res = pool.peek(entry(engine, "a"))
    assert res is not None
    assert found.devices == (DevicePlacement(0, res.runs),)
    assert [p for s, k in found.devices[0].runs for p in range(s, s + k)] == list(dl.page_ids)
    assert torch.equal(device_copy(engine, found, found.devices[0]), a)
    assert table.unchanged(found)
    assert counts(engine) == (1, 0, 0)
    # a hit changes nothing in the table: no rewrite, no sequence bump
    engine.device.get(["a"], "dec")
    assert located(table, "a").seq == found.seq and counts(engine) == (1, 0, 0)


def test_a_device_eviction_withdraws_before_the_pages_are_reused(engine: CacheEngine) -> None:
    engine.put("a", blob(2 * DEV_PAGE, 1))
    b = blob(2 * DEV_PAGE, 2)
    engine.put("b", b)
    table = reader(engine)
    engine.device.warm(["a"], 0)
    old = located(table, "a")
    (placement,) = old.devices
    out = engine.device.evict(["a"], 0)
    assert out.freed_bytes == 2 * DEV_PAGE
    now = located(table, "a")
    assert now.devices == () and now.seq == old.seq + 2  # one change of the slot
    assert not table.unchanged(old)
    assert counts(engine) == (1, 1, 0)
    engine.device.warm(["b"], 0)  # reuses a's pages
    assert located(table, "b").devices[0].runs == placement.runs
    # a reader that located a's runs before the eviction and copies now reads b's bytes,
    # and its check afterwards refuses them
    assert torch.equal(device_copy(engine, old, placement), b)
    assert not table.unchanged(old)


def test_lru_room_for_another_get_withdraws_the_victim(shm_name: str) -> None:
    with make_engine(shm_name, dev_pages=4) as engine:
        for i in range(3):
            engine.put(f"k{i}", blob(2 * DEV_PAGE, i))
        table = reader(engine)
        engine.device.warm(["k0"], 0)
        engine.device.warm(["k1"], 0)
        before = located(table, "k0")
        assert before.devices
        engine.device.warm(["k2"], 0)  # the pool holds two: k0 (LRU) goes
        assert located(table, "k0").devices == () and not table.unchanged(before)
        assert located(table, "k1").devices and located(table, "k2").devices
        engine.device.evict_bytes(0, 2 * DEV_PAGE)  # k1 goes
        assert located(table, "k1").devices == ()
        assert counts(engine) == (3, 2, 0)


def test_host_eviction_and_pool_failure_withdraw(shm_name: str) -> None:
    with make_engine(shm_name, pools=2) as engine:
        engine.put("a", blob(100, 1))
        engine.put("b", blob(100, 2))
        table = reader(engine)
        for device in (0, 1):
            engine.device.warm(["a", "b"], device)
        assert {p.pool for p in located(table, "a").devices} == {0, 1}
        engine.evict(["a"])  # host eviction: the slot goes, device sections with it
        assert table.locate("a") is None
        assert counts(engine) == (4, 2, 0)
        engine.device_tier.at(1).fail("test")  # may run outside the engine's lock: no write
        assert {p.pool for p in located(table, "b").devices} == {0, 1}
        engine.device.flush_due()  # the reaper's sweep, under the lock
        assert [p.pool for p in located(table, "b").devices] == [0]
        assert counts(engine) == (4, 3, 0)


def test_a_copy_still_running_is_not_offered(engine: CacheEngine) -> None:
    engine.put("a", blob(100, 1))
    table = reader(engine)
    pool = engine.device_tier.pool(0)
    offers = pool.published
    assert isinstance(offers, PublishedCopies)
    fired = [False]

    class Event:  # a copy the GPU has not finished
        def query(self) -> bool:
            return fired[0]

    res = pool.reserve_batch([entry(engine, "a")])
    assert res is not None
    res[0].event = Event()  # type: ignore[assignment]
    offers.loaded(entry(engine, "a"), res[0])
    assert engine.device.flush_due() >= 0 and located(table, "a").devices == ()
    fired[0] = True
    engine.device.flush_due()  # the daemon's reaper: the copy is complete now
    assert located(table, "a").devices == (DevicePlacement(0, res[0].runs),)
    # dropped while waiting: never offered
    engine.put("b", blob(100, 2))
    fired[0] = False
    res_b = pool.reserve_batch([entry(engine, "b")])
    assert res_b is not None
    res_b[0].event = Event()  # type: ignore[assignment]
    offers.loaded(entry(engine, "b"), res_b[0])
    pool.drop(entry(engine, "b"))
    fired[0] = True
    engine.device.flush_due()
    assert located(table, "b").devices == () and offers.waiting == 0


def test_writer_limits_and_identity(engine: CacheEngine) -> None:
    engine.put("a", blob(100, 1))
    live = engine.read_table
    assert live is not None
    table = reader(engine)
    a = entry(engine, "a")
    seq = located(table, "a").seq
    for pool in range(rt.DEVICE_SECTIONS):
        assert live.place(a, pool, ((pool, 1),))
    assert located(table, "a").seq == seq + 2 * rt.DEVICE_SECTIONS
    assert not live.place(a, rt.DEVICE_SECTIONS, ((0, 1),))  # every section taken
    too_many = tuple((i, 1) for i in range(rt.DEVICE_RUNS + 1))
    assert not live.place(a, 0, too_many)
    assert live.place(a, 2, ((7, 1), (9, 2)))  # rewrites pool 2's own section
    assert live.device_sections("a")[2] == ((7, 1), (9, 2))
    assert len(located(table, "a").devices) == rt.DEVICE_SECTIONS
    assert live.unplace(a, 1) and not live.unplace(a, 1)
    assert {p.pool for p in located(table, "a").devices} == {0, 2, 3}
    assert live.place(a, 9, ((1, 1),))  # takes the section pool 1 left
    assert (live.device_published, live.device_withdrawn, live.device_skipped) == (6, 1, 2)
    # an older entry of the same key never describes the newer one
    engine.evict(["a"])
    engine.put("a", blob(100, 2))
    assert not live.place(a, 0, ((0, 1),)) and not live.unplace(a, 0)
    assert located(table, "a").devices == ()


def test_sessions_announce_the_pools_by_index(engine: CacheEngine) -> None:
    plane = DevicePlane(engine, engine.settings)
    offered = plane.offered_pools()
    assert len(offered) == 1 and offered[0].WhichOneof("kind") is None  # a CPU pool: nothing
    handle = pb.PoolHandle(
        pool_id="dev0-x", device=pb.DevicePool(gpu_uuid="GPU-x", size=DEV_PAGE, page_bytes=DEV_PAGE)
    )
    host = pool_handle_of(LocationRenderer(engine, engine.settings).host_pool())
    info = read_table_info(engine.read_table, host, [handle, pb.PoolHandle()])
    assert info is not None and list(info.device_pools) == [handle, pb.PoolHandle()]
    info = pb.ReadTableInfo.FromString(info.SerializeToString())
    table = ReadTables().get(info)
    assert table is not None and table.device_pools == (handle, pb.PoolHandle())
    # nothing this process can open: the caller falls back to the host runs
    pools = TablePools()
    assert pools.open(pb.PoolHandle()) is None and pools.open(handle) is None
    engine.put("a", blob(10, 1))
    engine.device.warm(["a"], 0)
    found = located(table, "a")
    assert found.devices and placement_on(found, table.device_pools, torch.device("cpu")) is None


def test_byte_runs_refuse_what_a_torn_slot_could_say() -> None:
    assert _byte_runs([(1, 2)], 10, 15, 100) == [(10, 15, 0)]
    assert _byte_runs([(1, 1), (5, 1)], 10, 15, 100) == [(10, 10, 0), (50, 5, 10)]
    assert _byte_runs([(9, 2)], 10, 15, 100) is None  # past the pool
    assert _byte_runs([(1, 1)], 10, 15, 100) is None  # short of the entry
    assert _byte_runs([(1, 0), (1, 2)], 10, 15, 100) is None
    assert _byte_runs([], 10, 0, 100) == []


def test_reads_under_churn_never_pass_foreign_bytes(shm_name: str) -> None:
    """A thread makes random entries resident in a small pool (evicting and reusing pages
    all the time) while this one copies located device runs and checks the slot after: every
    copy that passes its check is its own entry's bytes. Bounded in count and time."""
    with make_engine(shm_name, dev_pages=6) as engine:
        want = {f"k{i}": blob(DEV_PAGE + 1000 * i, i) for i in range(8)}
        for key, t in want.items():
            engine.put(key, t)
        table = reader(engine)
        stop = threading.Event()
        errors: list[BaseException] = []

        def churn() -> None:
            rnd = random.Random(5)
            try:
                for _ in range(3000):
                    if stop.is_set():
                        return
                    engine.device.warm(rnd.sample(list(want), 2), 0)
            except BaseException as exc:
                errors.append(exc)

        worker = threading.Thread(target=churn)
        worker.start()
        served = refused = 0
        give_up = time.monotonic() + 20
        try:
            while worker.is_alive() and time.monotonic() < give_up:
                for key, t in want.items():
                    found = table.locate(key)
                    if found is None or not found.devices:
                        continue
                    pool = engine.device_tier.at(0)
                    runs = _byte_runs(found.devices[0].runs, DEV_PAGE, found.nbytes, pool.nbytes)
                    if runs is None:
                        refused += 1
                        continue
                    out = torch.empty(found.nbytes, dtype=torch.uint8)
                    for start, take, at in runs:
                        out[at : at + take] = pool.tensor[start : start + take]
                    if not table.unchanged(found):
                        refused += 1
                        continue
                    served += 1
                    assert torch.equal(out, t), f"foreign bytes for {key}"
        finally:
            stop.set()
            worker.join(timeout=60)
        assert not errors and not worker.is_alive()
        assert served > 0
        published, withdrawn, _ = counts(engine)
        assert withdrawn > 0 and published >= withdrawn
