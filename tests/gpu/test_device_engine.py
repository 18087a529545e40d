"""Device tier on a real GPU: get-to-device, IPC to other processes, put-from-device, churn.

Run by scripts/gpu_suite.sh on the H200; skipped where there is no GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from embcache.clients.device.gathers import materialize
from embcache.errors import PoolExhausted
from embcache.service.config import Settings
from embcache.service.device.ipc.fd_server import FdServer
from embcache.service.engine import CacheEngine

pytestmark = pytest.mark.gpu
MiB = 1 << 20
PAGE = 256 * 1024


@pytest.fixture(params=["fd", "legacy"])
def engine(request: pytest.FixtureRequest, shm_name: str):
    s = Settings(
        host_pool_bytes=256 * MiB,
        page_bytes=PAGE,
        device_pool_bytes=128 * MiB,
        device_page_bytes=PAGE,
        ipc_mode=request.param,
        shm_name=shm_name,
        device="cuda",
        max_entry_bytes=64 * MiB,
    )
    with CacheEngine(s) as e:
        yield e


def tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().data)


def fragment(e: CacheEngine, n: int = 200) -> None:
    """Fill pages with one-page fillers and evict every other one: holes of one page."""
    for i in range(n):
        e.put(f"filler-{i}", torch.zeros(PAGE, dtype=torch.uint8))
    e.evict([f"filler-{i}" for i in range(0, n, 2)])


def on_device(e: CacheEngine, dl) -> torch.Tensor:  # type: ignore[no-untyped-def]
    pool = e.device_tier.pool(0)
    dt = getattr(torch, dl.lease.dtype)
    return materialize(
        pool.tensor,
        page_bytes=pool.page_bytes,
        page_ids=dl.page_ids,
        offset=dl.offset,
        nbytes=dl.lease.nbytes,
        dtype=dt,
        shape=dl.lease.shape,
    )


CASES = [
    ((577, 4096), torch.bfloat16),
    ((1000, 37), torch.bfloat16),
    ((64, 1280), torch.float16),
    ((3, 5, 7), torch.float32),
    ((1,), torch.int8),
    ((0, 16), torch.float32),
]


def test_get_to_device_bytes_read_table_and_hits(engine: CacheEngine) -> None:
    fragment(engine)
    want = {}
    for i, (shape, dt) in enumerate(CASES):
        want[f"k{i}"] = tensor(shape, dt, i)
        engine.put(f"k{i}", want[f"k{i}"])
    keys = [*want, "missing"]
    results, table = engine.device.get(keys, "dec", read_table=True)
    assert results[-1] is None and table is not None
    table = table.cpu()
    for b, (key, dl) in enumerate(zip(want, results, strict=False)):
        assert dl is not None and not dl.resident_hit
        assert torch.equal(
            on_device(engine, dl).cpu().view(torch.uint8), want[key].view(torch.uint8)
        ), key
        n = len(dl.page_ids)
        assert table[b, :n].tolist() == list(dl.page_ids)
    again, _ = engine.device.get(list(want), "dec")
    assert all(d is not None and d.resident_hit for d in again)
    pool = engine.device_tier.pool(0)
    pool.check_tables()  # launches the updates still queued, then reads the tables back
    v2p, p2v = pool.v2p.cpu(), pool.p2v.cpu()
    bound = (v2p >= 0).sum().item()
    assert bound == (p2v >= 0).sum().item() == pool.num_pages - pool.stats().free_pages
    engine.drop_owner("dec")
    assert engine.stats().leases_active == 0


def test_a_large_batch_in_two_copy_calls(engine: CacheEngine, monkeypatch) -> None:
    """A 48 MiB cold batch is reserved and queued as head and tail (device_loads.HEAD_BYTES),
    host pages fragmented; every byte lands, on fragmented device pages too."""
    fragment(engine)
    pool = engine.device_tier.pool(0)
    fillers = [f"dev-filler-{i}" for i in range(64)]
    for key in fillers:
        engine.put(key, torch.zeros(PAGE, dtype=torch.uint8))
    engine.device.get(fillers, "f")
    engine.drop_owner("f")
    for key in fillers[::2]:  # one-page holes in the device pool as well
        pool.drop(engine.host_store.peek(key))  # type: ignore[arg-type]
    want = {f"big{i}": tensor((2048, 2048), torch.bfloat16, 50 + i) for i in range(6)}
    for key, t in want.items():
        engine.put(key, t)
    calls: list[int] = []
    real = engine.device_tier.copier.transfer

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(engine.device_tier.copier, "transfer", counting)
    results, _ = engine.device.get(list(want), "dec")
    assert len(calls) == 2
    for (key, t), dl in zip(want.items(), results, strict=True):
        assert dl is not None and not dl.resident_hit
        assert torch.equal(on_device(engine, dl).cpu().view(torch.uint8), t.view(torch.uint8)), key
    engine.drop_owner("dec")


def test_a_tail_that_does_not_fit_frees_the_head_behind_its_copy(engine: CacheEngine) -> None:
    """The head's copy is queued, then the tail finds the pool full of leased entries: the
    call fails and the head's pages are free at once. The next batch, queued behind that
    copy on the pool's stream, takes those pages and reads back its own bytes."""
    held = {f"held{i}": tensor((1024, 1024), torch.bfloat16, 80 + i) for i in range(40)}
    for key, t in held.items():  # 80 of the pool's 128 MiB, leased below
        engine.put(key, t)
    engine.device.get(list(held), "holder")
    want = {f"late{i}": tensor((2048, 2048), torch.bfloat16, 90 + i) for i in range(8)}
    for key, t in want.items():  # 64 MiB: a 16 MiB head fits, the tail does not
        engine.put(key, t)
    free = engine.stats().device[0].free_pages
    with pytest.raises(PoolExhausted):
        engine.device.get(list(want), "dec")
    assert engine.stats().device[0].free_pages == free
    keys = list(want)[:2]  # 16 MiB, into the pages the head's copy is still writing
    results, _ = engine.device.get(keys, "dec")
    for key, dl in zip(keys, results, strict=True):
        assert dl is not None
        got = on_device(engine, dl).cpu().view(torch.uint8)
        assert torch.equal(got, want[key].view(torch.uint8)), key
    engine.drop_owner("dec")
    engine.drop_owner("holder")
    assert engine.stats().leases_active == 0


