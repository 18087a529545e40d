"""Device tier logic on a CPU "device": residency, LRU, lease pinning, page tables, copies.

The same code runs on a GPU (tests/gpu); here the device pool is plain memory, so CI tests
everything but the CUDA calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import zlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from embcache import kernels
from embcache.errors import (
    ChecksumMismatch,
    DeviceUnavailable,
    InvalidArgument,
    MetadataConflict,
    PoolExhausted,
)
from embcache.service.config import Settings
from embcache.service.device.pool import DevicePool
from embcache.service.engine import CacheEngine
from embcache.service.engine.device_puts import PendingPut
from embcache.service.transport.handlers import device_puts as grpc_device_puts

PAGE = 4096
DEV_PAGE = 8192


@pytest.fixture
def engine(shm_name: str):
    s = Settings(host_pool_bytes=64 * PAGE, page_bytes=PAGE, shm_name=shm_name, device="cpu")
    pool = DevicePool(torch.device("cpu"), 8 * DEV_PAGE, DEV_PAGE)
    with CacheEngine(s, device_pools=[pool]) as e:
        yield e


def blob(nbytes: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def device_bytes(e: CacheEngine, dl) -> torch.Tensor:  # type: ignore[no-untyped-def]
    pool = e.device_tier.pool(0)
    pages = pool.tensor.view(-1, pool.page_bytes)[list(dl.page_ids)].reshape(-1)
    return pages[: dl.lease.nbytes]


def check_tables(e: CacheEngine) -> None:
    e.device_tier.pool(0).check_tables()


def test_get_to_device_copies_then_hits(engine: CacheEngine) -> None:
    a, b = blob(3 * PAGE + 5, 1), blob(100, 2)
    engine.put("a", a)
    engine.put("b", b)
    results, table = engine.device.get(["a", "missing", "b"], "dec", read_table=True)
    da, miss, db = results
    assert miss is None and da is not None and db is not None
    assert not da.resident_hit and torch.equal(device_bytes(engine, da), a)
    assert torch.equal(device_bytes(engine, db), b)
    assert len(da.page_ids) == 2 and da.offset == da.page_ids[0] * DEV_PAGE
    assert table is not None and table[0, :2].tolist() == list(da.page_ids)
    assert table[1, :1].tolist() == list(db.page_ids)
    copied = engine.stats().bytes_copied["h2d"]
    assert copied == a.numel() + b.numel()
    again, _ = engine.device.get(["a"], "dec")
    assert again[0] is not None and again[0].resident_hit
    assert again[0].page_ids == da.page_ids
    assert engine.stats().bytes_copied["h2d"] == copied  # a hit costs no copy
    info = engine.entry_info("a")
    assert info is not None and info.residency == ("host", "device:0")
    s = engine.stats()
    assert s.device[0].used_pages == 3 and s.device_resident == [2] and s.leases_active == 3
    check_tables(engine)


def test_device_lru_and_lease_pinning(engine: CacheEngine) -> None:
    for i in range(6):
        engine.put(f"k{i}", blob(2 * DEV_PAGE, i))  # 2 device pages each; the pool has 8
    first, _ = engine.device.get(["k0", "k1", "k2", "k3"], "dec")  # fills the pool, leased
    with pytest.raises(PoolExhausted):
        engine.device.get(["k4"], "dec")
    assert engine.stats().leases_active == 4  # the failed call left no lease behind
    engine.release([first[0].lease.lease_id, first[1].lease.lease_id])  # type: ignore[union-attr]
    got, _ = engine.device.get(["k4", "k5"], "dec")  # evicts k0 and k1 from the device
    assert all(g is not None and not g.resident_hit for g in got)
    pool = engine.device_tier.pool(0)
    assert pool.evictions == 2 and not pool.is_resident(engine.host_store.peek("k0"))  # type: ignore[arg-type]
    assert engine.exists(["k0", "k1"]) == [True, True]  # still on the host
    for g, i in zip(got, (4, 5), strict=True):
        assert torch.equal(device_bytes(engine, g), blob(2 * DEV_PAGE, i))
    states = engine.device.page_states()
    assert sorted(states.tolist()) == [2] * 8  # every page resident and leased
    check_tables(engine)
    engine.drop_owner("dec")
    assert sorted(engine.device.page_states().tolist()) == [1] * 8


def test_deferred_table_updates_land_in_order(engine: CacheEngine) -> None:
    """A get that defers its table updates (the gRPC path) leaves them queued; binds and
    the tombstones of later evictions are applied in order by one flush."""
    for i in range(6):
        engine.put(f"k{i}", blob(2 * DEV_PAGE, i))
    pool = engine.device_tier.pool(0)
    p = engine.device.start_get(["k0", "k1", "k2", "k3"], "dec", defer_tables=True)
    results, _ = p.wait()
    assert pool.tables_pending and set(pool.v2p.tolist()) == {-1}  # nothing launched yet
    for r in results:
        assert r is not None and not r.resident_hit
        engine.release([r.lease.lease_id])
    # evicts k0 and k1 (their binds still queued), binds k4 and k5 in their pages
    q = engine.device.start_get(["k4", "k5"], "dec", defer_tables=True)
    got, _ = q.wait()
    for g, i in zip(got, (4, 5), strict=True):
        assert g is not None and torch.equal(device_bytes(engine, g), blob(2 * DEV_PAGE, i))
    engine.device.flush_tables(0)
    assert not pool.tables_pending
    check_tables(engine)
    engine.device.flush_tables(0)  # nothing queued: a no-op
    check_tables(engine)
    with pytest.raises(DeviceUnavailable):
        engine.device.flush_tables(1)  # no such pool: a typed error


def test_host_eviction_frees_device_pages(engine: CacheEngine) -> None:
    engine.put("a", blob(DEV_PAGE, 1))
    [dl], _ = engine.device.get(["a"], "dec")
    assert dl is not None
    engine.release([dl.lease.lease_id])
    engine.evict_one("a")
    pool = engine.device_tier.pool(0)
    assert pool.stats().free_pages == pool.num_pages and pool.resident_entries == 0
    assert set(pool.v2p.tolist()) == {-1} and set(pool.p2v.tolist()) == {-1}


def test_entry_larger_than_device_pool(engine: CacheEngine) -> None:
    engine.put("big", blob(9 * DEV_PAGE, 1))
    with pytest.raises(PoolExhausted):
        engine.device.get(["big"], "dec")
    assert engine.stats().leases_active == 0
    with pytest.raises(DeviceUnavailable):
        engine.device.get(["big"], "dec", device=3)


def test_get_into_from_host_and_device(engine: CacheEngine) -> None:
    a, b = blob(1000, 1), blob(3 * PAGE, 2)
    engine.put("a", a)
    engine.put("b", b)
    engine.device.get(["b"], "warm")  # b is resident: its copy comes from the device pool
    dest = torch.full((4 * PAGE + 64,), 7, dtype=torch.uint8)
    got = engine.device.get_into(["a", "nope", "b"], "dec", dest, [16, 0, 1024], device=0)
    assert [g is not None for g in got] == [True, False, True]
    assert torch.equal(dest[16:1016], a) and torch.equal(dest[1024 : 1024 + b.numel()], b)
    assert (dest[:16] == 7).all() and (dest[1016:1024] == 7).all()
    assert (dest[1024 + b.numel() :] == 7).all()
    s = engine.stats()
    assert s.leases_active == 1  # only the warm-up lease: get_into leases end with the call
    assert s.bytes_copied["d2d"] == b.numel() and s.bytes_copied["h2d"] >= 1000
    # odd offsets work (narrower rows)
    dest2 = torch.zeros(2000, dtype=torch.uint8)
    engine.device.get_into(["a"], "dec", dest2, [3])
    assert torch.equal(dest2[3:1003], a)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    sizes=st.lists(st.integers(1, 3 * PAGE + 9), min_size=1, max_size=5),
    resident=st.lists(st.booleans(), min_size=5, max_size=5),
    align=st.sampled_from([1, 2, 4, 8, 16, 48]),
    base=st.integers(0, 40),
)
def test_get_into_fragmented_entries_at_any_alignment(
    engine: CacheEngine, sizes: list[int], resident: list[bool], align: int, base: int
) -> None:
    """Entries whose host pages are scattered, some resident in the device pool, copied
    into slots of any alignment: every byte lands in its slot and nothing else changes."""
    for i in range(12):  # scatter the free pages: fill, then free every other entry
        engine.put(f"pad{i}", blob(PAGE, 100 + i))
    engine.evict([f"pad{i}" for i in range(0, 12, 2)])
    keys = [f"k{i}" for i in range(len(sizes))]
    data = {k: blob(n, i) for i, (k, n) in enumerate(zip(keys, sizes, strict=True))}
    for k, t in data.items():
        engine.put(k, t)
    warm = [k for k, r in zip(keys, resident, strict=False) if r]
    if warm:
        got, _ = engine.device.get(warm, "warm")
        engine.release(r.lease.lease_id for r in got if r is not None)
    offsets, pos = [], base
    for n in sizes:
        offsets.append(pos)
        pos = -(-(pos + n + 1) // align) * align  # a gap of at least one byte
    dest = torch.full((pos + 7,), 0xA5, dtype=torch.uint8)
    before = engine.stats().bytes_copied
    out = engine.device.get_into(keys, "dec", dest, offsets, device=0)
    assert all(x is not None for x in out)
    expect = torch.full_like(dest, 0xA5)
    for k, off in zip(keys, offsets, strict=True):
        expect[off : off + data[k].numel()] = data[k]
    assert torch.equal(dest, expect)
    after = engine.stats().bytes_copied
    moved = sum(after[d] - before[d] for d in ("h2d", "d2d"))
    assert moved == sum(sizes)
    assert engine.stats().leases_active == 0
    engine.evict([*keys, *(f"pad{i}" for i in range(1, 12, 2))])


@pytest.mark.parametrize(
    ("offsets", "size"), [([0, 500], 4096), ([0], 999), ([-1], 4096), ([0, 0, 0], 4096)]
)
def test_get_into_rejects_bad_slots(engine: CacheEngine, offsets: list[int], size: int) -> None:
    engine.put("a", blob(1000, 1))
    engine.put("b", blob(100, 2))
    keys = {1: ["a"], 2: ["a", "b"], 3: ["a", "b", "a"]}[len(offsets)]
    dest = torch.zeros(size, dtype=torch.uint8)
    with pytest.raises(InvalidArgument):
        engine.device.get_into(keys, "dec", dest, offsets)
    assert engine.stats().leases_active == 0
    assert (dest == 0).all()


def test_put_from_device(engine: CacheEngine) -> None:
    t = torch.randn(33, 37).to(torch.bfloat16)
    assert engine.device.put("t", t) is True
    [lease] = engine.get(["t"], "dec")
    assert lease is not None and torch.equal(engine.tensor(lease), t)
    assert engine.device.put("t", t) is False  # idempotent
    raw = t.view(-1).view(torch.uint8).numpy().tobytes()
    assert engine.device.put("u", t, checksum=zlib.crc32(raw)) is True
    with pytest.raises(ChecksumMismatch):
        engine.device.put("v", t, checksum=zlib.crc32(raw) ^ 1)
    assert engine.exists(["v"]) == [False]
    assert engine.stats().bytes_copied["d2h"] == 2 * len(raw) + len(raw)
    with pytest.raises(InvalidArgument):
        engine.device.put("w", t.t())  # not contiguous
    s = engine.stats()
    assert s.entries_filling == 0 and s.host.used_pages == 2 * -(-len(raw) // PAGE)


@pytest.mark.parametrize("nbytes", [1, 15, 3 * PAGE + 7, 5 * PAGE])
def test_put_from_device_into_fragmented_pages(engine: CacheEngine, nbytes: int) -> None:
    for i in range(64):  # the whole host pool
        engine.put(f"f{i}", blob(PAGE, i))
    engine.evict([f"f{i}" for i in range(0, 64, 2)])  # one-page holes only
    src = blob(nbytes + 3, 7)[3:]  # an odd address as well as an odd size
    assert engine.device.put("x", src) is True
    info = engine.entry_info("x")
    assert info is not None and len(info.page_runs) == -(-nbytes // PAGE)
    [lease] = engine.get(["x"], "dec")
    assert lease is not None and torch.equal(engine.tensor(lease), src)


def test_put_from_device_many(engine: CacheEngine) -> None:
    engine.put("old", blob(3 * PAGE, 1))
    items = [
        ("a", torch.randn(33, 37).to(torch.bfloat16)),
        ("b", blob(2 * PAGE + 5, 2)),
        ("c", torch.randn(0, 4)),  # empty
        ("d", blob(9, 3)[1:]),  # odd address and size
    ]
    assert engine.device.put_many(items) == [True] * 4
    for key, t in items:
        [lease] = engine.get([key], "dec")
        assert lease is not None and torch.equal(engine.tensor(lease), t), key
    engine.drop_owner("dec")
    assert engine.device.put_many([items[0], ("e", blob(7, 4))]) == [False, True]
    assert (
        engine.stats().bytes_copied["d2h"]
        == sum(t.numel() * t.element_size() for _, t in items) + 7
    )


@pytest.mark.parametrize("case", ["duplicate", "not contiguous", "conflict", "too large"])
def test_put_from_device_many_is_all_or_nothing(engine: CacheEngine, case: str) -> None:
    engine.put("x", blob(100, 1))
    engine.get(["x"], "hold")  # nothing to evict: the batch fits or fails
    before = engine.stats()
    good = [("p", blob(2 * PAGE, 2)), ("q", blob(PAGE + 1, 3))]
    bad = {
        "duplicate": ("p", blob(10, 4)),
        "not contiguous": ("r", torch.randn(8, 6).t()),
        "conflict": ("x", blob(101, 5)),  # same key, other shape
        "too large": ("r", blob(60 * PAGE, 6)),  # fits alone, not after p and q
    }[case]
    error = {"conflict": MetadataConflict, "too large": PoolExhausted}
    with pytest.raises(error.get(case, InvalidArgument)):
        engine.device.put_many([*good, bad])
    assert engine.exists(["p", "q", "r"]) == [False, False, False]
    after = engine.stats()
    assert after.entries_filling == 0 and after.host.used_pages == before.host.used_pages


def test_put_from_device_many_checks_checksums_before_any_commit(engine: CacheEngine) -> None:
    items = [("p", blob(2 * PAGE, 2)), ("q", blob(PAGE + 1, 3)), ("r", blob(77, 4))]
    crcs = [zlib.crc32(t.numpy().tobytes()) for _, t in items]
    before = engine.stats()
    with pytest.raises(ChecksumMismatch):  # the last one is wrong: none of them stays
        engine.device.put_many(items, checksums=[*crcs[:2], crcs[2] ^ 1])
    assert engine.exists(["p", "q", "r"]) == [False, False, False]
    after = engine.stats()
    assert after.entries_filling == 0 and after.host.used_pages == before.host.used_pages
    with pytest.raises(InvalidArgument, match="one checksum per item"):
        engine.device.put_many(items, checksums=crcs[:2])
    assert engine.device.put_many(items, checksums=[crcs[0], None, crcs[2]]) == [True] * 3
    for key, t in items:
        [lease] = engine.get([key], "dec")
        assert lease is not None and torch.equal(engine.tensor(lease), t), key
    engine.drop_owner("dec")
    # existing entries: accepted without reading their bytes, as a single put
    assert engine.device.put_many(items, checksums=[1, 2, 3]) == [False] * 3


# -- puts started now and ended later (pending_put.py): nothing visible before finish;
# abort and failures give every page back, and not before the copies into them end.
class SlowCopy:
    """An event that fires when the test says so (a copy still running)."""

    def __init__(self) -> None:
        self.fired = threading.Event()
        self.waited = False

    def query(self) -> bool:
        return self.fired.is_set()

    def synchronize(self) -> None:
        self.waited = True
        assert self.fired.wait(10), "the copy never ended"


def running(pending: PendingPut) -> SlowCopy:
    copy = SlowCopy()
    pending._events.append(copy)  # type: ignore[arg-type]
    return copy


def test_nothing_visible_before_finish(engine: CacheEngine) -> None:
    items = [("a", blob(3 * PAGE, 1)), ("b", blob(100, 2))]
    before = engine.stats().host.used_pages
    pending = engine.device.start_put_many(items)
    assert engine.exists(["a", "b"]) == [False, False]
    assert engine.stats().entries_filling == 2 and pending.loaded_bytes == 3 * PAGE + 100
    copy = running(pending)
    assert not pending.done()
    copy.fired.set()
    assert pending.done()
    assert pending.finish() == [True, True]
    assert engine.exists(["a", "b"]) == [True, True]
    assert engine.stats().host.used_pages == before + 4
    with pytest.raises(RuntimeError, match="ended"):
        pending.finish()
    pending.abort()  # after finish: nothing to give back
    assert engine.exists(["a", "b"]) == [True, True]


def test_abort_gives_back_every_page_after_the_copies(engine: CacheEngine) -> None:
    before = engine.stats()
    pending = engine.device.start_put_many([("a", blob(5 * PAGE, 1)), ("b", blob(9, 2))])
    copy = running(pending)
    copy.fired.set()
    pending.abort()
    assert copy.waited  # waited for the copy before the pages went back
    pending.abort()
    after = engine.stats()
    assert engine.exists(["a", "b"]) == [False, False]
    assert after.entries_filling == 0 and after.host.used_pages == before.host.used_pages
    with pytest.raises(RuntimeError, match="ended"):
        pending.finish()


def test_a_checksum_failing_at_finish_leaves_nothing(engine: CacheEngine) -> None:
    t = blob(2 * PAGE, 3)
    before = engine.stats().host.used_pages
    pending = engine.device.start_put_many(
        [("a", t), ("b", t)], checksums=[zlib.crc32(t.numpy().tobytes()), 1]
    )
    with pytest.raises(ChecksumMismatch):
        pending.finish()
    assert engine.exists(["a", "b"]) == [False, False]
    assert engine.stats().host.used_pages == before and engine.stats().entries_filling == 0


def test_a_cancelled_call_gives_pages_back_once_its_copies_end(engine: CacheEngine) -> None:
    """The gRPC plane's path when a PutFromDevice is cancelled while its copy runs."""
    before = engine.stats().host.used_pages

    async def cancelled() -> tuple[PendingPut, SlowCopy, contextlib.ExitStack]:
        pending = engine.device.start_put_many([("a", blob(4 * PAGE, 1))])
        copy = running(pending)
        stack = contextlib.ExitStack()
        closed: list[bool] = []
        stack.callback(closed.append, True)  # the client's mappings
        grpc_device_puts._abort_when_copied(pending, stack)
        await asyncio.sleep(0.05)
        # still copying: the pages and the mappings are held
        assert engine.stats().entries_filling == 1 and not closed
        copy.fired.set()
        for _ in range(200):
            await asyncio.sleep(0.01)
            if closed:
                break
        assert closed == [True]
        return pending, copy, stack

    asyncio.run(cancelled())
    assert engine.exists(["a"]) == [False]
    assert engine.stats().host.used_pages == before and engine.stats().entries_filling == 0


