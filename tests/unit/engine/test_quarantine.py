"""The quarantine (issue 28, item 3): a lease that ends by force while its owner's process
may still read the pages keeps them out of reuse until that process exits or releases it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from embcache.errors import EntryLeased, QuotaExceeded
from embcache.service.config import Settings
from embcache.service.engine import CacheEngine
from embcache.service.host.quarantine import ProcessRef, start_time

PAGE = 4096


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def engine(shm_name: str, clock: FakeClock):  # type: ignore[no-untyped-def]
    s = Settings(
        host_pool_bytes=16 * PAGE,
        page_bytes=PAGE,
        shm_name=shm_name,
        lease_ttl_s=10,
        max_quarantine_bytes_per_owner=4 * PAGE,
    )
    with CacheEngine(s, clock=clock) as e:
        yield e


@pytest.fixture
def child():  # type: ignore[no-untyped-def]
    """A process of our own that we can end when the test says (its pid is not reused
    meanwhile: it stays a zombie until waited for, and a zombie counts as exited)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)


def page(i: int) -> torch.Tensor:
    return torch.full((PAGE,), i, dtype=torch.uint8)


def test_process_refs_see_exit_and_pid_reuse(child: subprocess.Popen[bytes]) -> None:
    me = ProcessRef.of(os.getpid())
    assert me is not None and me.alive()
    ref = ProcessRef.of(child.pid)
    assert ref is not None and ref.alive()
    assert not ProcessRef(child.pid, ref.start + 1).alive()  # another process, same pid
    child.kill()
    child.wait(10)
    assert not ref.alive() and ProcessRef.of(child.pid) is None
    assert ProcessRef.of(0) is None and start_time(-1) is None


def test_start_time_reads_names_with_spaces_and_parens(tmp_path: Path) -> None:
    (tmp_path / "42").mkdir()
    fields = ["S"] + [str(i) for i in range(4, 22)] + ["777", "0", "0"]
    (tmp_path / "42" / "stat").write_text(f"42 (a b) (c)) {' '.join(fields)}\n")
    assert start_time(42, tmp_path) == 777
    (tmp_path / "42" / "stat").write_text(f"42 (x) Z {' '.join(fields[1:])}\n")
    assert start_time(42, tmp_path) is None  # a zombie has exited


def test_expiry_of_a_known_process_quarantines_until_it_exits(
    engine: CacheEngine, clock: FakeClock, child: subprocess.Popen[bytes]
) -> None:
    for i in range(16):
        engine.put(f"k{i}", page(i))
    assert engine.quarantine.bind("session:a", child.pid)
    (lease,) = engine.get(["k0"], "session:a")
    assert lease is not None
    clock.now += 11  # the TTL passes while the client may still read its view
    assert engine.expire_leases() == 1
    stats = engine.stats()
    assert stats.leases_active == 0 and stats.leases_quarantined == 1
    assert stats.quarantined_bytes == PAGE
    with pytest.raises(EntryLeased):
        engine.evict_one("k0")  # its pages are held
    for i in range(16, 40):  # churn the whole pool: every other page is reused
        engine.put(f"k{i}", page(i))
    (again,) = engine.get(["k0"], "other")
    assert again is not None and torch.equal(engine.tensor(again), page(0))
    engine.release([again.lease_id])
    assert engine.quarantine.reap() == 0  # still running
    child.kill()
    child.wait(10)
    assert engine.quarantine.reap() == 1
    assert engine.stats().leases_quarantined == 0
    engine.evict_one("k0")


def test_release_of_a_quarantined_id_ends_its_hold(engine: CacheEngine, clock: FakeClock) -> None:
    engine.put("k", page(1))
    assert engine.quarantine.bind("session:me", os.getpid())
    (lease,) = engine.get(["k"], "session:me")
    assert lease is not None
    clock.now += 11
    engine.expire_leases()
    assert engine.stats().leases_quarantined == 1
    assert engine.release([lease.lease_id]) == 0  # it had ended: not counted as released
    assert engine.stats().leases_quarantined == 0
    engine.evict_one("k")


