"""Same-node reads with no call, against real daemons and client processes
(docs/same_node_reads.md): churn never yields a torn or foreign value, a reader killed while
copying leaves nothing behind, a warm restart under readers gives right bytes or a clean
fallback, a client of another uid without read access never maps the pool, and a client
built as the README builds one takes the path with no call."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from relkit import daemon as dm
from relkit.daemon import clean_env
from relkit.table_churn import key, problem, value

from embcache.clients import EmbCacheClient
from embcache.clients.device import read_table as client_table

RELDIR = Path(__file__).resolve().parent
pytestmark = pytest.mark.skipif(not client_table.ORDERED_STORES, reason="x86-64 only")
ELEMS = 150_000  # 600 KB of int32: three 256 KiB pages, so a torn copy can mix pages


@pytest.fixture
def spec(tmp_path: Path) -> Iterator[dm.DaemonSpec]:
    s = dm.DaemonSpec(tmp_path, pool="64MiB", drain_grace_s=1.0)
    yield s
    for suffix in ("", ".index", ".index.tmp", ".reads"):
        dm.SHM_DIR.joinpath(s.shm_name + suffix).unlink(missing_ok=True)


def worker(cfg: dict[str, Any], **popen: Any) -> subprocess.Popen[str]:
    env = clean_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(RELDIR), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "relkit.table_churn", json.dumps(cfg)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, **popen)


def result(proc: subprocess.Popen[str], timeout: float = 60) -> dict[str, Any]:
    out, _ = proc.communicate(timeout=timeout)
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    done = [line for line in lines if line.get("event") == "done"]
    assert proc.returncode == 0 and done, f"worker failed (rc {proc.returncode}): {out[-2000:]}"
    return done[-1]


def table_reads(d: dm.Daemon) -> int:
    return int(d.stats()["read_table"]["reads"])


def test_churn_never_yields_a_torn_or_foreign_value(spec: dm.DaemonSpec) -> None:
    """Two writers evict and re-put the same keys with new bytes while two readers get them
    with the default client: every value a reader is given is one whole value of its key,
    and most of the reads were served from the table (no call)."""
    spec.pool = "26MiB"  # six 4 MiB entries and little room: freed pages are soon reused
    with dm.running(spec) as d:
        keys, elems = 6, 1 << 20
        with EmbCacheClient(d.unix, timeout=10) as c:
            for i in range(keys):
                c.put(key(i), value(i, 0, elems))
        base = {"target": d.unix, "keys": keys, "elems": elems, "seconds": 4.0}
        procs = [worker({**base, "role": "writer", "seed": s}) for s in (1, 2)]
        procs += [worker({**base, "role": "reader", "seed": s}) for s in (3, 4)]
        out = [result(p) for p in procs]
        writers, readers = out[:2], out[2:]
        assert sum(w["puts"] for w in writers) > 10, writers
        assert all(r["bad"] == 0 for r in readers), [r["problems"] for r in readers]
        assert sum(r["found"] for r in readers) > 20, readers
        assert table_reads(d) > 0  # the path with no call was taken under churn
        assert d.stats()["leases_active"] == 0


def test_a_reader_killed_while_copying_leaves_nothing_behind(spec: dm.DaemonSpec) -> None:
    with dm.running(spec) as d:
        big = torch.arange(8 << 20, dtype=torch.int32)  # 32 MiB: each copy takes a while
        with EmbCacheClient(d.unix, timeout=10) as c:
            c.put(key(0), big)
            before = d.stats()
            spinner = worker({"role": "spinner", "target": d.unix, "keys": 1, "elems": 0,
                              "seconds": 0, "seed": 0})  # fmt: skip
            assert spinner.stdout is not None
            assert "spinning" in spinner.stdout.readline()
            time.sleep(0.5)  # mid-copy, most likely: the copies run back to back
            os.kill(spinner.pid, signal.SIGKILL)
            spinner.wait(30)
            spinner.stdout.close()
            assert table_reads(d) > 0
            after = d.stats()
            assert after["leases_active"] == 0 and after["leases_quarantined"] == 0
            assert after["host"] == before["host"]  # not a page more or less in use
            with c.get(key(0)) as (got,):
                assert torch.equal(got, big)


def test_a_warm_restart_under_readers_gives_right_bytes_or_a_clean_fallback(
    tmp_path: Path,
) -> None:
    spec = dm.DaemonSpec(tmp_path, pool="64MiB", warm_restart=True, drain_grace_s=1.0)
    d = dm.start(spec)
    try:
        keys = 4
        with EmbCacheClient(d.unix, timeout=10) as c:
            for i in range(keys):
                c.put(key(i), value(i, 7, ELEMS))
        cfg = {"target": d.unix, "keys": keys, "elems": ELEMS, "seconds": 6.0}
        readers = [worker({**cfg, "role": "reader", "seed": s}) for s in (1, 2)]
        time.sleep(1.5)
        os.kill(d.pid, signal.SIGKILL)
        dm.reap(d.proc)
        d = dm.start(spec)  # warm: the same segment and a new table
        out = [result(r) for r in readers]
        assert all(r["bad"] == 0 for r in out), [r["problems"] for r in out]
        assert all(r["found"] > 0 for r in out)
        with EmbCacheClient(d.unix, timeout=10) as c, c.get([key(i) for i in range(keys)]) as got:
            # adopted, and read through the new daemon's table
            assert all(problem(i, t, ELEMS) is None for i, t in enumerate(got))
        assert table_reads(d) > 0
    finally:
        if d.alive():
            dm.stop(d)
        dm.discard(d)
        for suffix in ("", ".index", ".index.tmp", ".reads"):
            dm.SHM_DIR.joinpath(spec.shm_name + suffix).unlink(missing_ok=True)


# Imports everything as root (the interpreter and its libraries may be out of the other
# uid's reach), then becomes uid 65534 before it connects: what it maps from then on, it maps
# as that uid.
OTHER_UID_CLIENT = """
import encodings.idna, json, os, sys, torch
import embcache.clients
from embcache.clients import EmbCacheClient
os.setgroups([]); os.setgid(65534); os.setuid(65534)
with EmbCacheClient(sys.argv[1], timeout=10) as c:
    with c.get(["a", "missing"]) as (a, missing):
        ok = a is not None and torch.equal(a, torch.arange(1000, dtype=torch.int32))
        ok = ok and missing is None
    ok = ok and c.exists("a") and not c.exists("missing")
    maps = open("/proc/self/maps").read()