def test_no_device_pool(shm_name: str) -> None:
    s = Settings(host_pool_bytes=16 * PAGE, page_bytes=PAGE, shm_name=shm_name, device="cpu")
    with CacheEngine(s) as e:
        e.put("a", blob(10, 1))
        with pytest.raises(DeviceUnavailable):
            e.device.get(["a"], "dec")
        assert e.stats().device == [] and e.stats().leases_active == 0
        dest = torch.zeros(64, dtype=torch.uint8)
        assert e.device.get_into(["a"], "dec", dest, [0])[0] is not None  # host-only copy
        assert torch.equal(dest[:10], blob(10, 1))


def test_batch_over_fragmented_device_pages(engine: CacheEngine) -> None:
    for i in range(8):
        engine.put(f"one{i}", blob(DEV_PAGE, 100 + i))
    engine.device.get([f"one{i}" for i in range(8)], "x")  # one page each: pool full
    engine.drop_owner("x")
    pool = engine.device_tier.pool(0)
    for i in range(0, 8, 2):  # free every other device page: four one-page holes
        pool.drop(engine.host_store.peek(f"one{i}"))  # type: ignore[arg-type]
    a, b = blob(DEV_PAGE + 7, 1), blob(2 * DEV_PAGE, 2)
    engine.put("a", a)
    engine.put("b", b)
    [da, db], _ = engine.device.get(["a", "b"], "dec")  # 2 + 2 pages over 4 holes
    assert da is not None and db is not None
    assert da.offset is None and len(da.page_ids) == 2  # straddles two holes
    assert torch.equal(device_bytes(engine, da), a) and torch.equal(device_bytes(engine, db), b)
    assert not set(da.page_ids) & set(db.page_ids)
    check_tables(engine)


