"""Device paths end to end on a GPU: ``embcache serve`` with a device pool (fd and legacy IPC),
an encoder process that puts CUDA tensors (PutFromDevice, and PutFromDeviceBatch through
put_many), a decoder process that gets them
on its GPU (device locations, pools opened once) and into its own buffer (GetInto), and a
lease-safety run: a holder re-verifies leased views while another process overfills both
pools several times over.

Every process started here is stopped by its pid. Run on a GPU machine with:
    pytest -m gpu tests/gpu/test_grpc_device.py
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
from gpukit import run

from embcache.clients import EmbCacheClient
from embcache.service.daemon_process import DaemonProcess, read_line, stop

pytestmark = pytest.mark.gpu

MiB = 1 << 20
PAGE = 256 * 1024  # the daemon's default host and device page size


@dataclass
class Daemon:
    proc: subprocess.Popen[str]
    target: str
    ready: dict
    mode: str


@pytest.fixture(params=["fd", "legacy"])
def daemon(request: pytest.FixtureRequest) -> Iterator[Daemon]:
    mode = request.param
    with tempfile.TemporaryDirectory(prefix="ecgpu-") as tmp:
        sock = os.path.join(tmp, "g.sock")
        flags = ["--grpc-socket", sock, "--host-pool-bytes", "1GiB", "--device-pool-bytes", "1GiB"]
        flags += ["--device-free-reserve", "0"]  # the pool is fragmented on purpose below
        child = DaemonProcess([*flags, "--ipc-mode", mode, "--drain-grace-s", "1"], timeout=180)
        try:
            ready = child.ready
            assert ready["device_pools"], ready
            assert (ready["ipc_socket"] is not None) == (mode == "fd"), ready
            # scripts/gpu_suite.sh grpc-mps runs these tests under an MPS control daemon
            if os.environ.get("CUDA_MPS_PIPE_DIRECTORY"):
                assert ready["mps_control"] is not None, ready
            yield Daemon(child.proc, f"unix:{sock}", ready, mode)
        finally:
            assert child.stop(timeout=30) == 0


TENSORS = """
import torch
def tensors():
    # contiguous: <= 8 device pages (fits a hole); fragmented: 16 pages (no 16-page run free)
    g = torch.Generator().manual_seed(11)
    out = {}
    for dt in ("bfloat16", "float16", "float32"):
        for kind, shape in (("contig", (577, 512)), ("frag", (4 * 2**20 // DT[dt], 1))):
            for via in ("bytes", "device", "batch"):
                t = (torch.randn(*shape, generator=g) * 3).to(getattr(torch, dt))
                out[f"{dt}-{kind}-{via}"] = t
    return out
DT = {"bfloat16": 2, "float16": 2, "float32": 4}
"""

ENCODER = (
    TENSORS
    + """
import json, sys
from embcache.clients import EmbCacheClient
with EmbCacheClient(sys.argv[1]) as client:
    before = client.stats()["bytes_copied"]["d2h"]
    device_bytes = 0
    batch = {}
    for key, t in tensors().items():
        if key.endswith(("device", "batch")):
            t = t.cuda()
            device_bytes += t.numel() * t.element_size()
        if key.endswith("batch"):  # these go together: PutFromDeviceBatch
            batch[key] = t
            continue
        assert client.put(key, t) is True, key
    assert client.put_many(batch) == [True] * len(batch)
    assert client.put_many(batch) == [False] * len(batch)  # idempotent
    caps = client._state.caps
    assert caps.device_puts and caps.batch_puts, "PutFromDevice(Batch) was refused"
    d2h = client.stats()["bytes_copied"]["d2h"] - before
from embcache.clients.device.ipc_events import EVENTS
print(json.dumps({"device_bytes": device_bytes, "d2h": d2h, "events": EVENTS.created}))
"""
)

DECODER = (
    TENSORS
    + """
import json, sys
from embcache.clients import EmbCacheClient
from embcache.clients.device.pools import process_device_pools
want = {k: t.cuda() for k, t in tensors().items()}
keys = list(want)
out = {}
with EmbCacheClient(sys.argv[1]) as client, EmbCacheClient(sys.argv[1]) as other:
    # The second pass is all resident hits. Copies by default; zero_copy: views of the pool.
    for c, zero_copy in ((client, False), (other, True), (client, True)):
        with c.get(keys + ["missing"], device="cuda", zero_copy=zero_copy) as got:
            assert got[-1] is None
            (pool,) = process_device_pools()._tensors.values()
            lo, hi = pool.data_ptr(), pool.data_ptr() + pool.numel()
            for key, g in zip(keys, got):
                t = want[key]
                assert g is not None and g.is_cuda and g.dtype == t.dtype, key
                assert g.shape == t.shape and torch.equal(g, t), key
                view = lo <= g.data_ptr() < hi
                want_view = zero_copy and "contig" in key  # frag entries are gathered
                assert view == want_view, (key, zero_copy, view)
    del got, g
    other.stats()  # each client's next call releases the leases of its views that are gone
    out["opens"] = process_device_pools().opens
    out["events"] = len(process_device_pools()._events)
    assert not client._state.no_device and not other._state.no_device, "fell back to the host path"
    events = client._state.caps.ready_events and other._state.caps.ready_events
    assert events, "ready events were refused"
    # get_into a buffer of our own: packed slots, then explicit offsets
    buf = torch.full((64 * 2**20,), 0xAB, dtype=torch.uint8, device="cuda")
    stats0 = client.stats()["bytes_copied"]
    res = client.get_into(keys + ["missing"], buf)
    assert not res[-1] and all(res[:-1])
    mask = torch.zeros_like(buf, dtype=torch.bool)
    for key, r in zip(keys, res):
        assert r.offset % 16 == 0 and torch.equal(r.view(buf), want[key]), key
        mask[r.offset : r.offset + r.nbytes] = True
    assert bool((buf[~mask] == 0xAB).all()), "get_into wrote outside its slots"
    copied = client.stats()["bytes_copied"]
    moved = sum(copied[d] - stats0[d] for d in ("h2d", "d2d"))
    assert moved >= sum(r.nbytes for r in res if r), (moved, "GetInto fell back to the host")
    k = keys[0]
    (r,) = client.get_into([k], buf, offsets=[1 << 20])
    assert r.offset == 1 << 20 and torch.equal(r.view(buf), want[k])
    # a buffer still being written on our stream: the daemon's copy follows that work
    for _ in range(3):  # busy (a worker thread waits), idle (on the daemon's loop), busy
        torch.cuda._sleep(20_000_000)  # some ms of GPU time before the fill
        buf.fill_(0xCD)
        (r,) = client.get_into([k], buf, offsets=[2 << 20])
        assert torch.equal(r.view(buf), want[k]), "GetInto copied before our writes ended"
        (r,) = client.get_into([k], buf, offsets=[3 << 20])  # the stream is idle now
        assert torch.equal(r.view(buf), want[k])
    out["leases"] = client.stats()["leases_active"]
print(json.dumps(out))
"""
)


def fragment_device_pool(target: str) -> None:
    """Fill the device pool with 2 MiB entries but 8 pages, then evict every other one, so
    the largest free device run is 8 pages: a 16-page entry must land in two runs."""
    from embcache.kernels import cuda_mem
    from embcache.proto.embcache.v1 import embcache_pb2 as pb

    gpu = cuda_mem.gpu_uuid(0)
    filler = torch.zeros(2 * MiB, dtype=torch.uint8)
    keys = [f"filler-{i}" for i in range(511)]  # 511 x 8 pages of 4096: 8 left at the end
    with EmbCacheClient(target) as client:
        for key in keys:
            client.put(key, filler)
        for i in range(0, len(keys), 64):
            reply = client._conn.call(
                lambda md, to, b=keys[i : i + 64]: client._conn.stub.Get(
                    pb.GetRequest(keys=b, gpu_uuid=gpu), timeout=to, metadata=md
                )
            )
            assert all(r.found for r in reply.results)
            ids = [r.lease_id for r in reply.results]
            client._conn.call(  # by the same owner as the Get: a sessionless call
                lambda md, to, ids=ids: client._conn.stub.Release(
                    pb.ReleaseRequest(lease_ids=ids), timeout=to, metadata=md
                )
            )
        assert client.evict(keys[1::2]) == ["evicted"] * len(keys[1::2])
        device = client.stats()["device"][0]
        assert device["largest_free_run_pages"] == 8, device


def test_encoder_then_decoder(daemon: Daemon) -> None:
    fragment_device_pool(daemon.target)
    enc = run(ENCODER, daemon.target)
    assert enc["d2h"] >= enc["device_bytes"] > 0, enc  # PutFromDevice did the copies
    assert enc["events"] == 1, enc  # one interprocess event, reused by every put
    dec = run(DECODER, daemon.target)
    assert dec["opens"] == 1, dec  # one pool, opened once for two clients and three gets
    # Whether a reply carried a ready event depends on timing here (a fast copy finishes
    # before the reply is built); test_reads_wait_for_ready_events makes sure of events.
    assert dec["leases"] == 0
    with EmbCacheClient(daemon.target) as client:
        assert client.stats()["leases_active"] == 0


READY = """
import json, sys, torch
from embcache.clients import EmbCacheClient
from embcache.clients.device.pools import process_device_pools
MiB = 2**20
mismatches = 0
with EmbCacheClient(sys.argv[1]) as client:
    for r in range(6):
        g = torch.Generator().manual_seed(r)
        keys = [f"ready-{r}-{i}" for i in range(12)]
        want = [torch.randint(0, 256, (8 * MiB + 16 * i,), dtype=torch.uint8, generator=g)
                for i in range(12)]
        for k, t in zip(keys, want):
            client.put(k, t)
        on_gpu = [t.cuda() for t in want]
        torch.cuda.synchronize()
        # Read at once: only the stream's wait on the reply's event orders this after the copy
        with client.get(keys, device="cuda") as got:
            mismatches += sum(int(not torch.equal(a, b)) for a, b in zip(got, on_gpu))
        client.evict(keys)  # the next round reuses these device pages
    events = len(process_device_pools()._events)
    assert client._state.caps.ready_events and not client._state.no_device, "fell back"
print(json.dumps({"mismatches": mismatches, "events": events}))
"""


def test_reads_wait_for_ready_events(daemon: Daemon) -> None:
    """Cold gets reply while their copies run; the client's reads wait on the GPU for the
    reply's event. Reading at once, every byte is right, and events were in use."""
    out = run(READY, daemon.target)
    assert out["mismatches"] == 0, out
    assert out["events"] >= 1, out


HOLDER = """
import json, select, sys, torch
from embcache.clients import EmbCacheClient
g = torch.Generator().manual_seed(5)
want = {f"held-{i}": torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        for i, n in enumerate((3 * 2**20 + 17, 2**20, 4 * 2**20, 100_000, 7 * 2**20 + 3))}
rounds = mismatches = 0
with EmbCacheClient(sys.argv[1]) as client:
    for k, t in want.items():
        client.put(k, t)
    gpu = {k: t.cuda() for k, t in want.items()}
    with client.get(list(want), device="cuda", ttl_s=900) as got:
        print("holding", flush=True)
        while True:
            for k, t in zip(want, got):
                mismatches += int(not torch.equal(t, gpu[k]))
            rounds += 1
            if select.select([sys.stdin], [], [], 0)[0]:
                break
print(json.dumps({"rounds": rounds, "mismatches": mismatches, "keys": list(want)}), flush=True)
"""

CHURNER = """
import json, sys, torch
from embcache.clients import EmbCacheClient
n = int(sys.argv[2])
keys = []
with EmbCacheClient(sys.argv[1]) as client:
    for i in range(n):
        t = torch.randint(0, 256, (4 * 2**20,), dtype=torch.uint8, device="cuda")
        client.put(f"churn-{i}", t)
        keys.append(f"churn-{i}")
        if len(keys) % 16 == 0:
            with client.get(keys[-16:], device="cuda") as got:
                assert all(x is not None for x in got)
    fell_back = not client._state.caps.device_puts or client._state.no_device
    assert not fell_back, "fell back to the host path"
print(json.dumps({"keys": keys}))
"""


def test_leases_hold_while_both_pools_overflow(daemon: Daemon) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(HOLDER), daemon.target],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        read_line(holder, "holding", 120)
        # 768 x 4 MiB = 3 GiB through a 1 GiB host pool and a 1 GiB device pool.
        churn = run(CHURNER, daemon.target, "768", timeout=600)
        assert holder.stdin is not None
        holder.stdin.write("stop\n")
        holder.stdin.flush()
        result = json.loads(read_line(holder, "mismatches", 120))
        assert holder.wait(60) == 0
    finally:
        stop(holder, timeout=30, sig=signal.SIGKILL)
    assert result["mismatches"] == 0 and result["rounds"] >= 10, result
    with EmbCacheClient(daemon.target) as client:
        stats = client.stats()
        assert stats["leases_active"] == 0 and stats["evictions"] > 0, stats
        for key, outcome in zip(
            result["keys"] + churn["keys"],
            client.evict(result["keys"] + churn["keys"]),
            strict=True,
        ):
            assert outcome in ("evicted", "not_found"), (key, outcome)
        stats = client.stats()
        assert stats["host"]["used_pages"] == 0 and stats["entries_ready"] == 0, stats
        assert stats["device"][0]["used_pages"] == 0, stats  # every page came back
