"""Pages a client fills itself (its stashes): held out of reuse while its process runs,
sessions or not; its word, a commit, or its exit gives them back; a warm start keeps those
of live processes out of the allocator; the index records round-trip."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from embcache.errors import PermissionDenied, QuotaExceeded
from embcache.service.config import Settings
from embcache.service.engine import CacheEngine
from embcache.service.host import index_records as rec
from embcache.service.host.host_pool import SHM_DIR
from embcache.service.host.pool_index import PoolIndex, replay
from embcache.service.host.quarantine import ProcessRef
from embcache.service.host.stash import StashedPut

MiB = 1 << 20
HEADER = rec.Header(rec.LAYOUT_VERSION, 4096, 256, 7, 3)


@pytest.fixture
def settings() -> Iterator[Settings]:
    name = f"embcache-test-{uuid.uuid4().hex[:12]}"
    yield Settings(host_pool_bytes=4 * MiB, page_bytes=4096, shm_name=name, device="cpu")
    for suffix in ("", ".index", ".index.tmp", ".reads"):
        (SHM_DIR / (name + suffix)).unlink(missing_ok=True)


def free_bytes(engine: CacheEngine) -> int:
    return engine.stats().host.free_bytes


def stash(engine: CacheEngine, token: int = 7, owner: str = "s1") -> list[tuple[int, int]]:
    """A stash of 1 MiB held for ``owner``'s process, known by ``token``."""
    return engine.stash.refill("quota", (owner, token), MiB)


def test_a_stash_is_held_until_its_writer_says_it_is_done(settings: Settings) -> None:
    with CacheEngine(settings) as engine:
        assert engine.quarantine.bind("s1", os.getpid())
        total = free_bytes(engine)
        stash(engine)
        stats = engine.stats()
        assert stats.entries_filling == 0 and stats.host.free_bytes == total - MiB
        assert stats.quarantined_bytes == MiB
        assert not engine.stash.give_back("s1", 8)  # not its id
        assert not engine.stash.give_back("s2", 7)  # no such process
        assert engine.stash.give_back("s1", 7)  # its word: it stopped writing
        assert free_bytes(engine) == total and engine.stats().quarantined_bytes == 0


def test_a_commit_moves_its_pages_to_the_entry_at_once(settings: Settings) -> None:
    with CacheEngine(settings) as engine:
        assert engine.quarantine.bind("s1", os.getpid())
        total = free_bytes(engine)
        runs = stash(engine)
        half = [(off, n) for off, n in runs][:1]
        take = min(half[0][1], MiB // 2)
        put = StashedPut("b", "uint8", (take,), ((half[0][0], take),))
        assert engine.stash.commit("quota", ("s1", 7), [put]) == [True]
        assert engine.stats().quarantined_bytes == MiB - take  # the rest: still held
        assert engine.stash.give_back("s1", 7)
        assert free_bytes(engine) == total - take and engine.stats().quarantined_bytes == 0


def test_held_pages_count_against_the_writers_quota(settings: Settings) -> None:
    settings = settings.model_copy(update={"max_inflight_bytes_per_client": 2 * MiB})
    with CacheEngine(settings) as engine:
        assert engine.quarantine.bind("s1", os.getpid())
        stash(engine, token=1)
        stash(engine, token=2)
        with pytest.raises(QuotaExceeded, match="unfinished puts"):
            stash(engine, token=3)
        with pytest.raises(QuotaExceeded):  # a put's reservation counts against it too
            engine.begin_put("c", "uint8", (MiB,), owner="quota")
        assert engine.stash.give_back("s1", 1)
        stash(engine, token=3)


def test_a_writer_that_exited_holds_nothing_and_the_reaper_frees_the_rest(
    settings: Settings,
) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        with CacheEngine(settings) as engine:
            total = free_bytes(engine)
            assert engine.quarantine.bind("child", child.pid)
            stash(engine, owner="child")
            assert free_bytes(engine) == total - MiB  # held: the child runs
            assert engine.quarantine.reap() == 0
            assert child.stdin is not None
            child.stdin.close()
            child.wait(10)
            assert engine.quarantine.reap() == 1
            assert free_bytes(engine) == total
            with pytest.raises(PermissionDenied):  # a writer gone gets no stash
                stash(engine, owner="child")
            assert free_bytes(engine) == total
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)


def test_a_warm_start_keeps_a_live_writers_pages_out_of_the_allocator(
    settings: Settings,
) -> None:
    engine = CacheEngine(settings)
    assert engine.quarantine.bind("s1", os.getpid())
    runs = tuple(stash(engine))
    engine.close(keep_segment=True)  # as under a SIGKILL: nothing given back
    with CacheEngine(settings) as engine:
        assert engine.adopted.write_holds == 1
        assert engine.stats().quarantined_bytes == MiB
        held = covered(runs)
        for i in range(8):  # twice the pool's worth, evicting: never the held pages
            h = engine.begin_put(f"k{i}", "uint8", (MiB,))
            assert not covered(h.byte_runs) & held
            h.write(bytes(MiB))
            h.commit()


def covered(byte_runs: tuple[tuple[int, int], ...]) -> set[int]:
    """The 4 KiB pages that byte runs touch."""
    return {p for off, n in byte_runs for p in range(off // 4096, -(-(off + n) // 4096))}


def test_write_records_round_trip_and_a_whole_unusable_record_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "x.index"
    index = PoolIndex.create(path, HEADER)
    me = ProcessRef.of(os.getpid())
    assert me is not None
    index.write(5, me, ((1, 2), (9, 1)))
    index.write(6, me, ((20, 1),))
    index.unwrite(6)
    index.close()
    with path.open("ab") as f:  # whole records this daemon cannot use, then a valid one
        f.write(rec.frame(bytes([99, 1, 2, 3])))
        f.write(rec.frame(bytes([rec.ADD]) + b"\xff" * 3))
    index = PoolIndex(path, HEADER)
    index._fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    index.write(8, me, ((30, 1),))
    index.close()
    found = replay(path)
    assert sorted(found.writes) == [5, 8] and not found.torn
    assert found.writes[5].runs == ((1, 2), (9, 1)) and found.writes[5].pid == os.getpid()
    assert len(found.skipped) == 2


def test_a_writer_whose_process_is_unknown_is_refused_before_any_page(settings: Settings) -> None:
    with CacheEngine(settings) as engine:
        total = free_bytes(engine)
        with pytest.raises(PermissionDenied):
            stash(engine, owner="nobody-bound")
        assert free_bytes(engine) == total and engine.stats().quarantined_bytes == 0
