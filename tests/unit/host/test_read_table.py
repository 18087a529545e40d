"""The read table (service/host/read_table.py, clients/device/read_table.py): what the host
store publishes and withdraws, and what a reader mapping it copies, bit for bit; a copy the
daemon changed or withdrew meanwhile is refused; full buckets, long run lists and deep
shapes stay out; a shut or replaced table is never read; the reader's mapping is read-only."""

from __future__ import annotations

import mmap
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from embcache.clients.device import read_table as client_table
from embcache.clients.device.read_table import Located, ReadTable, ReadTables
from embcache.proto import read_table as rt
from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.service.config import Settings
from embcache.service.engine import CacheEngine
from embcache.service.host.read_table import buckets_for, close_stale, table_path
from embcache.service.transport.handlers.device import pool_handle_of
from embcache.service.transport.render import LocationRenderer
from embcache.service.transport.session.service import read_table_info

PAGE = 4096
pytestmark = pytest.mark.skipif(not client_table.ORDERED_STORES, reason="x86-64 only")


def make_engine(shm_name: str, **extra: int) -> CacheEngine:
    return CacheEngine(
        Settings(
            host_pool_bytes=256 * PAGE,
            page_bytes=PAGE,
            shm_name=shm_name,
            warm_restart=False,
            **extra,
        )
    )


def four_entry_engine(shm_name: str) -> CacheEngine:
    """At most four entries: a table of one bucket (``rt.WAYS`` slots)."""
    return make_engine(shm_name, max_entries=4)


@pytest.fixture
def engine(shm_name: str) -> Iterator[CacheEngine]:
    with make_engine(shm_name) as eng:
        yield eng


def info_of(engine: CacheEngine) -> pb.ReadTableInfo:
    pool = pool_handle_of(LocationRenderer(engine, engine.settings).host_pool())
    info = read_table_info(engine.read_table, pool)
    assert info is not None
    return info


def reader(engine: CacheEngine) -> ReadTable:
    table = ReadTables().get(info_of(engine))
    assert table is not None
    return table


