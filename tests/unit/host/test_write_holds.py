"""Pages a client fills itself: an end of the reservation without the client's word keeps
them out of reuse while its process runs; its word, or its exit, gives them back; a warm
start keeps those of live processes out of the allocator; the index records round-trip."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from embcache.service.config import Settings
from embcache.service.engine import CacheEngine
from embcache.service.host import index_records as rec
from embcache.service.host.host_pool import SHM_DIR
from embcache.service.host.pool_index import PoolIndex, replay
from embcache.service.host.quarantine import ProcessRef

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


def reserve(engine: CacheEngine, key: str, token: int = 7, owner: str = "s1"):  # type: ignore[no-untyped-def]
    return engine.begin_put(key, "uint8", (MiB,), owner="quota", writer=(owner, token))


def test_an_end_without_the_writers_word_holds_the_pages_until_it_says_so(
    settings: Settings,
) -> None:
    with CacheEngine(settings) as engine:
        assert engine.quarantine.bind("s1", os.getpid())
        total = free_bytes(engine)
        handle = reserve(engine, "a")
        handle.abort()  # a forced end: this process may still be copying
        stats = engine.stats()
        assert stats.entries_filling == 0 and stats.host.free_bytes == total - MiB
        assert stats.quarantined_bytes == MiB
        assert not engine.writer_done("s1", 8)  # not its id
        assert not engine.writer_done("s2", 7)  # no such process
        assert engine.writer_done("s1", 7)  # its word: the copy stopped
        assert free_bytes(engine) == total and engine.stats().quarantined_bytes == 0


def test_the_writers_own_abort_or_commit_frees_at_once(settings: Settings) -> None:
    with CacheEngine(settings) as engine:
        assert engine.quarantine.bind("s1", os.getpid())
        total = free_bytes(engine)
        reserve(engine, "a").abort(writer_stopped=True)
        assert free_bytes(engine) == total
        handle = reserve(engine, "b")
        handle.filled_in_place(None)
        assert handle.commit()
        assert free_bytes(engine) == total - MiB and engine.stats().quarantined_bytes == 0


def test_held_pages_count_against_the_writers_quota(settings: Settings) -> None:
    settings = settings.model_copy(update={"max_inflight_bytes_per_client": 2 * MiB})
    with CacheEngine(settings) as engine:
        assert engine.quarantine.bind("s1", os.getpid())
        reserve(engine, "a", token=1).abort()
        reserve(engine, "b", token=2).abort()
        with pytest.raises(Exception, match="unfinished puts"):
            reserve(engine, "c", token=3)
        assert engine.writer_done("s1", 1)
        reserve(engine, "c", token=3).abort(writer_stopped=True)


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
            reserve(engine, "a", owner="child").abort()
            assert free_bytes(engine) == total - MiB  # held: the child runs
            assert engine.quarantine.reap() == 0
            assert child.stdin is not None
            child.stdin.close()
            child.wait(10)
            assert engine.quarantine.reap() == 1
            assert free_bytes(engine) == total
            reserve(engine, "b", owner="child").abort()  # a writer gone: freed at once
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
    handle = reserve(engine, "a")
    runs = handle.byte_runs
    del handle  # never ended, as under a SIGKILL (its view of the pool goes)
    gc.collect()
    engine.close(keep_segment=True)
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
    from embcache.errors import PermissionDenied

    with CacheEngine(settings) as engine:
        total = free_bytes(engine)
        with pytest.raises(PermissionDenied):
            reserve(engine, "a", owner="nobody-bound")
        assert free_bytes(engine) == total and engine.stats().entries_filling == 0
