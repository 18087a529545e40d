"""The warm-restart index: its records round-trip, a torn tail is dropped, compaction keeps
exactly the live records, and an engine adopts what the index holds (in process)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from embcache.proto.dtypes import lookup
from embcache.service.config import Settings
from embcache.service.engine import CacheEngine
from embcache.service.host import index_records as rec
from embcache.service.host import pool_index
from embcache.service.host.allocator import PageRunAllocator
from embcache.service.host.entries import Entry, EntryState
from embcache.service.host.host_pool import SHM_DIR
from embcache.service.host.pool_index import PoolIndex, index_path, replay
from embcache.service.host.quarantine import ProcessRef

HEADER = rec.Header(rec.LAYOUT_VERSION, 4096, 256, 7, 3)


def entry(key: str, runs: tuple[tuple[int, int], ...], nbytes: int = 4096) -> Entry:
    dtype = lookup("uint8")
    assert dtype is not None
    return Entry(key, dtype, (nbytes,), nbytes, runs, EntryState.READY)


def test_records_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "x.index"
    index = PoolIndex.create(path, HEADER)
    index.add(entry("a", ((0, 1),)), 11)
    index.add(entry("b/ü", ((3, 2), (9, 1)), 3 * 4096 - 5), 22)
    index.add(entry("c", ((20, 1),)), 33)
    index.delete("c")
    me = ProcessRef.of(os.getpid())
    assert me is not None
    index.hold(5, me, "a")
    index.hold(6, me, "b/ü")
    index.unhold(6)
    index.close()
    found = replay(path)
    assert found.header == HEADER and not found.torn
    assert list(found.adds) == ["a", "b/ü"]
    b = found.adds["b/ü"]
    assert b.runs == ((3, 2), (9, 1)) and b.nbytes == 3 * 4096 - 5 and b.crc == 22
    assert b.shape == (3 * 4096 - 5,) and b.dtype.name == "uint8" and b.generation == 3
    assert list(found.holds) == [5] and found.holds[5].pid == os.getpid()


@pytest.mark.parametrize("cut", [1, 5, 9, 20])
def test_a_torn_tail_is_dropped(tmp_path: Path, cut: int) -> None:
    path = tmp_path / "x.index"
    index = PoolIndex.create(path, HEADER)
    index.add(entry("a", ((0, 1),)), 1)
    index.add(entry("b", ((1, 1),)), 2)
    index.close()
    data = path.read_bytes()
    path.write_bytes(data[:-cut])  # the last record, torn by a crash
    found = replay(path)
    assert list(found.adds) == ["a"] and found.torn


def test_a_flipped_byte_ends_the_replay_there(tmp_path: Path) -> None:
    path = tmp_path / "x.index"
    index = PoolIndex.create(path, HEADER)
    index.add(entry("a", ((0, 1),)), 1)
    at = path.stat().st_size
    index.add(entry("b", ((1, 1),)), 2)
    index.add(entry("c", ((2, 1),)), 3)
    index.close()
    data = bytearray(path.read_bytes())
    data[at + 12] ^= 0x40
    path.write_bytes(bytes(data))
    assert list(replay(path).adds) == ["a"]


def test_a_bad_header_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.index"
    path.write_bytes(b"\0" * 100)
    with pytest.raises(rec.IndexFormatError):
        replay(path)


def test_compaction_keeps_the_live_records(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pool_index, "_SLACK", 4)
    path = tmp_path / "x.index"
    index = PoolIndex.create(path, HEADER)
    for i in range(200):
        index.add(entry(f"k{i}", ((i, 1),)), i)
        if i % 3:
            index.delete(f"k{i}")
    index.close()
    assert path.stat().st_size < 120 * 60  # rewritten: not 333 records
    found = replay(path)
    assert list(found.adds) == [f"k{i}" for i in range(0, 200, 3)]
    assert not path.with_name(path.name + ".tmp").exists()


def test_allocator_with_used_runs_frees_the_rest() -> None:
    alloc = PageRunAllocator.with_used(100, [(10, 5), (0, 2), (50, 50)])
    assert alloc.num_free_pages == 43
    assert alloc.free_runs() == [(2, 8), (15, 35)]
    alloc.free([(10, 5)])
    assert alloc.free_runs() == [(2, 48)]


@pytest.fixture
def settings(shm_name: str) -> Iterator[Settings]:
    yield Settings(host_pool_bytes=4 << 20, page_bytes=4096, shm_name=shm_name, device="cpu")
    for suffix in ("", ".index", ".index.tmp", ".reads"):
        (SHM_DIR / (shm_name + suffix)).unlink(missing_ok=True)


def fill(engine: CacheEngine, n: int) -> dict[str, torch.Tensor]:
    out = {}
    for i in range(n):
        t = torch.arange(i * 1000, i * 1000 + 700 * (i + 1), dtype=torch.int32)
        engine.put(f"k{i}", t)
        out[f"k{i}"] = t
    return out


def read(engine: CacheEngine, key: str) -> torch.Tensor | None:
    (lease,) = engine.get([key], "test")
    if lease is None:
        return None
    try:
        return engine.tensor(lease).clone()
    finally:
        engine.release([lease.lease_id])


def test_an_engine_adopts_what_the_last_one_kept(settings: Settings) -> None:
    engine = CacheEngine(settings)
    want = fill(engine, 12)
    engine.evict(["k4"])
    del want["k4"]
    engine.close(keep_segment=True)
    assert index_path(SHM_DIR / settings.shm_name).exists()
    engine = CacheEngine(settings)
    try:
        assert engine.adopted.entries == 11
        for key, t in want.items():
            got = read(engine, key)
            assert got is not None and torch.equal(got, t), key
        assert read(engine, "k4") is None
        engine.put("new", torch.ones(5000, dtype=torch.int32))  # the allocator knows its pages
        for key, t in want.items():
            got = read(engine, key)
            assert got is not None and torch.equal(got, t), key
    finally:
        engine.close()
    assert not (SHM_DIR / settings.shm_name).exists()
    assert not index_path(SHM_DIR / settings.shm_name).exists()


def test_a_corrupt_entry_is_dropped_when_first_read(settings: Settings) -> None:
    engine = CacheEngine(settings)
    fill(engine, 3)
    (lease,) = engine.get(["k1"], "test")
    assert lease is not None
    offset = lease.byte_runs[0][0]
    engine.release([lease.lease_id])
    engine.close(keep_segment=True)
    with (SHM_DIR / settings.shm_name).open("r+b") as f:
        f.seek(offset + 100)
        f.write(b"\xff\xfe")
    engine = CacheEngine(settings)
    try:
        assert engine.verifier is not None
        engine.verifier.thread.join(10)  # the background pass may find it first; either way
        assert read(engine, "k1") is None and read(engine, "k0") is not None
        restart = engine.stats().restart
        assert restart["dropped_checksum_entries"] == 1 and restart["unverified_entries"] == 0
        assert engine.put("k1", torch.zeros(10, dtype=torch.int32))  # its pages went back
    finally:
        engine.close()


def test_warm_restart_off_removes_a_stale_index(settings: Settings) -> None:
    engine = CacheEngine(settings)
    fill(engine, 2)
    engine.close(keep_segment=True)
    cold = settings.model_copy(update={"warm_restart": False})
    engine = CacheEngine(cold)
    try:
        assert engine.stats().entries_ready == 0
        assert not index_path(SHM_DIR / settings.shm_name).exists()
    finally:
        engine.close()


def test_a_batch_is_one_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "x.index"
    index = PoolIndex.create(path, HEADER)
    writes: list[int] = []
    real = os.write

    def counting(fd: int, data: bytes) -> int:
        writes.append(len(data))
        return real(fd, data)

    monkeypatch.setattr(pool_index.os, "write", counting)
    me = ProcessRef.of(os.getpid())
    assert me is not None
    with index.batch():
        for i in range(50):
            index.hold(i, me, f"k{i}")
        with index.batch():  # nested: the outer one writes
            index.unhold(3)
        assert writes == []
    assert len(writes) == 1
    index.close()
    assert sorted(replay(path).holds) == [i for i in range(50) if i != 3]


def test_records_whose_runs_overlap_or_leave_the_pool_are_dropped(settings: Settings) -> None:
    engine = CacheEngine(settings)
    want = fill(engine, 3)
    (lease,) = engine.get(["k0"], "test")
    assert lease is not None
    runs, dtype = lease.entry.runs, lookup("uint8")  # records a put would accept
    assert dtype is not None
    engine.release([lease.lease_id])
    engine.close(keep_segment=True)
    path = index_path(SHM_DIR / settings.shm_name)
    evil = rec.AddRecord("evil", dtype, (700,), 700, runs, 0, 0)  # k0's pages again
    outside = rec.AddRecord("out", dtype, (700,), 700, ((1 << 20, 1),), 0, 0)
    with path.open("ab") as f:
        f.write(rec.encode_add(evil) + rec.encode_add(outside))
    engine = CacheEngine(settings)
    try:
        assert engine.adopted.dropped_invalid == 2 and engine.adopted.entries == 3
        for key, t in want.items():
            got = read(engine, key)
            assert got is not None and torch.equal(got, t), key
        assert read(engine, "evil") is None and read(engine, "out") is None
    finally:
        engine.close()