CONSUMER = r"""
import json, sys, zlib, torch
from embcache.clients.device.gathers import materialize
from embcache.clients.device.pools import DevicePoolCache, DevicePoolHandle
spec = json.loads(sys.stdin.read())
cache = DevicePoolCache()
ok = 0
for _ in range(3):  # every round reopens nothing: the pool is cached by its id
    h = spec["pool"]
    handle = DevicePoolHandle(h["pool_id"], h["gpu_uuid"], h["nbytes"], h["page_bytes"],
        bytes.fromhex(h["ipc"]) if h["ipc"] else None, h["fd_socket"], h["fd_token"])
    mem = cache.open(handle)
    for e in spec["entries"]:
        t = materialize(mem.tensor(), page_bytes=h["page_bytes"], page_ids=e["pages"],
                        offset=e["offset"], nbytes=e["nbytes"], dtype=getattr(torch, e["dtype"]),
                        shape=tuple(e["shape"]))
        data = t.cpu().contiguous().view(-1).view(torch.uint8).numpy()
        ok += zlib.crc32(data.data) == e["crc"]
print(json.dumps({"ok": ok, "opens": cache.opens}))
cache.close()
"""


def test_other_process_reads_through_ipc(engine: CacheEngine, tmp_path: Path) -> None:
    fragment(engine)
    want = {f"k{i}": tensor(shape, dt, i) for i, (shape, dt) in enumerate(CASES[:4])}
    for k, t in want.items():
        engine.put(k, t)
    results, _ = engine.device.get(list(want), "dec")
    pool = engine.device_tier.pool(0)
    server = None
    if pool.ipc_mode == "fd":
        server = FdServer(
            tmp_path / "pool.fds",
            lambda pid: (pool.fd_token, pool.export_fd) if pid == pool.pool_id else None,
        )
    spec = {
        "pool": {
            "pool_id": pool.pool_id,
            "gpu_uuid": pool.gpu_uuid,
            "nbytes": pool.nbytes,
            "page_bytes": pool.page_bytes,
            "ipc": pool.export_legacy().hex() if pool.ipc_mode == "legacy" else None,
            "fd_socket": str(tmp_path / "pool.fds") if server else None,
            "fd_token": pool.fd_token if server else None,
        },
        "entries": [
            {
                "pages": list(d.page_ids),
                "offset": d.offset,
                "nbytes": d.lease.nbytes,
                "dtype": d.lease.dtype,
                "shape": list(d.lease.shape),
                "crc": crc(want[k]),
            }
            for k, d in zip(want, results, strict=True)
            if d is not None
        ],
    }
    try:
        out = subprocess.run(
            [sys.executable, "-c", CONSUMER],
            input=json.dumps(spec),
            capture_output=True,
            text=True,
            timeout=120,
            env=os.environ.copy(),
        )
    finally:
        if server is not None:
            server.close()
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"ok": 3 * len(want), "opens": 1}


