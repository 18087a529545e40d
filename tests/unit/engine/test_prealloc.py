"""The put landing (``put_landing.py``): host pages set aside so a put from a device queues
its copy before it is checked and recorded. On a CPU engine the "device" tensors are CPU
tensors, copied at once, through the same code."""

from __future__ import annotations

import pytest
import torch

from embcache.errors import InvalidArgument, MetadataConflict, QuotaExceeded
from embcache.service.config import Settings
from embcache.service.device import puts as pending_put
from embcache.service.engine import CacheEngine
from embcache.service.host.prealloc import PutPrealloc

PAGE = 4096
ENTRY_PAGES = 3
NBYTES = ENTRY_PAGES * PAGE - 7  # the last page part-filled


def make_engine(shm_name: str, **extra: object) -> CacheEngine:
    s = Settings(
        host_pool_bytes=64 * PAGE,
        page_bytes=PAGE,
        shm_name=shm_name,
        device="cpu",
        **extra,  # type: ignore[arg-type]
    )
    return CacheEngine(s)


@pytest.fixture
def engine(shm_name: str):
    with make_engine(shm_name) as e:
        yield e


def blob(seed: int, nbytes: int = NBYTES) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def read(e: CacheEngine, key: str) -> torch.Tensor:
    (lease,) = e.get([key], "reader")
    assert lease is not None
    try:
        return e.tensor(lease).view(torch.uint8).clone()
    finally:
        e.release([lease.lease_id])


def test_take_give_back_and_drain() -> None:
    landing = PutPrealloc(max_pages=8)
    assert landing.take(2) is None and landing.shortfall() == 2  # empty: asked for 2
    landing.add([(10, 3), (20, 4)])
    assert landing.take(0) is None and landing.take(9) is None  # none, or more than max
    assert landing.take(5) == ((10, 3), (20, 2))  # first runs first, the last one cut
    assert landing.pages == 2 and landing.shortfall() == 3  # wants the largest ask, 5
    landing.give_back(((10, 3),))
    assert landing.take(4) == ((10, 3), (22, 1))  # given back: first in line
    assert landing.drain() == [(23, 1)] and landing.pages == 0 and landing.shortfall() == 0


