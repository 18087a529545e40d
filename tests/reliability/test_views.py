"""The caller's tensors (issue 28, items 1-3), against real daemons: an in-place op on a view
neither crashes the caller nor changes the cache; a view kept after its block keeps its
bytes while the pool churns; and a forced end of a lease (a TTL passed while the reader was
stopped, its session ended while its process lives) never shows the reader another entry's
bytes: the pages stay quarantined until its views are gone or it exits, within a bound.
The device-pool forms of items 1 and 2 are in tests/gpu/test_views_gpu.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from relkit import daemon as dm
from relkit import figures, payload

from embcache.clients import AsyncEmbCacheClient, EmbCacheClient

MiB = 1 << 20
HERE = str(Path(__file__).resolve().parent)
FIG: dict[str, object] = {}


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[dm.Daemon]:
    # The default bound on what one process may keep quarantined: a quarter of the pool, 4 MiB.
    d = dm.start(dm.DaemonSpec(tmp_path, pool="16MiB", lease_ttl_s=1.0))
    try:
        yield d
    finally:
        if d.alive():
            assert dm.stop(d) == 0, d.log_tail()
        dm.discard(d)


def put(client: EmbCacheClient, key: str, seed: int = 0) -> None:
    client.put(key, payload.make(key, MiB, seed))


def churn(client: EmbCacheClient, prefix: str, n: int = 20) -> None:
    """Put ``n`` MiB of new entries into the 16 MiB pool: every unheld page is reused."""
    for i in range(n):
        put(client, f"{prefix}/{i}", seed=1000 + i)


def wait(pred: Any, timeout: float = 10.0) -> bool:
    return dm.wait_for(pred, timeout) is not None


# -- item 1: in-place ops on a view -----------------------------------------------------------
WRITER = """
import sys, torch
from embcache.clients import EmbCacheClient
with EmbCacheClient(sys.argv[1], timeout=10) as client:
    with client.get("k", zero_copy=True) as (t,):
        t.mul_(2)  # a view: this used to fault (read-only shared memory)
        assert float(t.min()) == float(t.max()) == 6.0, "the write did not take"
        with client.get("k", zero_copy=True) as (again,):  # another view, same bytes
            assert float(again.max()) == 3.0, "a write reached another view"
    del t, again
print("wrote", flush=True)
"""


def test_an_in_place_op_on_a_host_view_neither_crashes_nor_changes_the_cache(daemon) -> None:  # type: ignore[no-untyped-def]
    with EmbCacheClient(daemon.unix, timeout=10) as client:
        client.put("k", torch.full((256, 1024), 3.0))
        done = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(WRITER), daemon.unix],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 0 and "wrote" in done.stdout, (done.returncode, done.stderr)
        with client.get("k") as (t,):  # another process: the cache never changed
            assert float(t.min()) == float(t.max()) == 3.0
        del t
    FIG["x.mul_(2) on a host view"] = "works in the caller; the cache keeps 3.0 (was SIGSEGV)"


# -- item 2: a view kept after its block ------------------------------------------------------
def test_a_view_kept_after_its_block_keeps_its_bytes(daemon) -> None:  # type: ignore[no-untyped-def]
    with EmbCacheClient(daemon.unix, timeout=10) as client:
        put(client, "kept")
        with client.get("kept", zero_copy=True) as (view,):
            assert payload.check("kept", view) is None
        t0 = time.monotonic()
        while time.monotonic() - t0 < 3.0:  # three lease TTLs while the pool turns over
            churn(client, f"churn-{int((time.monotonic() - t0) * 10)}", 4)
        assert payload.check("kept", view) is None, "the kept view shows reused memory"
        assert daemon.stats()["leases_active"] == 1  # renewed: its last view is alive
        assert client.evict(["kept"]) == ["leased"]
        del view
        assert wait(lambda: daemon.stats()["leases_active"] == 0), daemon.stats()
        assert client.evict(["kept"]) == ["evicted"]
    FIG["view kept 3 TTLs after its block"] = "bytes intact; its lease ends with its last view"


def test_the_asyncio_client_keeps_views_the_same_way(daemon) -> None:  # type: ignore[no-untyped-def]
    async def scenario() -> None:
        async with AsyncEmbCacheClient(daemon.unix, timeout=10) as client:
            await client.put("kept", payload.make("kept", MiB, 0))
            async with client.get("kept", zero_copy=True) as (view,):
                pass
            t0 = time.monotonic()
            while time.monotonic() - t0 < 3.0:  # renewed by the client's task meanwhile
                key = f"churn-{int((time.monotonic() - t0) * 10)}"
                await client.put(key, payload.make(key, MiB, 7))
            assert payload.check("kept", view) is None, "the kept view shows reused memory"
            assert daemon.stats()["leases_active"] == 1
            del view
            t0 = time.monotonic()
            while daemon.stats()["leases_active"] and time.monotonic() - t0 < 10:
                await asyncio.sleep(0.05)
            assert daemon.stats()["leases_active"] == 0

    asyncio.run(asyncio.wait_for(scenario(), 60))


# -- item 3: forced ends ----------------------------------------------------------------------
HOLDER = """
import gc, json, socket, sys
sys.path.insert(0, sys.argv[1])
from relkit import payload
from embcache.clients import EmbCacheClient
from embcache.errors import EmbCacheError