PRODUCER = r"""
import json, sys, torch
from embcache.kernels.cuda_ipc import export_tensor
g = torch.Generator().manual_seed(int(sys.argv[1]))
t = torch.randn(999, 1024, generator=g).to(torch.bfloat16).cuda()
handle, offset, size = export_tensor(t)
torch.cuda.synchronize()
print(json.dumps({"handle": handle.hex(), "offset": offset, "size": size}), flush=True)
sys.stdin.readline()  # keep the tensor alive until the daemon has copied it
"""


def test_put_from_device_from_another_process(engine: CacheEngine) -> None:
    from embcache.kernels import cuda_ipc

    with subprocess.Popen(
        [sys.executable, "-c", PRODUCER, "7"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=os.environ.copy(),
    ) as proc:
        try:
            assert proc.stdout is not None and proc.stdin is not None
            msg = json.loads(proc.stdout.readline())
            mem = cuda_ipc.open_legacy(bytes.fromhex(msg["handle"]), 0, msg["size"])
            try:
                nbytes = 999 * 1024 * 2
                src = mem.tensor(msg["offset"], nbytes).view(torch.bfloat16).view(999, 1024)
                assert engine.device.put("from-gpu", src) is True
            finally:
                mem.close()
            proc.stdin.write("done\n")
            proc.stdin.flush()
            assert proc.wait(timeout=60) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
    expect = torch.randn(999, 1024, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    [lease] = engine.get(["from-gpu"], "check")
    assert lease is not None and torch.equal(engine.tensor(lease), expect)
    engine.release([lease.lease_id])


def test_put_from_device_many(engine: CacheEngine) -> None:
    """A batch of CUDA tensors lands in fragmented host pages with one wait; a batch that
    fails midway (copies of earlier items already queued) leaves nothing and no pages."""
    fragment(engine)
    srcs = [tensor((512 + 7 * i, 4096), torch.bfloat16, i).cuda() for i in range(12)]
    srcs.append(torch.arange(37, dtype=torch.float32, device="cuda")[1:])  # odd address
    items = [(f"m{i}", t) for i, t in enumerate(srcs)]
    assert engine.device.put_many(items) == [True] * len(items)
    for key, t in items:
        [lease] = engine.get([key], "dec")
        assert lease is not None and torch.equal(engine.tensor(lease), t.cpu()), key
    engine.drop_owner("dec")
    fillers = [f"filler-{i}" for i in range(1, 200, 2)]
    engine.get([key for key, _ in items] + fillers, "hold")  # so nothing can be evicted
    before = engine.stats().host.used_pages
    chunk = torch.ones(48 * MiB, dtype=torch.uint8, device="cuda")
    count = engine.stats().host.free_pages * PAGE // chunk.numel() + 1  # the last one fails
    batch = [("n0", srcs[0].clone())] + [(f"n{i + 1}", chunk) for i in range(count)]
    with pytest.raises(PoolExhausted):
        engine.device.put_many(batch)
    assert not any(engine.exists([key for key, _ in batch]))
    s = engine.stats()
    assert s.entries_filling == 0 and s.host.used_pages == before


@pytest.mark.parametrize("stream_kind", ["legacy default", "side stream"])
@pytest.mark.parametrize("holes", [False, True])
def test_a_put_follows_the_work_on_the_current_stream(
    engine: CacheEngine, stream_kind: str, holes: bool
) -> None:
    """The producer's kernel is still running on the current stream when the put is made:
    the copy (on that stream, or on the put stream after it: the legacy default stream with
    many runs) reads what the kernel wrote, never the bytes before. One page run per tensor,
    or one-page runs (``holes``). ``src_ready`` skips the ordering for a tensor known done."""
    if holes:  # the pool full of one-page fillers, every other one of the first 64 gone
        n = engine.host_pool.num_pages
        for i in range(n):
            engine.put(f"filler-{i}", torch.zeros(PAGE, dtype=torch.uint8))
        engine.evict([f"filler-{i}" for i in range(0, 64, 2)])
    side = torch.cuda.Stream()
    ctx = torch.cuda.stream(side) if stream_kind == "side stream" else torch.cuda.stream(None)
    with ctx:
        for i in range(4):
            src = torch.zeros((512, 1024), dtype=torch.float32, device="cuda")
            torch.cuda.synchronize()
            torch.cuda._sleep(50_000_000)  # ~25 ms of GPU time before the write below
            src.fill_(float(i + 1))  # queued behind the sleep, on the current stream
            assert engine.device.put(f"late{i}", src)
            [lease] = engine.get([f"late{i}"], "dec")
            assert lease is not None
            assert torch.equal(engine.tensor(lease), torch.full((512, 1024), float(i + 1)))
            engine.drop_owner("dec")
        ready = torch.full((256, 1024), 7.0, device="cuda")
        torch.cuda.synchronize()
        assert engine.device.put("ready", ready, src_ready=True)
    [lease] = engine.get(["ready"], "dec")
    assert lease is not None and torch.equal(engine.tensor(lease), ready.cpu())
    engine.drop_owner("dec")
    info = engine.entry_info("late0")
    assert info is not None and (len(info.page_runs) > 1) == holes


def test_get_into_device_buffer(engine: CacheEngine) -> None:
    fragment(engine)
    a, b = tensor((300, 4096), torch.bfloat16, 1), tensor((77, 37), torch.float16, 2)
    engine.put("a", a)
    engine.put("b", b)
    engine.device.get(["b"], "warm")  # b's copy comes from the device pool (d2d)
    dest = torch.full((8 * MiB,), 0xAB, dtype=torch.uint8, device="cuda")
    offsets = [4096, 6 * MiB + 2]
    got = engine.device.get_into(["a", "b"], "dec", dest, offsets, device=0)
    assert all(g is not None for g in got)
    host = dest.cpu()
    na, nb = a.numel() * 2, b.numel() * 2
    assert torch.equal(host[4096 : 4096 + na], a.view(-1).view(torch.uint8))
    assert torch.equal(host[offsets[1] : offsets[1] + nb], b.view(-1).view(torch.uint8))
    assert (host[:4096] == 0xAB).all() and (host[offsets[1] + nb :] == 0xAB).all()
    assert engine.stats().bytes_copied["d2d"] >= nb


def test_lease_safety_under_churn(engine: CacheEngine) -> None:
    """Consumers hold leases and re-check device bytes while producers overfill both pools."""
    rng = np.random.default_rng(0)
    crcs: dict[str, int] = {}
    lock = threading.Lock()
    stop = threading.Event()
    mismatches: list[str] = []
    errors: list[BaseException] = []
    counts = {"puts": 0, "checks": 0}

    def producer(pid: int) -> None:
        i = 0
        try:
            while not stop.is_set() and counts["puts"] < 600:
                key = f"p{pid}-{i}"
                rows = int(rng.integers(64, 1024))
                t = tensor((rows, 2048), torch.bfloat16, pid * 100000 + i)
                try:
                    engine.put(key, t)
                except Exception:
                    continue
                with lock:
                    crcs[key] = crc(t)
                    counts["puts"] += 1
                i += 1
        except BaseException as exc:
            errors.append(exc)

    def consumer(cid: int) -> None:
        try:
            while not stop.is_set():
                with lock:
                    keys = list(crcs)[-40:]
                if not keys:
                    continue
                pick = [keys[int(j)] for j in rng.integers(0, len(keys), 4)]
                try:
                    results, _ = engine.device.get(pick, f"c{cid}")
                except Exception:
                    continue
                held = [d for d in results if d is not None]
                for _ in range(3):  # re-read while others churn the pools
                    for d in held:
                        if crc(on_device(engine, d)) != crcs[d.key]:
                            mismatches.append(d.key)
                        counts["checks"] += 1
                engine.release(d.lease.lease_id for d in held)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=producer, args=(i,)) for i in range(2)]
    threads += [threading.Thread(target=consumer, args=(i,)) for i in range(2)]
    for th in threads:
        th.start()
    threads[0].join(timeout=240)
    threads[1].join(timeout=240)
    stop.set()
    for th in threads:
        th.join(timeout=60)
    assert not errors, errors
    assert not mismatches, f"{len(mismatches)} mismatches"
    s = engine.stats()
    put_bytes = s.put_bytes
    assert put_bytes > 3 * s.host.capacity_bytes, "the host pool was not overfilled"
    assert s.device[0].capacity_bytes * 3 < s.bytes_copied["h2d"], "device pool not overfilled"
    assert counts["checks"] > 100
    assert s.leases_active == 0
    pool = engine.device_tier.pool(0)
    pool.check_tables()  # launches the updates still queued, then reads the tables back
    assert (pool.v2p.cpu() >= 0).sum().item() == pool.num_pages - pool.stats().free_pages
    pool.evict_unleased()
    assert pool.stats().free_pages == pool.num_pages
    print(
        f"lease safety: {counts['puts']} puts, {counts['checks']} checks, 0 mismatches, "
        f"{s.bytes_copied['h2d'] / MiB:.0f} MiB host->device"
    )
