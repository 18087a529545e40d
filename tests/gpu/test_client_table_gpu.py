"""Same-node reads to a GPU with no call (docs/same_node_reads.md), end to end: a daemon, a
producer that puts host entries (one in a single run, one scattered over 16 one-page holes,
odd sizes), and a consumer process that gets them to its GPU with ``get(device="cuda")``,
``get_into`` a CUDA buffer and ``get_into`` CUDA tensors. Once its mapping is registered,
every read is served from the read table (the daemon counts each as a table read) and holds
exactly the bytes put. A churn part re-puts entries while the consumer reads them to its GPU:
never a torn or foreign value.

Run on a GPU machine with:
    pytest -m gpu tests/gpu/test_client_table_gpu.py
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from gpukit import run

from embcache.clients import EmbCacheClient
from embcache.errors import EntryLeased
from embcache.service.daemon_process import DaemonProcess

pytestmark = pytest.mark.gpu

MiB, PAGE = 1 << 20, 256 * 1024


def expected(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    shapes = {"single": (1024, 2048), "scattered": (2048, 1024), "odd": (37, 101)}
    return torch.randn(*shapes[name], generator=g).to(torch.bfloat16)


@pytest.fixture
def daemon() -> Iterator[tuple[str, str]]:
    with tempfile.TemporaryDirectory(prefix="ecgpu-") as tmp:
        sock = os.path.join(tmp, "g.sock")
        flags = ["--grpc-socket", sock, "--host-pool-bytes", "64MiB"]
        flags += ["--device-pool-bytes", "256MiB", "--touch-window-s", "0"]
        child = DaemonProcess([*flags, "--drain-grace-s", "1"], timeout=180)
        try:
            yield f"unix:{sock}", child.http_url
        finally:
            assert child.stop(timeout=30) == 0


def stats(http: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{http}/v1/stats", timeout=10) as reply:
        return json.loads(reply.read())


def put_entries(target: str, http: str) -> None:
    """``single`` in one run; ``scattered`` over one-page holes; ``odd`` of 7474 bytes."""
    with EmbCacheClient(target) as c:
        fillers = [f"fill/{i}" for i in range(256)]  # the whole pool (the oldest go first)
        for key in fillers:
            c.put(key, torch.zeros(PAGE // 4))
        present = [k for k, there in zip(fillers, c.exists(fillers), strict=True) if there]
        c.evict(present[::2])  # one-page holes between the others
        c.put("scattered", expected("scattered"))
        c.evict(present[1::2])
        c.put("single", expected("single"))
        c.put("odd", expected("odd"))
    with urllib.request.urlopen(f"{http}/v1/entries/scattered", timeout=10) as reply:
        assert len(json.loads(reply.read())["page_runs"]) > 1  # the kernel path is taken


CONSUMER = """
import json, sys, torch
from embcache.clients import EmbCacheClient
from embcache.clients.device.registered import registered_pool
sys.path.insert(0, sys.argv[2])
from test_client_table_gpu import expected

names = ["single", "scattered", "odd"]
out = {}
with EmbCacheClient(sys.argv[1]) as c:
    with c.get(names, device="cuda") as first:  # may be calls while registering
        out["first_ok"] = all(torch.equal(t.cpu(), expected(n)) for t, n in zip(first, names))
    table = c._tables.read_table()
    reg = registered_pool(table.pool)
    out["registered"] = reg.wait_registered(120)
    out["stats"] = reg.stats()
    print(json.dumps({"event": "registered"}), flush=True)
    input()  # the test reads the daemon's counters now
    with c.get(names, device="cuda") as got:
        out["get_ok"] = [torch.equal(t.cpu(), expected(n)) for t, n in zip(got, names)]
        out["on_gpu"] = all(t.is_cuda for t in got)
    buf = torch.full((16 * 2**20,), 0xAB, dtype=torch.uint8, device="cuda")  # poisoned
    res = c.get_into(names, buf)
    out["into_ok"] = [torch.equal(r.view(buf).cpu(), expected(n)) for r, n in zip(res, names)]
    outs = [torch.full_like(expected(n), 7.0, device="cuda") for n in names]
    out["into_list"] = c.get_into(names, outs)
    out["into_list_ok"] = [torch.equal(o.cpu(), expected(n)) for o, n in zip(outs, names)]
print(json.dumps(out))
"""


def test_reads_to_a_gpu_take_no_call_and_hold_the_bytes(daemon: tuple[str, str]) -> None:
    import subprocess
    import sys

    target, http = daemon
    put_entries(target, http)
    here = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.Popen(
        [sys.executable, "-c", CONSUMER, target, here],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert "registered" in proc.stdout.readline()
        before = stats(http)["read_table"]["reads"]
        out_text, _ = proc.communicate("\n", timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = json.loads(out_text.strip().splitlines()[-1])
    assert out["first_ok"] and out["registered"], out
    assert out["get_ok"] == [True] * 3 and out["on_gpu"]
    assert out["into_ok"] == [True] * 3
    assert out["into_list"] == [True] * 3 and out["into_list_ok"] == [True] * 3
    # three reads of three keys, every one from the table
    assert stats(http)["read_table"]["reads"] - before == 9


CHURN = """
import json, random, sys, time, torch
from embcache.clients import EmbCacheClient
from embcache.clients.device.registered import registered_pool
elems, keys = 1 << 20, 6
rng = random.Random(5)
bad = found = 0
with EmbCacheClient(sys.argv[1]) as c:
    c.exists("k/0")
    registered_pool(c._tables.read_table().pool).wait_registered(120)
    deadline = time.monotonic() + float(sys.argv[2])
    while time.monotonic() < deadline:
        i = rng.randrange(keys)
        with c.get(f"k/{i}", device="cuda") as (t,):
            if t is None:
                continue
            found += 1
            flat = t.view(-1)
            stamp = int(flat[0])
            bad += stamp >> 20 != i or not bool((flat == stamp).all())
print(json.dumps({"found": found, "bad": bad}))
"""


def test_churn_never_gives_a_gpu_reader_a_torn_or_foreign_value(daemon: tuple[str, str]) -> None:
    import random
    import threading
    import time

    target, http = daemon
    elems, keys = 1 << 20, 6  # 4 MiB each; the 64 MiB pool reuses pages soon
    stop = threading.Event()

    def writer() -> None:
        rng, version = random.Random(1), 0
        with EmbCacheClient(target) as c:
            while not stop.is_set():
                i = rng.randrange(keys)
                version += 1
                # A reader's fallback may hold a lease on it: the evict is refused and the
                # put below finds the entry (any whole version is a right read).
                with contextlib.suppress(EntryLeased):
                    c.evict(f"k/{i}")
                c.put(f"k/{i}", torch.full((elems,), (i << 20) | version, dtype=torch.int32))

    with EmbCacheClient(target) as c:
        for i in range(keys):
            c.put(f"k/{i}", torch.full((elems,), i << 20, dtype=torch.int32))
    before = stats(http)["read_table"]["reads"]
    th = threading.Thread(target=writer, daemon=True)
    th.start()
    try:
        out = run(CHURN, target, "6")
    finally:
        stop.set()
        th.join(30)
        time.sleep(0)
    assert out["bad"] == 0 and out["found"] > 20, out
    assert stats(http)["read_table"]["reads"] > before