def say(**msg):
    print(json.dumps(msg), flush=True)

client = EmbCacheClient(sys.argv[2], timeout=10)
keys = sys.argv[3:]
with client.get(keys, zero_copy=True) as views:
    problems = [payload.check(k, v) for k, v in zip(keys, views)]
say(event="held", problems=problems)  # after the block: a stop now cannot land inside it
for line in sys.stdin:
    cmd, *args = line.split()
    if cmd == "read":
        say(event="read", problems=[payload.check(k, v) for k, v in zip(keys, views)])
    elif cmd == "cut":  # the connection drops; this process and its views live on
        client._conn.session._sock.shutdown(socket.SHUT_RDWR)
        say(event="cut")
    elif cmd == "get":
        try:
            with client.get(args, zero_copy=True) as got:  # a call (views), not the table
                say(event="got", found=[g is not None for g in got])
            del got
        except EmbCacheError as exc:
            say(event="got", error=type(exc).__name__)
    elif cmd == "drop":
        del views
        gc.collect()
        say(event="dropped")
    elif cmd == "exit":
        break
"""


class Holder:
    """A reader in a process of its own (line commands on stdin, JSON answers on stdout)."""

    def __init__(self, target: str, keys: list[str]) -> None:
        argv = [sys.executable, "-c", textwrap.dedent(HOLDER), HERE, target, *keys]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def expect(self, event: str, timeout: float = 30.0) -> dict[str, Any]:
        return dm.read_json_line(self.proc.stdout, self.proc, event, timeout)

    def ask(self, line: str, event: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.expect(event)

    def close(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            self.proc.stdin.write("exit\n")
            self.proc.stdin.flush()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
        dm.reap(self.proc)


def test_a_reader_stopped_past_its_ttl_keeps_its_bytes(daemon) -> None:  # type: ignore[no-untyped-def]
    with EmbCacheClient(daemon.unix, timeout=10) as client:
        put(client, "stop")
        holder = Holder(daemon.unix, ["stop"])
        try:
            assert holder.expect("held")["problems"] == [None]
            os.kill(holder.proc.pid, signal.SIGSTOP)
            try:  # its lease expires while it sleeps: a forced end
                assert wait(lambda: daemon.stats()["leases_active"] == 0)
                evicted = client.evict(["stop"])
                churn(client, "over-stopped")
                stats = daemon.stats()
            finally:
                os.kill(holder.proc.pid, signal.SIGCONT)
            assert holder.ask("read", "read")["problems"] == [None]
            assert evicted == ["leased"]  # its pages were kept for it
            assert stats.get("leases_quarantined") == 1 and stats.get("quarantined_bytes") == MiB
        finally:
            holder.close()
        assert wait(lambda: daemon.stats()["quarantined_bytes"] == 0)  # it exited: freed
        assert client.evict(["stop"]) == ["evicted"]
    FIG["reader SIGSTOPped past its TTL, pool overwritten"] = (
        "its pages quarantined until it exited; it read its own bytes"
    )


def test_a_session_cut_while_its_process_lives_and_the_bound(daemon) -> None:  # type: ignore[no-untyped-def]
    keys = [f"q{i}" for i in range(5)]
    with EmbCacheClient(daemon.unix, timeout=10) as client:
        for i, key in enumerate(keys):
            put(client, key, seed=i)
        holder = Holder(daemon.unix, keys)
        try:
            assert holder.expect("held")["problems"] == [None] * 5
            holder.ask("cut", "cut")  # the daemon sees the session end: a forced end
            assert wait(lambda: daemon.stats()["leases_active"] == 0), daemon.stats()
            evicted = client.evict(keys)
            churn(client, "over-cut")
            put(client, "later")
            assert holder.ask("read", "read")["problems"] == [None] * 5
            assert evicted == ["leased"] * 5 and daemon.stats()["quarantined_bytes"] == 5 * MiB
            # 5 MiB held is past this process's bound (4 MiB): its gets are refused ...
            assert holder.ask("get later", "got").get("error") == "QuotaExceeded"
            assert client.get(["later"], zero_copy=True).release(now=True) is None  # not another's
            holder.ask("drop", "dropped")  # its views are gone: its client releases them
            assert wait(lambda: daemon.stats()["quarantined_bytes"] == 0), daemon.stats()
            assert holder.ask("get later", "got") == {"event": "got", "found": [True]}
        finally:
            holder.close()
        assert wait(lambda: daemon.stats()["leases_active"] == 0)
        assert client.evict(keys) == ["evicted"] * 5  # nothing holds them any more
    FIG["session cut while its process holds 5 MiB of views"] = (
        "quarantined, bytes intact; gets refused past 4 MiB; freed when it dropped them"
    )


def test_zz_figures() -> None:
    print("\n" + figures.table("views (CI)", FIG))
    figures.save("views", FIG)
    assert json.dumps(FIG)
