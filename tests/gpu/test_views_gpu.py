"""The caller's tensors on a GPU (issue 28, items 1-3; the host forms are in
tests/reliability/test_views.py): a device get hands out copies the caller owns, so an
in-place op never reaches the device pool; ``zero_copy=True`` views of the pool keep their
bytes after their block while other gets churn the pool, and end their leases once gone;
a holder whose session is cut keeps its device views' bytes (quarantined copies).

Each client runs in a process of its own (its own CUDA context, as a decoder's). Run on a
GPU machine:
    pytest -m gpu tests/gpu/test_views_gpu.py
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
import weakref
from collections.abc import Iterator

import pytest
import torch
from gpukit import run

from embcache.clients import EmbCacheClient
from embcache.clients.device.anchors import anchored_view
from embcache.service.daemon_process import DaemonProcess

pytestmark = pytest.mark.gpu

MiB = 1 << 20


@pytest.fixture(params=["fd", "legacy"])
def target(request: pytest.FixtureRequest) -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="ecviews-") as tmp:
        sock = os.path.join(tmp, "v.sock")
        flags = ["--grpc-socket", sock, "--host-pool-bytes", "1GiB"]
        flags += ["--device-pool-bytes", "128MiB", "--lease-ttl-s", "2"]
        child = DaemonProcess([*flags, "--ipc-mode", request.param], timeout=180)
        try:
            assert child.ready["device_pools"], child.ready
            yield f"unix:{sock}"
        finally:
            assert child.stop(timeout=30) == 0


def test_an_anchored_cuda_view_lives_as_long_as_its_tensors() -> None:
    base = torch.arange(4096, device="cuda").to(torch.uint8)
    view, anchor = anchored_view(base, 1024, 2048)
    assert view.is_cuda and view.data_ptr() == base.data_ptr() + 1024
    assert view.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
    assert torch.equal(view, base[1024:3072])
    gone: list[int] = []
    weakref.finalize(anchor, gone.append, 1)
    del anchor
    part = view[100:200].view(torch.int16)  # torch keeps the anchor through the interface
    del view
    gc.collect()
    assert gone == []
    assert int(part.view(torch.uint8)[0]) == (1024 + 100) % 256
    del part
    gc.collect()
    assert gone == [1]


OWNED = """
import json, sys, torch
from embcache.clients import EmbCacheClient
from embcache.clients.device.pools import process_device_pools
out = {}
with EmbCacheClient(sys.argv[1]) as c:
    c.put("three", torch.full((256, 1024), 3.0))
    with c.get(["three"], device="cuda") as (t,):
        (pool,) = process_device_pools()._tensors.values()
        lo, hi = pool.data_ptr(), pool.data_ptr() + pool.numel()
        out["owned_outside_pool"] = not (lo <= t.data_ptr() < hi)
        t.mul_(2)  # an owned copy: the pool never sees this
        out["written"] = float(t.max())
    out["leases_after_block"] = c.stats()["leases_active"]  # copies: end with the block
    with c.get(["three"], device="cuda") as (u,):
        out["next_get"] = float(u.max())
    with c.get(["three"], device="cuda", zero_copy=True) as (v,):
        out["view_inside_pool"] = lo <= v.data_ptr() < hi
        out["view_reads"] = float(v.max())
    del t, u, v
print(json.dumps(out))
"""


def test_a_device_get_hands_out_copies_a_write_never_reaches_the_pool(target: str) -> None:
    got = run(OWNED, target)
    assert got == {
        "owned_outside_pool": True,
        "written": 6.0,
        "leases_after_block": 0,
        "next_get": 3.0,
        "view_inside_pool": True,
        "view_reads": 3.0,
    }, got
    with EmbCacheClient(target) as client, client.get("three") as (t,):  # another process
        assert float(t.max()) == float(t.min()) == 3.0


KEPT = """
import json, sys, time, torch
from embcache.clients import EmbCacheClient
out = {}
with EmbCacheClient(sys.argv[1]) as c:
    c.put("seven", torch.full((512, 1024), 7.0))  # 2 MiB: one run of device pages
    fillers = [f"fill-{i}" for i in range(96)]  # 96 x 4 MiB: three times the device pool
    for key in fillers:
        c.put(key, torch.full((1024, 1024), float(len(key))))
    with c.get(["seven"], device="cuda", zero_copy=True) as (v,):
        pass  # the block ends; the view is kept
    t0 = time.monotonic()
    while time.monotonic() - t0 < 5.0:  # past two lease TTLs, the device pool churning
        for i in range(0, len(fillers), 8):
            with c.get(fillers[i : i + 8], device="cuda") as got:
                del got
    torch.cuda.synchronize()
    out["kept_reads"] = [float(v.min()), float(v.max())]
    out["leases_while_kept"] = c.stats()["leases_active"]
    del v
    t0 = time.monotonic()
    while c.stats()["leases_active"] and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    out["leases_after"] = c.stats()["leases_active"]
print(json.dumps(out))
"""


def test_a_zero_copy_view_kept_after_its_block_keeps_its_bytes(target: str) -> None:
    got = run(KEPT, target)
    assert got == {"kept_reads": [7.0, 7.0], "leases_while_kept": 1, "leases_after": 0}, got


HOLDER = """
import json, socket, sys, time, torch
from embcache.clients import EmbCacheClient
c = EmbCacheClient(sys.argv[1])
c.put("five", torch.full((512, 1024), 5.0))
with c.get(["five"], device="cuda", zero_copy=True) as (v,):
    pass
c._conn.session._sock.shutdown(socket.SHUT_RDWR)  # the session ends; this process lives on
print(json.dumps({"event": "cut"}), flush=True)
sys.stdin.readline()  # another process churns the device pool meanwhile
torch.cuda.synchronize()
print(json.dumps({"event": "read", "values": [float(v.min()), float(v.max())]}), flush=True)
"""

CHURN = """
import json, sys, torch
from embcache.clients import EmbCacheClient
with EmbCacheClient(sys.argv[1]) as c:
    keys = [f"churn-{i}" for i in range(96)]
    for key in keys:
        c.put(key, torch.full((1024, 1024), 1.0))
    for _ in range(3):
        for i in range(0, len(keys), 8):
            with c.get(keys[i : i + 8], device="cuda") as got:
                del got
    print(json.dumps({"quarantined": c.stats()["leases_quarantined"]}))
"""


def test_a_cut_session_keeps_its_device_views_bytes(target: str) -> None:
    with subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(HOLDER), target],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as proc:  # fmt: skip (the with block closes its pipes)
        try:
            assert proc.stdout is not None and proc.stdin is not None
            assert json.loads(proc.stdout.readline())["event"] == "cut"
            churned = run(CHURN, target)
            assert churned["quarantined"] == 1, churned  # its device copy is held for it
            proc.stdin.write("go\n")
            proc.stdin.flush()
            read = json.loads(proc.stdout.readline())
            assert read == {"event": "read", "values": [5.0, 5.0]}, read
            proc.wait(60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    with EmbCacheClient(target) as client:  # it exited: the reaper frees its pages
        deadline = time.monotonic() + 10
        while client.stats()["leases_quarantined"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert client.stats()["leases_quarantined"] == 0