@pytest.mark.parametrize(
    ("head_bytes", "calls"),
    # the batch: 8187 + 8192 + 8201 bytes. 0: never split; 12000: the tail would hold less
    # than that; 16384: the batch holds less than twice that
    [(0, 1), (8192, 2), (12000, 1), (16384, 1)],
)
def test_a_large_batch_is_queued_as_head_and_tail(
    engine: CacheEngine, monkeypatch, head_bytes: int, calls: int
) -> None:
    """The first entries of a batch get their pages and their own copy call before the rest
    get theirs, when both parts hold at least HEAD_BYTES; every byte lands either way, over
    fragmented device pages too."""
    from embcache.service.device import loads as device_loads

    monkeypatch.setattr(device_loads, "HEAD_BYTES", head_bytes)
    pool = engine.device_tier.pool(0)
    for i in range(8):
        engine.put(f"one{i}", blob(DEV_PAGE, 100 + i))
    engine.device.get([f"one{i}" for i in range(8)], "x")
    engine.drop_owner("x")
    for i in range(0, 8, 2):  # four one-page holes
        pool.drop(engine.host_store.peek(f"one{i}"))  # type: ignore[arg-type]
    data = [blob(DEV_PAGE - 5, 1), blob(DEV_PAGE, 2), blob(DEV_PAGE + 9, 3)]  # 1 + 1 + 2 pages
    for i, d in enumerate(data):
        engine.put(f"e{i}", d)
    seen: list[tuple[str, int]] = []
    real, reserve = engine.device_tier.copier.transfer, pool.reserve_batch

    def counting(src, dst, s, d, n, stream, **kw):  # type: ignore[no-untyped-def]
        seen.append(("copy", int(n.sum())))
        return real(src, dst, s, d, n, stream, **kw)

    def reserving(entries):  # type: ignore[no-untyped-def]
        seen.append(("reserve", len(entries)))
        return reserve(entries)

    monkeypatch.setattr(engine.device_tier.copier, "transfer", counting)
    monkeypatch.setattr(pool, "reserve_batch", reserving)
    got, _ = engine.device.get([f"e{i}" for i in range(3)], "dec")
    assert [kind for kind, _ in seen] == ["reserve", "copy"] * calls  # each part in turn
    assert sum(n for kind, n in seen if kind == "reserve") == 3
    for dl, d in zip(got, data, strict=True):
        assert dl is not None and torch.equal(device_bytes(engine, dl), d)
    check_tables(engine)