print(json.dumps({"uid": os.getuid(), "ok": ok, "mapped": sys.argv[2] in maps}))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another uid")
def test_a_client_of_another_uid_falls_back_and_never_maps_the_pool(
    spec: dm.DaemonSpec, tmp_path: Path
) -> None:
    """The segment is the daemon's, mode 0600: a client of uid 65534 cannot read it, so it
    gets the entry through calls (bytes streamed), and the pool is not in its maps."""
    with dm.running(spec) as d:
        assert (d.shm_path.stat().st_mode & 0o077) == 0
        with EmbCacheClient(d.unix, timeout=10) as c:
            c.put("a", torch.arange(1000, dtype=torch.int32))
        reads = table_reads(d)
        proc = subprocess.run(
            [sys.executable, "-c", OTHER_UID_CLIENT, d.tcp, spec.shm_name],
            capture_output=True, text=True, timeout=120, env=clean_env(),
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-2000:]
        seen = json.loads(proc.stdout.strip().splitlines()[-1])
        assert seen == {"uid": 65534, "ok": True, "mapped": False}
        assert table_reads(d) == reads  # served by calls, not from the table


def test_the_readme_client_takes_the_path_with_no_call(spec: dm.DaemonSpec) -> None:
    """A client built as the quickstart builds one (a target, nothing else) reads a same-node
    entry from the table: the daemon counts a table read and a hit, and no lease."""
    with dm.running(spec) as d:
        with EmbCacheClient(d.unix) as c:
            x = torch.randn(64, 256)
            c.put("readme", x)
            before = table_reads(d)
            with c.get("readme") as (got,):
                assert torch.equal(got, x)
            assert c.exists("readme")
            (seen,) = c.describe(["readme"])  # from the table
            assert seen is not None and (seen.dtype, seen.shape) == ("float32", (64, 256))
            assert seen.lease_id == 0 and seen.nbytes == x.numel() * 4
            seen, missing = c.describe(["readme", "nope"])  # a pin whose leases end at once
            assert seen is not None and seen.lease_id == 0 and missing is None
        deadline = time.monotonic() + 10
        while table_reads(d) == before and time.monotonic() < deadline:
            time.sleep(0.02)
        assert table_reads(d) == before + 1
        assert d.stats()["leases_active"] == 0