def same(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    return (
        a is not None
        and a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


CASES = {
    "bf16": torch.randn(37, 13).to(torch.bfloat16),  # odd rows
    "fp32": torch.randn(4, 2048),  # two pages
    "int64": torch.arange(-5, 5, dtype=torch.int64),
    "bool": torch.tensor([True, False, True]),
    "scalar": torch.tensor(3.5, dtype=torch.float64),
    "empty": torch.empty(0, 7, dtype=torch.float16),
    "fp8": torch.randn(33).to(torch.float8_e4m3fn),
}


def test_a_reader_copies_every_published_entry_bit_for_bit(engine: CacheEngine) -> None:
    for key, t in CASES.items():
        engine.put(key, t)
    table = reader(engine)
    for key, t in CASES.items():
        got = table.read(key, 1 << 30)
        assert same(got, t), key
        assert got is not None and (not t.numel() or got.data_ptr() != t.data_ptr())
    assert table.read("never-put", 1 << 30) is None
    assert len(engine.read_table or ()) == len(CASES)
    assert engine.stats().read_table["entries"] == len(CASES)


def fill_then_punch(engine: CacheEngine) -> None:
    """Fill the pool with one-page entries, then free every other page: new entries of
    several pages land in several runs."""
    pages = engine.host_pool.num_pages
    for i in range(pages):
        engine.put(f"f{i}", torch.full((PAGE // 4,), i, dtype=torch.float32))
    engine.evict([f"f{i}" for i in range(0, pages, 2)])


def test_fragmented_entries_are_read_whole(engine: CacheEngine) -> None:
    fill_then_punch(engine)
    big = torch.randn(5 * PAGE // 4)  # five pages, in five runs
    engine.put("big", big)
    entry = engine.host_store.peek("big")
    assert entry is not None and len(entry.runs) > 1
    assert same(reader(engine).read("big", 1 << 30), big)


def test_a_larger_entry_than_the_limit_is_left_to_the_daemon(engine: CacheEngine) -> None:
    engine.put("k", torch.zeros(256, dtype=torch.float32))  # 1 KiB
    table = reader(engine)
    assert table.read("k", 1023) is None
    assert table.read("k", 1024) is not None


def test_withdrawn_entries_are_gone_and_reused_pages_read_as_the_new_entry(
    engine: CacheEngine,
) -> None:
    table = reader(engine)
    engine.put("k", torch.full((PAGE // 4,), 1.0))
    assert same(table.read("k", 1 << 30), torch.full((PAGE // 4,), 1.0))
    engine.evict(["k"])
    assert table.read("k", 1 << 30) is None
    engine.put("other", torch.full((PAGE // 4,), 7.0))  # may reuse k's page
    engine.put("k", torch.full((PAGE // 4,), 2.0))
    assert same(table.read("k", 1 << 30), torch.full((PAGE // 4,), 2.0))
    assert same(table.read("other", 1 << 30), torch.full((PAGE // 4,), 7.0))


def test_an_entry_withdrawn_during_the_copy_is_refused(
    engine: CacheEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon evicts the entry and reuses its page while the reader copies: the slot's
    sequence changed, so the copy (which may hold either bytes) is never returned."""
    engine.put("k", torch.full((PAGE // 4,), 1.0))
    table = reader(engine)
    real = ReadTable.copy_host

    def racing(self: ReadTable, located: Located, out: torch.Tensor | None = None) -> torch.Tensor:
        copied = real(self, located, out)
        engine.evict(["k"])
        engine.put("k2", torch.full((PAGE // 4,), 9.0))
        return copied

    monkeypatch.setattr(ReadTable, "copy_host", racing)
    assert table.read("k", 1 << 30) is None
    monkeypatch.setattr(ReadTable, "copy_host", real)
    assert table.read("k", 1 << 30) is None  # gone for good
    assert same(table.read("k2", 1 << 30), torch.full((PAGE // 4,), 9.0))


def test_a_slot_being_rewritten_is_not_read(engine: CacheEngine) -> None:
    engine.put("k", torch.ones(8))
    table = reader(engine)
    live = engine.read_table
    assert live is not None
    at = live._slot_of["k"]
    seq = live._begin(at)  # the daemon is mid-change (its sequence odd)
    assert table.read("k", 1 << 30) is None
    live._end(at, seq)
    assert same(table.read("k", 1 << 30), torch.ones(8))


def test_an_entry_evicted_for_room_is_withdrawn(shm_name: str) -> None:
    with four_entry_engine(shm_name) as engine:
        for i in range(5):  # the fifth evicts the least recently used (max_entries)
            engine.put(f"k{i}", torch.full((3,), float(i)))
        table = reader(engine)
        assert table.read("k0", 1 << 30) is None
        for i in range(1, 5):
            assert same(table.read(f"k{i}", 1 << 30), torch.full((3,), float(i)))
        assert engine.stats().read_table == {
            "entries": 4,
            "skipped": 0,
            "reads": 0,
            "device_published": 0,
            "device_withdrawn": 0,
            "device_skipped": 0,
        }


def test_a_full_bucket_leaves_the_entry_to_the_daemon(shm_name: str) -> None:
    with four_entry_engine(shm_name) as engine:
        live = engine.read_table
        assert live is not None and live.num_buckets == 1  # WAYS slots in all
        engine.host_store.max_entries = 1000  # more entries than the table was sized for
        for i in range(rt.WAYS):
            engine.put(f"w{i}", torch.ones(1))
        engine.put("overflow", torch.ones(1))  # its bucket (the only one) is full
        assert live.skipped == 1
        table = reader(engine)
        assert table.read("overflow", 1 << 30) is None
        engine.evict(["w0"])  # a way frees up for the next entry
        engine.put("next", torch.ones(3))
        assert same(table.read("next", 1 << 30), torch.ones(3))


def test_entries_with_more_runs_than_a_slot_holds_stay_out(engine: CacheEngine) -> None:
    fill_then_punch(engine)
    spread = torch.randn((rt.MAX_RUNS + 1) * PAGE // 4)  # more runs than a slot holds
    engine.put("spread", spread)
    entry = engine.host_store.peek("spread")
    assert entry is not None and len(entry.runs) > rt.MAX_RUNS
    assert reader(engine).read("spread", 1 << 30) is None
    assert engine.read_table is not None and engine.read_table.skipped == 1
    assert engine.stats().read_table["skipped"] == 1


def test_a_draining_or_closed_engine_shuts_the_table(shm_name: str) -> None:
    settings = Settings(
        host_pool_bytes=64 * PAGE, page_bytes=PAGE, shm_name=shm_name, warm_restart=False
    )
    engine = CacheEngine(settings)
    engine.put("k", torch.ones(4))
    table = reader(engine)
    path = table_path(engine.host_pool.path)
    engine.begin_drain()
    assert table.read("k", 1 << 30) is None
    assert read_table_info(engine.read_table, pb.PoolHandle()) is None  # not offered
    engine.close()
    assert not path.exists()
    assert table.read("k", 1 << 30) is None  # the old mapping stays readable, and shut


def test_a_new_daemon_shuts_the_table_it_replaces(engine: CacheEngine) -> None:
    """A warm restart adopts the segment: the old table's readers must stop before any page
    is reused, even when the old daemon died without shutting it."""
    engine.put("k", torch.ones(4))
    table = reader(engine)
    live = engine.read_table
    assert live is not None
    close_stale(live.path)  # what the next daemon does first
    assert table.read("k", 1 << 30) is None
    assert not live.path.exists()
    close_stale(live.path)  # nothing there: nothing done
    live.remove()  # ours was unlinked by another: nothing else removed


def test_the_reader_maps_the_table_read_only_with_the_segment_mode(
    engine: CacheEngine,
) -> None:
    live = engine.read_table
    assert live is not None
    assert stat.S_IMODE(os.stat(live.path).st_mode) == 0o600
    table = reader(engine)
    with pytest.raises(TypeError):
        table._view[0] = 1  # a read-only mapping
    assert isinstance(table._mm, mmap.mmap)


def test_a_table_of_another_layout_or_identity_is_not_used(
    engine: CacheEngine, tmp_path: Path
) -> None:
    info = info_of(engine)
    wrong = pb.ReadTableInfo()
    wrong.CopyFrom(info)
    wrong.st_ino += 1
    assert ReadTables().get(wrong) is None
    assert ReadTables().get(None) is None
    other = pb.ReadTableInfo()
    other.CopyFrom(info)
    other.pool.host_shm.boot_id = "another-machine"
    assert ReadTables().get(other) is None
    # A file with another version beside a copy of the pool's handle.
    fake = tmp_path / "fake.reads"
    fake.write_bytes(bytes(rt.file_bytes(1)))
    with open(fake, "r+b") as f, mmap.mmap(f.fileno(), 0) as mm:
        rt.HEADER.pack_into(mm, 0, rt.MAGIC, rt.VERSION + 1, rt.SLOT_BYTES, rt.WAYS,
                            rt.MAX_DIMS, rt.MAX_RUNS, 0, 1, PAGE, 0)  # fmt: skip
    st_ = os.stat(fake)
    versioned = pb.ReadTableInfo(name="fake.reads", size=st_.st_size, st_dev=st_.st_dev,
                                 st_ino=st_.st_ino, pool=info.pool)  # fmt: skip
    assert ReadTables(shm_dir=tmp_path).get(versioned) is None
    escaping = pb.ReadTableInfo()
    escaping.CopyFrom(info)
    escaping.name = "../etc/passwd"
    assert ReadTables().get(escaping) is None


def test_buckets_grow_with_the_entries_and_stop_at_the_cap() -> None:
    assert buckets_for(1) == 1
    assert buckets_for(4) == 1
    assert buckets_for(5) == 2
    assert buckets_for(1000) == 256
    assert buckets_for(10**9) == 1 << 17


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(st.tuples(st.sampled_from("pe"), st.integers(0, 11)), max_size=60))
def test_the_table_answers_as_the_cache_does(
    engine: CacheEngine, steps: list[tuple[str, int]]
) -> None:
    """Random puts and evictions: every key reads as its latest value, or not at all."""
    engine.evict([e.key for e in engine.host_store.snapshot("ready")])
    model: dict[str, torch.Tensor] = {}
    table = reader(engine)
    for n, (op, i) in enumerate(steps):
        key = f"m{i}"
        if op == "p" and key not in model:
            value = torch.full((i * 300 + 1,), float(n))
            engine.put(key, value)
            model[key] = value
        elif op == "e":
            engine.evict([key])
            model.pop(key, None)
        for k in (f"m{j}" for j in range(12)):
            got = table.read(k, 1 << 30)
            if k in model:
                assert same(got, model[k]), k
            else:
                assert got is None, k