def test_a_tail_that_does_not_fit_gives_the_head_back(engine: CacheEngine, monkeypatch) -> None:
    """The head's copy is queued before the tail's pages are picked; when the tail finds
    no room (the rest of the pool is leased), the call fails as a whole: no lease, no pin,
    no residency, every page of the head free again and the tables as before."""
    from embcache.service.device import loads as device_loads

    monkeypatch.setattr(device_loads, "HEAD_BYTES", 2 * DEV_PAGE)
    pool = engine.device_tier.pool(0)
    for i in range(3):
        engine.put(f"held{i}", blob(DEV_PAGE, 50 + i))
    held, _ = engine.device.get([f"held{i}" for i in range(3)], "holder")  # 3 of 8 pages
    for i in range(4):
        engine.put(f"e{i}", blob(2 * DEV_PAGE, i))  # 8 pages: the head (4) fits, the tail not
    copies: list[int] = []
    real = engine.device_tier.copier.transfer

    def counting(src, dst, s, d, n, stream, **kw):  # type: ignore[no-untyped-def]
        copies.append(int(n.sum()))
        return real(src, dst, s, d, n, stream, **kw)

    monkeypatch.setattr(engine.device_tier.copier, "transfer", counting)
    with pytest.raises(PoolExhausted) as info:
        engine.device.get([f"e{i}" for i in range(4)], "dec")
    assert len(copies) == 1  # the head's copy was queued first
    assert info.value.details["nbytes"] == 8 * DEV_PAGE  # the whole batch
    s = engine.stats()
    assert s.leases_active == 3 and s.device[0].free_pages == 5 and s.device_resident == [3]
    assert all(engine.host_store.peek(f"e{i}").ref_cnt == 0 for i in range(4))  # type: ignore[union-attr]
    assert not any(pool.is_resident(engine.host_store.peek(f"e{i}")) for i in range(4))  # type: ignore[arg-type]
    check_tables(engine)
    engine.release(h.lease.lease_id for h in held if h is not None)
    got, _ = engine.device.get([f"e{i}" for i in range(4)], "dec")  # room now
    for i, g in enumerate(got):
        assert g is not None and torch.equal(device_bytes(engine, g), blob(2 * DEV_PAGE, i))
    check_tables(engine)


