"""One client against the others, on quarantine holds: after an operator ends a session whose
process still holds views of its leases, the daemon keeps their pages held for that process
(its quarantine). The hold ends once the views are gone, through the client's next session
(its release comes from the same process), whether or not the client makes another call,
and never because another client, or a call without a session, asked."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from relkit import daemon as dm
from relkit import figures
from relkit.fairness import RawLane, lane_path

from embcache.clients import EmbCacheClient
from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.proto.embcache.v1 import services as pb_grpc

MiB = 1 << 20
FIG: dict[str, object] = {}

HOLDER = """
import gc, json, os, sys
from embcache.clients import EmbCacheClient
from embcache.errors import EmbCacheError

def say(**msg):
    print(json.dumps(msg), flush=True)

client = EmbCacheClient(sys.argv[1], timeout=10, client_name="holder")
held = client.get([sys.argv[2]], ttl_s=600, zero_copy=True)
views = list(held)
say(event="held", ids=list(held.lease_ids), pid=os.getpid(), value=float(views[0][0]))
for line in sys.stdin:
    cmd = line.strip()
    if cmd == "end":  # the block ends; the views live on
        try:
            held.release()
            say(event="ended", error=None)
        except EmbCacheError as exc:
            say(event="ended", error=type(exc).__name__)
    elif cmd == "call":  # a get: it opens a new session
        with client.get(["nothing"]) as got:
            say(event="called", found=got[0] is not None)
    elif cmd == "read":
        say(event="read", value=float(views[0][0]))
    elif cmd == "drop":
        del views, held
        gc.collect()
        say(event="dropped")
    elif cmd == "exit":
        break
"""


class Holder:
    """A client process holding a view of one entry (line commands, JSON answers)."""

    def __init__(self, target: str, key: str) -> None:
        argv = [sys.executable, "-c", textwrap.dedent(HOLDER), target, key]
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=dm.clean_env()
        )
        self.held = self.expect("held")

    def expect(self, event: str) -> dict[str, Any]:
        return dm.read_json_line(self.proc.stdout, self.proc, event, 30)

    def ask(self, cmd: str, event: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self.expect(event)

    def close(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            self.proc.stdin.write("exit\n")
            self.proc.stdin.flush()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
        dm.reap(self.proc)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dm.Daemon]:
    spec = dm.DaemonSpec(tmp_path_factory.mktemp("quarantine"), pool="16MiB", lease_ttl_s=600)
    with dm.running(spec) as d:
        yield d


def quarantined(d: dm.Daemon) -> int:
    return int(d.stats()["quarantined_bytes"])


def drop_session_of(d: dm.Daemon, pid: int) -> None:
    """The operator ends the session of process ``pid`` (a forced end of its leases)."""
    [sid] = [s["session_id"] for s in d.rest("/v1/sessions")["sessions"] if s["pid"] == pid]
    assert d.rest(f"/v1/sessions/{sid}", "DELETE")["leases_ended"] == 1


def held_by_force(d: dm.Daemon, key: str, value: float) -> Holder:
    """A holder with a view of ``key``, whose session an operator ended: the hold kept."""
    with EmbCacheClient(d.unix, timeout=30) as client:
        client.put(key, torch.full((MiB // 4,), value))
    holder = Holder(d.unix, key)
    drop_session_of(d, holder.held["pid"])
    assert quarantined(d) == MiB, d.stats()
    assert holder.ask("end", "ended")["error"] == "LeaseExpired"  # it learns of the end
    return holder


@pytest.mark.parametrize("then", ["no-call", "a-call"])
def test_the_hold_ends_once_the_views_are_gone(daemon: dm.Daemon, then: str) -> None:
    holder = held_by_force(daemon, f"q/{then}", 7.0)
    try:
        if then == "a-call":
            holder.ask("call", "called")  # its new session opens now
        assert holder.ask("read", "read")["value"] == 7.0  # the view keeps its bytes
        assert quarantined(daemon) == MiB
        holder.ask("drop", "dropped")  # views gone: released through its next session
        took = dm.wait_for(lambda: quarantined(daemon) == 0, 15)
        assert took is not None, daemon.stats()
        assert holder.proc.poll() is None  # it did not exit: its session ended the hold
    finally:
        holder.close()
    FIG[f"hold after a dropped session, views dropped ({then})"] = f"ended in {took:.2f} s"


def test_no_one_else_ends_a_hold(daemon: dm.Daemon) -> None:
    holder = held_by_force(daemon, "q/theirs", 3.0)
    try:
        [lease_id] = holder.held["ids"]
        release = pb.ReleaseRequest(lease_ids=[lease_id])
        with EmbCacheClient(daemon.unix, timeout=30) as thief:  # another process's session
            assert thief.release([lease_id]) == 0
        with RawLane(lane_path(daemon.ready), "thief") as lane:  # posted, and as a call
            lane.send(pb.SessionRequest(call=pb.SessionCall(call_id=0, release=release)))
            assert lane.call(release=release).release.released == 0
        for target in (daemon.unix, daemon.tcp):  # without a session
            with grpc.insecure_channel(target) as channel:
                assert pb_grpc.EmbeddingCacheStub(channel).Release(release).released == 0
        daemon.rest("/v1/release", "POST", json={"lease_ids": [str(lease_id)]})
        assert quarantined(daemon) == MiB  # still held for the holder
        assert holder.ask("read", "read")["value"] == 3.0
        holder.ask("drop", "dropped")
        assert dm.wait_for(lambda: quarantined(daemon) == 0, 15) is not None
    finally:
        holder.close()
    FIG["another session / no session / REST release of the hold"] = "held on, 0 ended"


def test_zz_figures() -> None:
    print("\n" + figures.table("quarantine holds", FIG))
    figures.save("fair_quarantine", FIG)
    assert json.dumps(FIG)
    assert os.getpid() and Path(__file__).exists()
