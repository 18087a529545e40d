"""The write side of a same-node put, against real daemons: a client that fills reserved
pages through its own mapping may still be copying when its reservation ends without it (an
operator drops its session; the daemon is SIGKILLed and started warm). Those pages must not
go to another put while that client runs: the other client's committed entry must read back
exactly its own bytes, never the first client's late ones."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from relkit import daemon as dm
from relkit import figures, payload

from embcache.clients import EmbCacheClient
from embcache.clients.device.shm_write import WritablePool

MiB = 1 << 20
NBYTES = 4 * MiB  # above the inline bound: the reserved path, filled by the client
FIG: dict[str, object] = {}


@pytest.fixture
def spec(tmp_path: Path) -> Iterator[dm.DaemonSpec]:
    s = dm.DaemonSpec(tmp_path, pool="32MiB", warm_restart=True, drain_grace_s=1.0)
    yield s
    for suffix in ("", ".index", ".index.tmp", ".reads"):
        dm.SHM_DIR.joinpath(s.shm_name + suffix).unlink(missing_ok=True)


class SlowWriter:
    """Client A's copy into its reserved pages, made to outlast its reservation: the first
    ``write_runs`` of this process writes a part, says so, waits for ``go`` (the reservation
    ends meanwhile), then keeps copying A's bytes over the same runs until ``stop``, and a
    few passes more (late bytes), before it finishes the copy as the client would."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.started = threading.Event()
        self.go = threading.Event()
        self.stop = threading.Event()
        self.finished = threading.Event()  # the late passes are done
        self.passes = 0
        self.runs: list[tuple[int, int]] = []
        real = WritablePool.write_runs
        armed = [True]

        def write_runs(pool: WritablePool, runs: Any, data: Any, **kw: Any) -> int | None:
            if not armed or not armed.pop():
                return real(pool, runs, data, **kw)
            self.runs = [(int(r.offset), int(r.length)) for r in runs]
            src = memoryview(data).cast("B")
            self._copy(pool, src, half=True)
            self.started.set()
            assert self.go.wait(60), "the reservation never ended"
            deadline = time.monotonic() + 60
            late = 3
            while late and time.monotonic() < deadline:
                self._copy(pool, src)
                self.passes += 1
                late -= self.stop.is_set()
                time.sleep(0.002)
            self.finished.set()
            return real(pool, runs, data, **kw)

        monkeypatch.setattr(WritablePool, "write_runs", write_runs)

    def _copy(self, pool: WritablePool, src: memoryview, half: bool = False) -> None:
        pos = 0
        for off, n in self.runs:
            if half and pos >= src.nbytes // 2:
                return
            pool.array[off : off + n] = memoryview(src[pos : pos + n])
            pos += n


def drop_sessions_of(d: dm.Daemon, pid: int) -> int:
    """The operator drops every session of process ``pid``; returns how many."""
    sessions = [s for s in d.rest("/v1/sessions")["sessions"] if s["pid"] == pid]
    for s in sessions:
        d.rest(f"/v1/sessions/{s['session_id']}", method="DELETE")
    return len(sessions)


def run_a(target: str, done: list[object]) -> Callable[[], None]:
    def put_a() -> None:
        try:
            with EmbCacheClient(target, timeout=30) as client:
                done.append(client.put("a", payload.make("a", NBYTES, 1)))
        except Exception as exc:  # its session was cut under it: whatever it says is fine
            done.append(exc)

    return put_a


def b_reads_back(target: str, writer: SlowWriter, checksum: bool = False) -> str | None:
    """Client B puts its entry (while A still copies), then reads it back after A's late
    passes: what is wrong with B's bytes, if anything. ``checksum``: B's put carries its
    CRC32 (the daemon checks it over the pages, which cannot see bytes that land later)."""
    with EmbCacheClient(target, timeout=30) as b:
        b.put("b", payload.make("b", NBYTES, 2), checksum=checksum)
        writer.stop.set()
        assert writer.finished.wait(90), "client A's copy never ended"
        with b.get(["b"]) as (got,):
            problem = payload.check("b", got)
        del got
    return problem


@pytest.mark.parametrize("checksum", [False, True])
def test_a_dropped_session_never_lends_pages_its_live_client_still_writes(
    spec: dm.DaemonSpec, monkeypatch: pytest.MonkeyPatch, checksum: bool
) -> None:
    spec.warm_restart = False
    writer = SlowWriter(monkeypatch)
    d = dm.start(spec)
    try:
        done: list[object] = []
        a = threading.Thread(target=run_a(d.unix, done), daemon=True)
        a.start()
        assert writer.started.wait(60), "client A never filled reserved pages"
        assert drop_sessions_of(d, os.getpid()) >= 1  # the operator's drop-session
        writer.go.set()
        problem = b_reads_back(d.unix, writer, checksum)
        a.join(60)
        assert problem is None, f"B's entry holds other bytes: {problem}"
        assert writer.passes >= 3  # A's late bytes did land after B's commit
        stats = d.stats()
        assert stats["puts_committed"] >= 1
        FIG["drop-session while the client copies"] = "B's entry intact; A's pages held"
    finally:
        if d.alive():
            dm.stop(d)
        dm.discard(d)


def test_a_warm_restart_never_lends_pages_a_live_client_of_the_old_daemon_writes(
    spec: dm.DaemonSpec, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = SlowWriter(monkeypatch)
    d = dm.start(spec)
    try:
        done: list[object] = []
        a = threading.Thread(target=run_a(d.unix, done), daemon=True)
        a.start()
        assert writer.started.wait(60), "client A never filled reserved pages"
        os.kill(d.pid, signal.SIGKILL)  # the reservation dies with the daemon
        dm.reap(d.proc)
        d = dm.start(spec)  # warm: the same segment, which A still has mapped
        writer.go.set()
        problem = b_reads_back(d.unix, writer)
        a.join(60)
        assert problem is None, f"B's entry holds other bytes: {problem}"
        assert d.stats()["restart"]["write_holds"] == 1  # A's pages, kept out of reuse
        FIG["SIGKILL + warm restart while the client copies"] = "B's entry intact"
    finally:
        if d.alive():
            dm.stop(d)
        dm.discard(d)


def test_zz_figures() -> None:
    print("\n" + figures.table("reserved writes (CI)", FIG))
    figures.save("reserved_writes", FIG)
