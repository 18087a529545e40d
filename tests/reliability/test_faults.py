"""CI-sized fault injection (3 repetitions of each fault; ``bench/soak.py --full``: 20).

The faults run once per module; each test checks one promise over every repetition.
"""

from __future__ import annotations

from typing import Any

import pytest
from relkit import figures
from relkit.faults import run_faults

REPS = 3
KINDS = (
    "sigkill_consumer",
    "sigstop_consumer",
    "cancel_put",
    "sigkill_producer",
    "deadline_get_bytes",
    "deadline_get",
    "sigterm_daemon",
    "sigkill_daemon",
    "restart_daemon",
)


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> Any:
    out = run_faults(REPS, tmp_path_factory.mktemp("faults"))
    yield out
    print("\n" + figures.table(f"faults (CI, {REPS} repetitions)", out))
    figures.save("faults", out)


def test_every_fault_was_injected(result: dict[str, Any]) -> None:
    assert set(result["kinds"]) == set(KINDS)
    for kind in KINDS:
        assert result["kinds"][kind]["injected"] == REPS, kind


@pytest.mark.parametrize("kind", KINDS)
def test_everything_comes_back_within_15s(result: dict[str, Any], kind: str) -> None:
    k = result["kinds"][kind]
    assert k["not_reclaimed"] == 0 and k["reclaim_max_s"] is not None, k
    assert k["reclaim_max_s"] < 15.0, k


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "sigstop_consumer"])
def test_no_problem_and_nothing_lost(result: dict[str, Any], kind: str) -> None:
    k = result["kinds"][kind]
    assert k["problems"] == [] and k["lost"] == 0, k


def test_main_daemon_ends_clean(result: dict[str, Any]) -> None:
    assert result["main_daemon_exit_code"] == 0
    assert result["main_daemon_leases_left"] == 0 and result["main_daemon_filling_left"] == 0


TCP_STOPS = REPS // 2  # the odd repetitions read over TCP: the daemon does not know the pid


def test_stopped_reader_saw_reused_memory(result: dict[str, Any]) -> None:
    """The set-up works: over TCP (no peer pid), while the reader slept its pages were given
    to other entries."""
    k = result["kinds"]["sigstop_consumer"]
    assert k["reused_memory_seen"] == TCP_STOPS, k


def test_stopped_reader_never_reads_reused_memory_silently(result: dict[str, Any]) -> None:
    """Reused memory behind an expired view must be reported (release raises LeaseExpired)."""
    k = result["kinds"]["sigstop_consumer"]
    assert k["stale_silent"] == 0 and k["problems"] == [], k
    assert k["stale_detected"] == k["reused_memory_seen"] == TCP_STOPS, k


def test_stopped_reader_on_the_session_socket_keeps_its_bytes(result: dict[str, Any]) -> None:
    """Issue 28, item 3: on the session socket the daemon knows the reader's pid, so the
    lease that expired while it was stopped is quarantined: the evict is refused, the
    overwrite of the pool spares its pages, the view still reads the entry (and release
    says the lease ended), and the pages are freed once the reader has exited."""
    k = result["kinds"]["sigstop_consumer"]
    assert k["quarantined_intact"] == REPS - TCP_STOPS and k["problems"] == [], k
    assert k["quarantine_freed_after_exit_max_s"] < 15.0, k