def test_session_end_and_operator_drop_are_forced_ends(engine: CacheEngine) -> None:
    engine.put("a", page(1))
    engine.put("b", page(2))
    assert engine.quarantine.bind("session:me", os.getpid())
    engine.get(["a", "b"], "session:me")
    engine.get(["a"], "session:gone")  # no process known: its leases just end
    assert engine.quarantine.end_owner("session:gone") == 1
    assert engine.stats().leases_quarantined == 0
    assert engine.drop_owner("session:me") == 2  # the session ended (or was dropped)
    s = engine.stats()
    assert s.leases_active == 0 and s.leases_quarantined == 2 and s.quarantined_bytes == 2 * PAGE
    assert engine.quarantine.held_for(os.getpid()) == 2 * PAGE


def test_an_exited_owner_is_not_quarantined(
    engine: CacheEngine, child: subprocess.Popen[bytes]
) -> None:
    engine.put("a", page(1))
    assert engine.quarantine.bind("session:c", child.pid)
    engine.get(["a"], "session:c")
    child.kill()
    child.wait(10)
    assert engine.drop_owner("session:c") == 1  # its connection closed as it died
    assert engine.stats().leases_quarantined == 0
    assert not engine.quarantine.bind("session:d", child.pid)  # no such process now


def test_past_its_bound_a_process_gets_no_more_leases(
    engine: CacheEngine, clock: FakeClock
) -> None:
    for i in range(6):
        engine.put(f"k{i}", page(i))
    assert engine.quarantine.bind("session:me", os.getpid())
    engine.get([f"k{i}" for i in range(4)], "session:me")
    clock.now += 11
    engine.expire_leases()  # 4 pages quarantined: the bound (4 pages)
    assert engine.quarantine.bind("session:me2", os.getpid())  # a new session, same process
    with pytest.raises(QuotaExceeded) as err:
        engine.get(["k5"], "session:me2")
    assert err.value.details["limit"] == 4 * PAGE
    (other,) = engine.get(["k5"], "someone-else")  # other owners are not held back
    assert other is not None


def test_many_holds_of_one_entry_count_its_pages_once(
    engine: CacheEngine, clock: FakeClock
) -> None:
    # A client that pipelined many gets of one entry and then dropped its connection pins
    # one entry's pages, not one copy per lease: it stays under its bound.
    engine.put("k", page(1))
    engine.put("other", page(2))
    assert engine.quarantine.bind("session:me", os.getpid())
    leases = [engine.get(["k"], "session:me")[0] for _ in range(10)]
    assert engine.drop_owner("session:me") == 10
    s = engine.stats()
    assert s.leases_quarantined == 10 and s.quarantined_bytes == PAGE
    assert engine.quarantine.bind("session:me2", os.getpid())
    (got,) = engine.get(["other"], "session:me2")  # 1 page held of a 4-page bound
    assert got is not None
    engine.release([got.lease_id], "session:me2")
    assert engine.release([lease.lease_id for lease in leases[:9] if lease], "session:me2") == 0
    assert engine.stats().quarantined_bytes == PAGE  # one hold of it is left
    engine.release([leases[9].lease_id], "session:me2")  # type: ignore[union-attr]
    s = engine.stats()
    assert s.leases_quarantined == 0 and s.quarantined_bytes == 0


def test_only_the_process_it_was_kept_for_ends_a_hold(
    engine: CacheEngine, child: subprocess.Popen[bytes]
) -> None:
    engine.put("k", page(1))
    assert engine.quarantine.bind("session:c", child.pid)
    (lease,) = engine.get(["k"], "session:c")
    assert lease is not None
    engine.drop_owner("session:c")  # the child may still read its view
    assert engine.quarantine.bind("session:me", os.getpid())
    engine.release([lease.lease_id], "session:me")  # another process: refused, silently
    engine.release([lease.lease_id], "anon:unix:")  # a sessionless caller: likewise
    assert engine.stats().leases_quarantined == 1
    assert engine.quarantine.bind("session:c2", child.pid)  # the child, on a new session
    engine.release([lease.lease_id], "session:c2")
    assert engine.stats().leases_quarantined == 0


def test_close_ends_every_hold(shm_name: str, clock: FakeClock) -> None:
    s = Settings(host_pool_bytes=4 * PAGE, page_bytes=PAGE, shm_name=shm_name, lease_ttl_s=1)
    e = CacheEngine(s, clock=clock)
    e.put("k", page(1))
    e.quarantine.bind("session:me", os.getpid())
    e.get(["k"], "session:me")
    e.drop_owner("session:me")
    assert e.stats().leases_quarantined == 1
    e.close()
    assert len(e.host_store.quarantine) == 0 and not e.host_store.processes