def test_batch_keeps_an_entry_that_fits_a_hole_contiguous(engine: CacheEngine) -> None:
    """A batch's pages come from one allocation, but an entry that fits one of its runs
    gets that run whole (a zero-copy view for clients), whatever its place in the batch."""
    for i in range(8):
        engine.put(f"one{i}", blob(DEV_PAGE, 100 + i))
    engine.device.get([f"one{i}" for i in range(8)], "x")
    engine.drop_owner("x")
    pool = engine.device_tier.pool(0)
    for i in (0, 1, 2, 4, 6):  # holes of 3, 1 and 1 pages
        pool.drop(engine.host_store.peek(f"one{i}"))  # type: ignore[arg-type]
    small, big = blob(DEV_PAGE, 1), blob(2 * DEV_PAGE + 1, 2)  # 1 + 3 pages
    engine.put("small", small)
    engine.put("big", big)
    [ds, db], _ = engine.device.get(["small", "big"], "dec")
    assert ds is not None and db is not None
    assert db.offset is not None and len(db.page_ids) == 3, db.page_ids
    assert ds.offset is not None
    assert torch.equal(device_bytes(engine, ds), small)
    assert torch.equal(device_bytes(engine, db), big)
    check_tables(engine)


def test_prefetch_without_shared_tier_warms_the_device(engine: CacheEngine) -> None:
    engine.put("a", blob(100, 1))
    result = engine.prefetch(["a", "a", "nope"], device=0)
    assert result == {"requested": 2, "local": 1, "fetched": 0, "missing": 1, "resident": 1}
    assert engine.entry_info("a").residency == ("host", "device:0")  # type: ignore[union-attr]
    s = engine.stats()
    assert s.leases_active == 0 and (s.hits, s.misses) == (0, 0)  # prefetch is no client hit


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["get", "get", "evict", "flush"]),
            st.lists(st.integers(0, 7), min_size=1, max_size=4, unique=True),
        ),
        max_size=30,
    )
)
@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_deferred_table_updates_net_out(
    engine: CacheEngine, steps: list[tuple[str, list[int]]]
) -> None:
    """Gets that defer their table updates (LRU evictions in between), device evictions and
    flushes in any order: after each flush the tables say exactly what the host knows."""
    for i in range(8):
        engine.put(f"t{i}", blob((1 + i % 3) * DEV_PAGE, i))
    for op, ids in steps:
        keys = [f"t{i}" for i in ids]
        if op == "get":
            if sum(1 + i % 3 for i in ids) > 8:
                continue  # more than the pool holds
            results, _ = engine.device.start_get(keys, "h", defer_tables=True).wait()
            engine.release(r.lease.lease_id for r in results if r is not None)
        elif op == "evict":
            engine.device.evict(keys, 0)
            check_tables(engine)  # an eviction flushes
        else:
            engine.device.flush_tables(0)
            check_tables(engine)
    engine.device.flush_tables(0)
    check_tables(engine)


