"""Stashes: pages held for a client process ahead of its puts, committed under keys.

The client's side is played here in process: the test writes into the host pool's array,
as a client does through its own writable mapping of the segment."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from embcache.errors import (
    ChecksumMismatch,
    InvalidArgument,
    MetadataConflict,
    NotFound,
    PermissionDenied,
    QuotaExceeded,
)
from embcache.proto.checksum import crc32
from embcache.service.config import Settings
from embcache.service.engine import CacheEngine
from embcache.service.host.host_pool import SHM_DIR
from embcache.service.host.stash import StashedPut

PAGE = 4096
MiB = 1 << 20


@pytest.fixture
def settings() -> Iterator[Settings]:
    name = f"embcache-test-{uuid.uuid4().hex[:12]}"
    yield Settings(
        host_pool_bytes=4 * MiB, page_bytes=PAGE, shm_name=name, device="cpu",
        max_inflight_bytes_per_client=MiB,
    )  # fmt: skip
    for suffix in ("", ".index", ".index.tmp", ".reads"):
        (SHM_DIR / (name + suffix)).unlink(missing_ok=True)


@pytest.fixture
def engine(settings: Settings) -> Iterator[CacheEngine]:
    with CacheEngine(settings) as engine:
        assert engine.quarantine.bind("s1", os.getpid())
        yield engine


def write(engine: CacheEngine, runs: list[tuple[int, int]], data: bytes) -> None:
    """Write ``data`` into ``runs``, in order, as a client does through its mapping."""
    array, pos = engine.host_pool.array, 0
    for offset, length in runs:
        array[offset : offset + length] = np.frombuffer(data[pos : pos + length], np.uint8)
        pos += length
    assert pos == len(data)


def carve(stash: list[tuple[int, int]], nbytes: int) -> list[tuple[int, int]]:
    """The byte runs of the first pages of ``stash`` holding ``nbytes``, taken out of it."""
    runs: list[tuple[int, int]] = []
    while nbytes > 0:
        offset, length = stash.pop(0)
        take = min(length, -(-nbytes // PAGE) * PAGE)
        if take < length:
            stash.insert(0, (offset + take, length - take))
        runs.append((offset, min(take, nbytes)))
        nbytes -= take
    return runs


def stashed(key: str, runs: list[tuple[int, int]], n: int, **kw: object) -> StashedPut:
    return StashedPut(key, "uint8", (n,), tuple(runs), **kw)  # type: ignore[arg-type]


def payload(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def read(engine: CacheEngine, key: str) -> bytes:
    (lease,) = engine.get([key], "reader")
    assert lease is not None
    data = engine.tensor(lease).numpy().tobytes()
    engine.release([lease.lease_id])
    return data


def test_a_stashed_put_is_visible_with_its_bytes_and_the_rest_stays_held(
    engine: CacheEngine,
) -> None:
    free = engine.stats().host.free_bytes
    stash = engine.stash.refill("s1", ("s1", 11), 64 * 1024)
    assert sum(n for _, n in stash) == 64 * 1024
    assert all(off % PAGE == 0 and n % PAGE == 0 for off, n in stash)
    assert engine.stats().host.free_bytes == free - 64 * 1024
    data = payload(10_000, 1)  # 3 pages, the last one partly
    runs = carve(stash, len(data))
    write(engine, runs, data)
    assert engine.stash.commit("s1", ("s1", 11), [stashed("k", runs, len(data))]) == [True]
    assert read(engine, "k") == data
    assert engine.read_table is not None and len(engine.read_table) == 1  # published
    # The rest of the stash is still held; the client's word gives it back.
    assert engine.stats().host.free_bytes == free - 64 * 1024
    assert engine.stash.give_back("s1", 11)
    assert engine.stats().host.free_bytes == free - 3 * PAGE
    with pytest.raises(NotFound):
        engine.stash.commit("s1", ("s1", 11), [stashed("j", carve(stash, 10), 10)])


def test_pages_outside_the_stash_are_refused_and_nothing_changes(engine: CacheEngine) -> None:
    stash = engine.stash.refill("s1", ("s1", 5), 8 * PAGE)
    other = engine.stash.refill("s1", ("s1", 6), 2 * PAGE)
    ((offset, _),) = other
    for runs in ([(offset, PAGE)], [(stash[0][0] + 1, PAGE)], [(stash[0][0], 8 * PAGE + PAGE)]):
        with pytest.raises(InvalidArgument):
            n = sum(length for _, length in runs)
            engine.stash.commit("s1", ("s1", 5), [stashed("x", runs, n)])
    twice = [stashed("a", [(stash[0][0], PAGE)], PAGE), stashed("b", [(stash[0][0], PAGE)], PAGE)]
    with pytest.raises(InvalidArgument):
        engine.stash.commit("s1", ("s1", 5), twice)
    assert engine.exists(["x", "a", "b"]) == [False, False, False]
    # The stash is whole still: all of it can be committed.
    runs = carve(list(stash), 8 * PAGE)
    write(engine, runs, payload(8 * PAGE, 2))
    assert engine.stash.commit("s1", ("s1", 5), [stashed("x", runs, 8 * PAGE)]) == [True]


def test_a_refused_commit_leaves_no_entry_and_its_pages_go_back(engine: CacheEngine) -> None:
    stash = engine.stash.refill("s1", ("s1", 9), 4 * PAGE)
    free = engine.stats().host.free_bytes
    data = payload(2 * PAGE, 3)
    good = carve(stash, PAGE)
    bad = carve(stash, PAGE)
    write(engine, good + bad, data)
    puts = [
        stashed("good", good, PAGE, checksum=crc32(data[:PAGE])),
        stashed("bad", bad, PAGE, checksum=crc32(data[:PAGE])),  # not its bytes
    ]
    with pytest.raises(ChecksumMismatch):
        engine.stash.commit("s1", ("s1", 9), puts)
    assert engine.exists(["good", "bad"]) == [False, False]  # all or nothing
    assert engine.stats().host.free_bytes == free + 2 * PAGE  # consumed: the writer moved on
    with pytest.raises(InvalidArgument):  # no longer in the stash
        engine.stash.commit("s1", ("s1", 9), [stashed("good", good, PAGE)])


def test_an_existing_key_is_not_created_and_other_metadata_conflicts(
    engine: CacheEngine,
) -> None:
    engine.put("k", torch.zeros(PAGE, dtype=torch.uint8))
    stash = engine.stash.refill("s1", ("s1", 3), 4 * PAGE)
    free = engine.stats().host.free_bytes
    runs = carve(stash, PAGE)
    write(engine, runs, bytes(PAGE))
    assert engine.stash.commit("s1", ("s1", 3), [stashed("k", runs, PAGE)]) == [False]
    assert engine.stats().host.free_bytes == free + PAGE
    runs = carve(stash, 2 * PAGE)
    with pytest.raises(MetadataConflict):
        engine.stash.commit("s1", ("s1", 3), [stashed("k", runs, 2 * PAGE)])


def test_a_stash_counts_against_the_clients_quota(engine: CacheEngine) -> None:
    engine.stash.refill("s1", ("s1", 1), MiB // 2)
    with pytest.raises(QuotaExceeded):
        engine.stash.refill("s1", ("s1", 2), MiB // 2 + PAGE)
    assert engine.stash.give_back("s1", 1)
    engine.stash.refill("s1", ("s1", 2), MiB)


def test_spare_pages_evict_nothing_while_the_pool_has_room_within_quota(
    engine: CacheEngine,
) -> None:
    # 4 MiB pool, 1 MiB quota: fill it with entries but 3 pages
    pages = engine.stats().host.free_bytes // PAGE
    for i in range(pages - 3):
        engine.put(f"e{i}", torch.full((PAGE,), i % 251, dtype=torch.uint8))
    stash = engine.stash.refill("s1", ("s1", 1), PAGE, extra_bytes=64 * PAGE)
    assert sum(n for _, n in stash) == 3 * PAGE  # what it needs, and the 2 pages free
    assert engine.exists([f"e{i}" for i in range(pages - 3)]) == [True] * (pages - 3)
    assert engine.stash.give_back("s1", 1)
    # what it needs may evict, as a put does; then the pool is full (every put evicts),
    # and the spare pages evict too
    stash = engine.stash.refill("s1", ("s1", 2), 5 * PAGE, extra_bytes=4 * PAGE)
    assert sum(n for _, n in stash) == 9 * PAGE
    assert engine.exists([f"e{i}" for i in range(7)]) == [False] * 6 + [True]
    assert engine.stash.give_back("s1", 2)
    # the spare pages stay within the quota (1 MiB in unfinished puts and stashes)
    engine.evict([f"e{i}" for i in range(pages - 3)])
    stash = engine.stash.refill("s1", ("s1", 3), PAGE, extra_bytes=4 * MiB)
    assert sum(n for _, n in stash) == MiB


def test_a_session_without_a_known_process_gets_no_stash(engine: CacheEngine) -> None:
    with pytest.raises(PermissionDenied):
        engine.stash.refill("s2", ("s2", 1), PAGE)


def test_a_stash_of_a_process_that_exited_is_reclaimed(settings: Settings) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with CacheEngine(settings) as engine:
            free = engine.stats().host.free_bytes
            assert engine.quarantine.bind("c", child.pid)
            engine.stash.refill("c", ("c", 4), 16 * PAGE)
            assert engine.quarantine.reap() == 0  # alive: held
            assert engine.stats().host.free_bytes == free - 16 * PAGE
            child.kill()
            child.wait()
            assert engine.quarantine.reap() == 1
            assert engine.stats().host.free_bytes == free
    finally:
        child.kill()
        child.wait()


def test_a_warm_restart_adopts_stashed_entries_and_keeps_the_rest_held(
    settings: Settings,
) -> None:
    warm = settings.model_copy(update={"warm_restart": True})
    data = payload(3 * PAGE + 5, 4)
    engine = CacheEngine(warm)
    try:
        assert engine.quarantine.bind("s1", os.getpid())
        stash = engine.stash.refill("s1", ("s1", 2), 8 * PAGE)
        runs = carve(stash, len(data))
        write(engine, runs, data)
        assert engine.stash.commit("s1", ("s1", 2), [stashed("w", runs, len(data))]) == [True]
    finally:
        engine.close(keep_segment=True)  # as a SIGKILL would leave it: the stash not given back
    with CacheEngine(warm) as engine:
        assert engine.adopted.write_holds == 1  # the 4 pages left, held for this process
        assert engine.stats().quarantined_bytes == 4 * PAGE
        assert read(engine, "w") == data  # adopted, its CRC32 checked