def test_puts_take_their_pages_from_the_landing_and_copy_first(
    engine: CacheEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine.device.put("first", blob(1))  # the landing is empty; the put asks for 3
    landing = engine.host_store.prealloc
    assert landing.pages == ENTRY_PAGES
    held = list(landing._runs)
    stats = engine.stats()  # on loan, counted free
    assert stats.put_landing_bytes == ENTRY_PAGES * PAGE
    assert stats.host.free_pages == stats.host.total_pages - ENTRY_PAGES
    assert stats.entries_filling == 0 and stats.reserved_filling_bytes == 0
    assert not engine.page_states()[[p for s, n in held for p in range(s, s + n)]].any()
    order: list[str] = []
    queue, begin = pending_put.queue_d2h, engine._puts.begin

    def queued(*a):  # type: ignore[no-untyped-def]
        order.append("copy")
        return queue(*a)

    def begun(*a, **k):  # type: ignore[no-untyped-def]
        order.append("begin")
        return begin(*a, **k)

    monkeypatch.setattr(pending_put, "queue_d2h", queued)
    monkeypatch.setattr(engine._puts, "begin", begun)
    assert engine.device.put("second", blob(2)) is True
    assert order == ["copy", "begin"]  # the copy before any check or record
    info = engine.entry_info("second")
    assert info is not None and [tuple(r) for r in info.page_runs] == held
    assert torch.equal(read(engine, "second"), blob(2))
    assert torch.equal(read(engine, "first"), blob(1))
    assert landing.pages == ENTRY_PAGES  # topped up again for the next put


@pytest.mark.parametrize(
    "key,error",
    [("", InvalidArgument), ("k" * 2000, InvalidArgument), ("x\x00y", InvalidArgument)],
)
def test_a_bad_put_gives_its_landing_pages_back(
    engine: CacheEngine, key: str, error: type[Exception]
) -> None:
    engine.device.put("warm", blob(1))
    before = engine.host_store.prealloc.pages
    with pytest.raises(error):
        engine.device.put(key, blob(2))  # copied into landing pages, then refused
    assert engine.host_store.prealloc.pages == before
    stats = engine.stats()
    assert stats.entries_ready == 1 and stats.entries_filling == 0
    assert stats.host.used_pages == ENTRY_PAGES  # only "warm"


def test_over_quota_after_the_copy_gives_the_pages_back(shm_name: str) -> None:
    with make_engine(shm_name, max_inflight_bytes_per_client=2 * NBYTES - 1) as e:
        e.device.put("warm", blob(1))  # fits alone
        h = e.begin_put("open", "uint8", (NBYTES,), owner="enc")  # holds NBYTES in flight
        with pytest.raises(QuotaExceeded):
            e.device.put("second", blob(2), owner="enc")
        assert e.host_store.prealloc.pages == ENTRY_PAGES
        h.abort()
        assert e.device.put("second", blob(2), owner="enc") is True
        assert torch.equal(read(e, "second"), blob(2))


def test_a_key_stored_meanwhile_gives_the_pages_back(
    engine: CacheEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine.device.put("k", blob(1))
    # Another put stores the key between the landing's look and begin_put's: this put's
    # pages were copied into, then nothing adopts them.

    def unaware(key: str, nbytes: int, copy_in):  # type: ignore[no-untyped-def]
        pages = engine.host_store.prealloc.take(-(-nbytes // PAGE))
        assert pages is not None
        copy_in(tuple(engine.host_pool.byte_runs(pages, nbytes)))
        return pages

    monkeypatch.setattr(engine._puts, "take_prealloc", unaware)
    assert engine.device.put("k", blob(1)) is False
    assert engine.host_store.prealloc.pages == ENTRY_PAGES
    with pytest.raises(MetadataConflict):
        engine.device.put("k", blob(2, NBYTES + 1))
    assert engine.host_store.prealloc.pages == ENTRY_PAGES
    assert torch.equal(read(engine, "k"), blob(1))


def test_room_is_taken_back_from_the_landing_before_anything_is_evicted(
    engine: CacheEngine,
) -> None:
    engine.device.put("dev", blob(1))
    assert engine.host_store.prealloc.pages == ENTRY_PAGES
    free = engine.host_store._t.alloc.num_free_pages
    engine.put("fill", torch.zeros(free * PAGE, dtype=torch.uint8))  # every free page
    assert (
        engine.host_store._t.alloc.num_free_pages == 0
        and engine.host_store.prealloc.pages == ENTRY_PAGES
    )
    engine.put("more", torch.ones(PAGE, dtype=torch.uint8))  # room: the landing's pages
    assert engine.exists(["dev", "fill", "more"]) == [True, True, True]  # nothing evicted
    assert engine.host_store.prealloc.pages == 0 and engine.host_store.prealloc.shortfall() == 0
    assert engine.stats().evictions == 0


def test_the_landing_tops_up_by_evicting_as_a_put_would(engine: CacheEngine) -> None:
    engine.put("old", torch.zeros(61 * PAGE, dtype=torch.uint8))  # 3 pages left free
    engine.device.put("dev", blob(1))  # takes the 3; the top-up must evict "old"
    assert engine.host_store.prealloc.pages == ENTRY_PAGES
    assert engine.exists(["old", "dev"]) == [False, True]
    engine.get(["dev"], "holder")  # now nothing is evictable: no top-up, no error
    assert engine.device.put("dev2", blob(2)) is True
    assert engine.host_store.prealloc.pages <= ENTRY_PAGES


def test_a_batch_takes_landing_pages_item_by_item(engine: CacheEngine) -> None:
    engine.device.put("warm", blob(0))
    items = [(f"b{i}", blob(10 + i)) for i in range(4)]
    assert engine.device.put_many(items) == [True] * 4
    for key, t in items:
        assert torch.equal(read(engine, key), t)
    assert engine.host_store.prealloc.pages == ENTRY_PAGES


def test_no_landing_when_it_is_off(shm_name: str) -> None:
    with make_engine(shm_name, device_put_prealloc_bytes=0) as e:
        e.device.put("a", blob(1))
        e.device.put("b", blob(2))
        assert e.host_store.prealloc.pages == 0 and e.stats().put_landing_bytes == 0
        assert torch.equal(read(e, "b"), blob(2))


def test_a_failing_copy_gives_the_landing_pages_back(
    engine: CacheEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine.device.put("warm", blob(1))

    def broken(*a):  # type: ignore[no-untyped-def]
        raise RuntimeError("the copy could not be queued")

    monkeypatch.setattr(pending_put, "queue_d2h", broken)
    with pytest.raises(RuntimeError, match="could not be queued"):
        engine.device.put("k", blob(2))
    assert engine.host_store.prealloc.pages == ENTRY_PAGES
    stats = engine.stats()
    assert stats.entries_filling == 0 and stats.host.used_pages == ENTRY_PAGES


def test_a_closed_engine_copies_nothing(engine: CacheEngine) -> None:
    engine.device.put("warm", blob(1))
    engine.close()
    copies: list[object] = []
    assert engine._puts.take_prealloc("k", NBYTES, copies.append) is None and copies == []