def test_a_flush_after_close_does_nothing(engine: CacheEngine) -> None:
    """The gRPC plane flushes a little after its gets; one that fires after the engine
    closed finds nothing queued."""
    engine.put("k", blob(DEV_PAGE, 1))
    engine.device.start_get(["k"], "dec", defer_tables=True).wait()
    pool = engine.device_tier.pool(0)
    assert pool.tables_pending
    engine.close()
    assert not pool.tables_pending
    engine.device.flush_tables(0)
    assert set(pool.v2p.tolist()) == {-1}


def test_a_cold_gets_plan_skips_the_checks(engine: CacheEngine, monkeypatch) -> None:
    """The plan of a cold get's copy from the host is made from the allocators' own runs:
    it goes to ``transfer_planned`` (no checks), the same backends as ``transfer_ranges``,
    which the get never calls; the bytes land. (The CUDA backends: GPU tests.)"""
    calls: list[str] = []
    planned, checked = kernels.transfer_planned, kernels.transfer_ranges

    def counting_planned(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append("planned")
        return planned(*args, **kwargs)

    def counting_checked(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append("checked")
        return checked(*args, **kwargs)

    monkeypatch.setattr(kernels, "transfer_planned", counting_planned)
    monkeypatch.setattr(kernels, "transfer_ranges", counting_checked)
    data = [blob(DEV_PAGE + 9, 1), blob(3 * DEV_PAGE - 5, 2)]
    for i, d in enumerate(data):
        engine.put(f"e{i}", d)
    got, _ = engine.device.get(["e0", "e1"], "dec")
    assert calls == ["planned"]
    for dl, d in zip(got, data, strict=True):
        assert dl is not None and torch.equal(device_bytes(engine, dl), d)
    check_tables(engine)
