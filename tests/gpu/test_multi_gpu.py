"""Several GPUs on one node: one device pool per GPU, peer copies chosen by measured rates,
both GPUs filling from the host pool at once, a failed pool isolated, eviction per pool,
and decoder processes on different GPUs reading the same entries through one daemon.

In-process engines serve GPUs 0 and 1 (fd and legacy IPC modes); the end-to-end test starts
``embcache serve --gpus 0,1`` and decoder processes on cuda:0 and cuda:1. Every process
started here is stopped by its pid. Skipped unless two GPUs are visible:
    pytest -m gpu tests/gpu/test_multi_gpu.py
"""

from __future__ import annotations

import json
import math
import os
import queue
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from gpukit import run

from embcache.clients import EmbCacheClient
from embcache.clients.device.gathers import materialize
from embcache.errors import DeviceUnavailable
from embcache.service.config import Settings
from embcache.service.daemon_process import DaemonProcess
from embcache.service.device.pending_get import DeviceLease
from embcache.service.device.routing import HOST, PeerRates
from embcache.service.engine import CacheEngine, EvictOutcome

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two visible CUDA GPUs"),
    pytest.mark.timeout(180),  # each test takes well under a minute; this is a backstop
]

MiB = 1 << 20
PAGE = 256 * 1024
PAGE_LEASED = 2  # DevicePool page state of a leased resident page


# ---------------------------------------------------------------------------- helpers


def settings(shm_name: str, *, ipc_mode: str = "fd", gpus: str = "0,1") -> Settings:
    return Settings(
        host_pool_bytes=512 * MiB,
        page_bytes=PAGE,
        device_pool_bytes=128 * MiB,  # 512 device pages per GPU
        device_page_bytes=PAGE,
        ipc_mode=ipc_mode,
        shm_name=shm_name,
        device="cuda",
        gpus=gpus,
        max_entry_bytes=64 * MiB,
        device_free_reserve=0,  # pools are fragmented on purpose (fragment())
    )


@pytest.fixture(params=["fd", "legacy"])
def engine(request: pytest.FixtureRequest, shm_name: str) -> Iterator[CacheEngine]:
    """An engine serving GPUs 0 and 1 (one device pool each)."""
    with CacheEngine(settings(shm_name, ipc_mode=request.param)) as e:
        assert [p.device for p in e.device_tier.pools] == [
            torch.device("cuda", 0),
            torch.device("cuda", 1),
        ]
        yield e


def tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 3).to(dtype)


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(-1).view(torch.uint8)


def read(e: CacheEngine, dl: DeviceLease) -> torch.Tensor:
    """The leased entry's bytes as they are in its device pool (a tensor on that GPU)."""
    index = e.device_tier.index_of(dl.gpu_uuid)
    assert index is not None, dl.gpu_uuid
    pool = e.device_tier.pools[index]
    return materialize(
        pool.tensor,
        page_bytes=pool.page_bytes,
        page_ids=list(dl.page_ids),
        offset=dl.offset,
        nbytes=dl.lease.nbytes,
        dtype=torch.uint8,
        shape=(dl.lease.nbytes,),
    )


def check(e: CacheEngine, dl: DeviceLease | None, want: torch.Tensor, device: int) -> None:
    """``dl`` is in device pool ``device``, on that pool's GPU, and holds exactly the bytes
    of ``want``."""
    assert dl is not None
    pool = e.device_tier.pools[device]
    assert dl.gpu_uuid == pool.gpu_uuid, (dl.key, device)
    got = read(e, dl)
    assert got.device == pool.device, (dl.key, got.device, pool.device)
    assert torch.equal(got.cpu(), flat_bytes(want)), f"{dl.key}: bytes differ in pool {device}"


def get_on(e: CacheEngine, key: str, device: int, owner: str = "t") -> DeviceLease:
    [dl], _ = e.device.get([key], owner, device=device)
    assert dl is not None, key
    return dl


def copied(e: CacheEngine) -> dict[str, int]:
    return dict(e.stats().bytes_copied)


def grown(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before.get(k, 0) for k in ("h2d", "d2d")}


def sync_pools(e: CacheEngine) -> None:
    """Wait for every pool's queued work (table updates are queued after the copies that a
    get waits for, so they may still run when it returns)."""
    for pool in e.device_tier.pools:
        if pool.stream is not None:
            pool.stream.synchronize()


def bound_pages(e: CacheEngine, device: int) -> tuple[int, int]:
    pool = e.device_tier.pools[device]
    pool.check_tables()  # launches the updates still queued (they wait up to 25 ms)
    sync_pools(e)
    return int((pool.v2p >= 0).sum().item()), int((pool.p2v >= 0).sum().item())


def fragment_host(e: CacheEngine, entries: int, pages_each: int) -> None:
    """Fill the host pool with one-page fillers and free every other one of the first
    ``2 * entries * pages_each``: the next ``entries`` puts land in one-page runs."""
    n = e.host_pool.num_pages
    assert 2 * entries * pages_each <= n
    one = torch.zeros(PAGE, dtype=torch.uint8)
    for i in range(n):
        e.put(f"hfill-{i}", one)
    e.evict([f"hfill-{i}" for i in range(0, 2 * entries * pages_each, 2)])


def fragment_devices(e: CacheEngine) -> list[int]:
    """Fill both device pools with one-page entries, keep every other one leased and evict
    the rest there: every free device run is one page. Returns the lease ids to release."""
    tier = e.device_tier
    n = tier.pools[0].num_pages
    keys = [f"dfill-{i}" for i in range(n)]
    one = torch.zeros(PAGE, dtype=torch.uint8)
    for key in keys:
        e.put(key, one)
    held: list[int] = []
    for device in range(2):
        got, _ = e.device.get(keys, f"frag{device}", device=device)
        assert all(d is not None for d in got)
        held += [d.lease.lease_id for d in got[0::2] if d is not None]
        e.release(d.lease.lease_id for d in got[1::2] if d is not None)
    with e._gate:
        for pool in tier.pools:
            pool.evict_unleased()
    for pool in tier.pools:
        s = pool.stats()
        assert s.largest_free_run_pages == 1 and s.free_pages == n // 2, s
    return held


# ---------------------------------------------------------------------------- in-process


def test_peer_copy_follows_the_measured_rates(engine: CacheEngine) -> None:
    """Calibrated rates exist for host -> each GPU (and for each peer pair that has a peer
    path); a copy for GPU 1 of an entry resident on GPU 0 is GPU-to-GPU iff those rates say
    so; host-preferred (or unmeasured) rates copy from the host; get_into on GPU 1 reads what
    pool 1 holds and takes the rest from the host."""
    e, tier = engine, engine.device_tier
    rates = dict(tier.rates.rates)
    print("calibrated copy rates (GB/s, -1 = host):", rates)
    assert {(HOST, 0), (HOST, 1)} <= set(rates), rates
    for src, dst in ((0, 1), (1, 0)):
        if torch.cuda.can_device_access_peer(dst, src) and torch.cuda.can_device_access_peer(
            src, dst
        ):
            assert (src, dst) in rates, (src, dst, rates)
    assert all(math.isfinite(r) and r > 0.5 for r in rates.values()), rates

    t = tensor((2048, 1024), torch.bfloat16, 1)  # 4 MiB
    n = t.numel() * t.element_size()
    e.put("m", t)
    before = copied(e)
    a = get_on(e, "m", 0)
    assert grown(before, copied(e)) == {"h2d": n, "d2d": 0}
    check(e, a, t, 0)
    before = copied(e)
    b = get_on(e, "m", 1)
    peer = tier.rates.prefer_peer(0, 1)
    expect = {"h2d": 0, "d2d": n} if peer else {"h2d": n, "d2d": 0}
    assert grown(before, copied(e)) == expect, (peer, rates)
    check(e, b, t, 1)
    assert not b.resident_hit
    e.release([a.lease.lease_id, b.lease.lease_id])
    info = e.entry_info("m")
    assert info is not None and info.residency == ("host", "device:0", "device:1")

    # Host measured faster (or nothing measured): the copy for GPU 1 comes from the host.
    for forced in (PeerRates({(HOST, 1): 100.0, (0, 1): 1.0}), PeerRates({})):
        tier.rates = forced
        key = f"h{len(forced.rates)}"
        h = tensor((1000, 1111), torch.float32, 2 + len(forced.rates))  # odd size
        nh = h.numel() * 4
        e.put(key, h)
        a = get_on(e, key, 0)
        before = copied(e)
        b = get_on(e, key, 1)
        assert grown(before, copied(e)) == {"h2d": nh, "d2d": 0}, forced
        check(e, b, h, 1)
        e.release([a.lease.lease_id, b.lease.lease_id])

    # get_into a buffer on GPU 1: "m" is resident in pool 1 (device copy), "only0" only in
    # pool 0, which get_into on GPU 1 does not read (host copy).
    only0 = tensor((777, 1024), torch.float16, 9)
    e.put("only0", only0)
    a = get_on(e, "only0", 0)
    e.release([a.lease.lease_id])
    dest = torch.full((16 * MiB,), 0xAB, dtype=torch.uint8, device="cuda:1")
    offsets = [0, 8 * MiB + 16]
    n0 = only0.numel() * 2
    before = copied(e)
    got = e.device.get_into(["m", "only0"], "into", dest, offsets, device=1)
    assert all(g is not None for g in got)
    assert grown(before, copied(e)) == {"h2d": n0, "d2d": n}
    host = dest.cpu()
    assert torch.equal(host[:n], flat_bytes(t))
    assert torch.equal(host[offsets[1] : offsets[1] + n0], flat_bytes(only0))
    assert (host[n : offsets[1]] == 0xAB).all() and (host[offsets[1] + n0 :] == 0xAB).all()
    assert e.stats().leases_active == 0


def test_forced_peer_copies_fragmented_pages_both_ways(engine: CacheEngine) -> None:
    """With rates that make the peer path certain, an entry in one-page runs on one GPU is
    copied GPU-to-GPU into one-page runs on the other, in both directions, byte for byte,
    and counted as d2d (no host copy)."""
    e, tier = engine, engine.device_tier
    held = fragment_devices(e)
    for src, dst in ((0, 1), (1, 0)):
        tier.rates = PeerRates({(HOST, dst): 1.0, (src, dst): 100.0})
        t = tensor((786_457,), torch.float32, 10 + src)  # 3 MiB + 100 bytes: 13 pages
        n = t.numel() * 4
        key = f"peer-{src}-{dst}"
        e.put(key, t)
        a = get_on(e, key, src)
        assert a.offset is None and len(a.page_ids) == 13, a  # fragmented at the source
        check(e, a, t, src)
        before = copied(e)
        b = get_on(e, key, dst)
        assert b.offset is None and len(b.page_ids) == 13, b  # and at the destination
        assert grown(before, copied(e)) == {"h2d": 0, "d2d": n}
        check(e, b, t, dst)
        e.release([a.lease.lease_id, b.lease.lease_id])
    # A batch that mixes both sources: one entry resident on GPU 0 (peer), one nowhere (host).
    tier.rates = PeerRates({(HOST, 1): 1.0, (0, 1): 100.0})
    x, y = tensor((512, 1024), torch.bfloat16, 20), tensor((700, 1024), torch.bfloat16, 21)
    e.put("x", x)
    e.put("y", y)
    a = get_on(e, "x", 0)
    before = copied(e)
    got, _ = e.device.get(["x", "y"], "t", device=1)
    assert grown(before, copied(e)) == {"h2d": y.numel() * 2, "d2d": x.numel() * 2}
    check(e, got[0], x, 1)
    check(e, got[1], y, 1)
    e.release([a.lease.lease_id, *(d.lease.lease_id for d in got if d is not None)])
    e.release(held)
    assert e.stats().leases_active == 0


def test_both_gpus_fill_from_the_host_at_once(engine: CacheEngine) -> None:
    """Two threads load distinct batches (16 x 4 MiB, one-page host runs) on GPU 0 and GPU 1
    at the same moment, three rounds; every byte is right, each pool accounts for exactly its
    own batch while the leases are held, and once everything is evicted every page of both
    pools is free with nothing bound in their tables."""
    e, tier = engine, engine.device_tier
    tier.rates = PeerRates({})  # the sets are distinct anyway: every copy is from the host
    per_gpu, pages = 16, 16  # 4 MiB entries of 16 pages
    fragment_host(e, 2 * per_gpu, pages)
    sets: list[list[str]] = [[], []]
    want: dict[str, torch.Tensor] = {}
    for device in range(2):
        for j in range(per_gpu):
            key = f"g{device}-{j}"
            want[key] = tensor((2 * MiB,), torch.bfloat16, 100 * device + j)
            e.put(key, want[key])
            sets[device].append(key)
    info = e.entry_info(sets[1][-1])
    assert info is not None and len(info.page_runs) == pages, "host pages are not fragmented"

    rounds = 3
    barrier = threading.Barrier(3, timeout=60)
    errors: list[BaseException] = []
    seconds: list[list[float]] = [[], []]

    def loader(device: int) -> None:
        try:
            pool = tier.pools[device]
            for _ in range(rounds):
                barrier.wait()  # both GPUs start together
                t0 = time.perf_counter()
                got, _ = e.device.get(sets[device], f"gpu{device}", device=device)
                seconds[device].append(time.perf_counter() - t0)
                for key, dl in zip(sets[device], got, strict=True):
                    assert dl is not None and not dl.resident_hit, key
                    check(e, dl, want[key], device)
                barrier.wait()  # loaded: the main thread checks the accounting
                barrier.wait()  # checked
                e.release(dl.lease.lease_id for dl in got if dl is not None)
                with e._gate:
                    assert pool.evict_unleased() == per_gpu  # cold again next round
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    before = copied(e)
    threads = [threading.Thread(target=loader, args=(d,)) for d in range(2)]
    for th in threads:
        th.start()
    try:
        for _ in range(rounds):
            barrier.wait()
            barrier.wait()
            s = e.stats()
            assert s.device_resident == [per_gpu, per_gpu], s.device_resident
            assert [d.used_pages for d in s.device] == [per_gpu * pages] * 2, s.device
            assert s.leases_active == 2 * per_gpu
            for device in range(2):
                states = e.device.page_states(device)
                assert int((states == PAGE_LEASED).sum()) == per_gpu * pages, device
                assert bound_pages(e, device) == (per_gpu * pages, per_gpu * pages), device
            barrier.wait()
    except BaseException:
        barrier.abort()
        for th in threads:
            th.join(timeout=60)
        failed = [x for x in errors if not isinstance(x, threading.BrokenBarrierError)]
        if failed:
            raise failed[0] from None  # a loader's own failure, not the barrier it broke
        raise
    for th in threads:
        th.join(timeout=60)
    assert not errors, errors
    print(f"concurrent cold batches, seconds per GPU: {seconds}")
    total = rounds * 2 * per_gpu * 4 * MiB
    assert grown(before, copied(e)) == {"h2d": total, "d2d": 0}
    assert [p.evictions for p in tier.pools] == [rounds * per_gpu] * 2

    assert e.evict(list(want)) == [EvictOutcome.EVICTED] * len(want)
    e.evict_bytes(e.host_pool.nbytes)
    s = e.stats()
    assert s.leases_active == 0 and s.entries_ready == 0 and s.host.used_pages == 0
    assert s.device_resident == [0, 0]
    for device, d in enumerate(s.device):
        assert d.free_pages == d.total_pages and d.used_pages == 0, d
        assert d.largest_free_run_pages == d.total_pages, d
        assert bound_pages(e, device) == (0, 0)


def test_a_failed_pool_is_isolated(engine: CacheEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA error in pool 1's work (injected into its host->device copy, the path a real
    device error takes) takes pool 1 out of service: every device call for GPU 1 raises
    DeviceUnavailable, no lease is left behind, and GPU 0 keeps serving byte-exact copies
    without ever reading the failed pool."""
    e, tier = engine, engine.device_tier
    tier.rates = PeerRates({})
    want = {k: tensor((1024, 1024), torch.bfloat16, i) for i, k in enumerate("abc")}  # 2 MiB
    for key, t in want.items():
        e.put(key, t)
    b = get_on(e, "b", 1)  # "b" is resident on GPU 1 only
    check(e, b, want["b"], 1)
    a = get_on(e, "a", 0)  # "a" on GPU 0 only
    e.release([a.lease.lease_id, b.lease.lease_id])

    pool1 = tier.pools[1]
    transfer = tier.copier.transfer

    def broken(*args: Any, **kwargs: Any) -> None:
        dst = args[1]
        if dst.device == pool1.device:
            raise RuntimeError("CUDA error: injected fault on the second GPU (test)")
        transfer(*args, **kwargs)

    monkeypatch.setattr(tier.copier, "transfer", broken)
    with pytest.raises(DeviceUnavailable):
        e.device.get(["c"], "dec", device=1)
    monkeypatch.undo()
    assert pool1.failed and "injected" in pool1.failure, pool1.failure
    assert not tier.pools[0].failed
    assert e.stats().leases_active == 0
    with pytest.raises(DeviceUnavailable, match="out of service"):
        e.device.get(["a"], "dec", device=1)
    with pytest.raises(DeviceUnavailable):
        e.device.start_get(["a"], "dec", device=1)
    dest = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda:1")
    with pytest.raises(DeviceUnavailable):
        e.device.get_into(["a"], "dec", dest, [0], device=1)
    with pytest.raises(DeviceUnavailable):
        e.prefetch(["a"], device=1)
    index = tier.index_of(pool1.gpu_uuid)
    assert index == 1
    with pytest.raises(DeviceUnavailable):
        tier.pool(index)
    assert e.stats().leases_active == 0

    # GPU 0 serves on; even with rates that prefer GPU 1 as a source, nothing comes from it.
    tier.rates = PeerRates({(HOST, 0): 1.0, (1, 0): 100.0})
    before = copied(e)
    got, _ = e.device.get(list(want), "dec", device=0)
    for t, dl in zip(want.values(), got, strict=True):
        check(e, dl, t, 0)
    assert [dl is not None and dl.resident_hit for dl in got] == [True, False, False]
    nbytes = want["b"].numel() * 2 + want["c"].numel() * 2
    assert grown(before, copied(e)) == {"h2d": nbytes, "d2d": 0}
    s = e.stats()
    # (Stats carry no "failed" flag per pool; what they show is that pool 1 holds nothing.)
    assert s.device_resident == [3, 0], s.device_resident
    info = e.entry_info("b")
    assert info is not None and info.residency == ("host", "device:0")
    e.drop_owner("dec")
    # Evicting entries still works with a failed pool present.
    assert e.evict(list(want)) == [EvictOutcome.EVICTED] * 3
    d0 = e.stats().device[0]
    assert d0.free_pages == d0.total_pages, d0
    assert bound_pages(e, 0) == (0, 0)


def test_eviction_is_per_device_pool(engine: CacheEngine) -> None:
    """Evicting a device pool (DevicePool.evict_unleased, or LRU eviction when a pool fills)
    leaves the other pool's residency alone; leased entries are never evicted; evicting an
    entry (engine.evict) drops it from every pool. (There is no per-device Evict RPC or REST
    call: per-pool eviction is reachable in-process only.)"""
    e, tier = engine, engine.device_tier
    tier.rates = PeerRates({})
    keep = [f"keep-{i}" for i in range(8)]
    want = {k: tensor((2 * MiB,), torch.bfloat16, 200 + i) for i, k in enumerate(keep)}  # 4 MiB
    for key, t in want.items():
        e.put(key, t)
    for device in range(2):
        got, _ = e.device.get(keep, f"warm{device}", device=device)
        e.release(d.lease.lease_id for d in got if d is not None)
    assert e.stats().device_resident == [8, 8]

    # 1. Evict all of pool 0 (unleased): pool 1 keeps its copies, which then serve hits.
    held = get_on(e, keep[0], 0, owner="holder")  # leased: survives the eviction
    used1 = e.stats().device[1].used_pages
    with e._gate:
        assert tier.pools[0].evict_unleased() == 7
    s = e.stats()
    assert s.device_resident == [1, 8] and s.device[1].used_pages == used1
    entry = e.host_store.peek(keep[0])
    assert entry is not None and tier.pools[0].is_resident(entry)
    assert s.device[0].used_pages == 16
    assert bound_pages(e, 0) == (16, 16)
    info = e.entry_info(keep[1])
    assert info is not None and info.residency == ("host", "device:1")
    got, _ = e.device.get(keep, "hits", device=1)
    assert all(d is not None and d.resident_hit for d in got)
    for key, dl in zip(keep, got, strict=True):
        check(e, dl, want[key], 1)
    e.release(d.lease.lease_id for d in got if d is not None)
    e.release([held.lease.lease_id])

    # 2. Pool 0 overflows (48 x 16 pages through 512): it evicts LRU, pool 1 evicts nothing.
    churn = [f"churn-{i}" for i in range(40)]
    for i, key in enumerate(churn):
        e.put(key, tensor((2 * MiB,), torch.bfloat16, 300 + i))
    for i in range(0, len(churn), 8):
        got, _ = e.device.get(churn[i : i + 8], "churn", device=0)
        assert all(d is not None for d in got)
        e.release(d.lease.lease_id for d in got if d is not None)
    assert tier.pools[0].evictions > 7 and tier.pools[1].evictions == 0
    assert e.stats().device_resident[1] == 8
    got, _ = e.device.get(keep, "hits", device=1)
    assert all(d is not None and d.resident_hit for d in got)
    e.release(d.lease.lease_id for d in got if d is not None)

    # 3. Evicting an entry removes it from both pools.
    get_on(e, keep[1], 0, owner="both")
    e.drop_owner("both")
    r0, r1 = e.stats().device_resident
    assert e.evict([keep[1]]) == [EvictOutcome.EVICTED]
    s = e.stats()
    assert s.device_resident == [r0 - 1, r1 - 1], (r0, r1, s.device_resident)
    assert s.leases_active == 0


def test_a_pool_index_is_not_a_gpu_ordinal(shm_name: str) -> None:
    """``--gpus 1``: the only pool (index 0) lives on cuda:1. Engine calls name the pool by
    its index, clients name the GPU by uuid, and every copy lands on GPU 1."""
    from embcache.kernels.cuda_mem import gpu_uuid

    with CacheEngine(settings(shm_name, gpus="1")) as e:
        tier = e.device_tier
        assert len(tier.pools) == 1 and tier.pools[0].device == torch.device("cuda", 1)
        assert tier.index_of(gpu_uuid(1)) == 0 and tier.index_of(gpu_uuid(0)) is None
        with pytest.raises(DeviceUnavailable):
            tier.pool_for(gpu_uuid(0))
        assert tier.rates.rates == {}  # one pool: nothing to calibrate
        src = tensor((999, 1024), torch.bfloat16, 7).to("cuda:1")
        assert e.device.put("pfd", src) is True
        [lease] = e.get(["pfd"], "host")
        assert lease is not None and torch.equal(e.tensor(lease), src.cpu())
        e.release([lease.lease_id])
        dl = get_on(e, "pfd", 0)
        assert dl.gpu_uuid == gpu_uuid(1)
        got = read(e, dl)
        assert got.device == torch.device("cuda", 1) and torch.equal(got.cpu(), flat_bytes(src))
        dest = torch.full((4 * MiB,), 0xAB, dtype=torch.uint8, device="cuda:1")
        assert e.device.get_into(["pfd"], "into", dest, [16], device=0)[0] is not None
        n = src.numel() * 2
        assert torch.equal(dest[16 : 16 + n].cpu(), flat_bytes(src))
        cold_t = tensor((3 * MiB,), torch.float16, 8)
        e.put("cold", cold_t)
        pending = e.device.start_get(["cold"], "ev", device=0)
        handle = e.device.ready_event(pending, 0)  # the ring of IPC events of the pool on cuda:1
        assert handle is None or len(handle) == 64
        [cold], _ = pending.wait()
        check(e, cold, cold_t, 0)
        with pytest.raises(DeviceUnavailable):
            e.device.get(["pfd"], "x", device=1)
        assert cold is not None
        e.release([dl.lease.lease_id, cold.lease.lease_id])
        assert e.stats().leases_active == 0


# ---------------------------------------------------------------------------- end to end

# Shared by the encoder, the decoders and this process (exec'd here for the expected bytes).
TENSORS = """
import hashlib
import torch

def sha(t):
    data = t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(data).hexdigest()

def tensors():
    # key -> (CPU tensor, the GPU the encoder puts it from; None: a bytes put). Contiguous
    # entries fit one 8-page hole of the fragmented device pools; fragmented ones cannot.
    shapes = {
        ("bfloat16", "contig"): (1000, 1024),  # 8 pages
        ("float32", "contig"): (480, 1024),  # 8 pages
        ("bfloat16", "frag"): (2560, 1536),  # 30 pages
        ("float32", "frag"): (1000, 1111),  # 17 pages, the last one partial
    }
    g = torch.Generator().manual_seed(23)
    out = {}
    for (dt, kind), shape in shapes.items():
        for gpu in (None, 1):
            t = (torch.randn(*shape, generator=g) * 3).to(getattr(torch, dt))
            out[f"{dt}-{kind}-{'bytes' if gpu is None else f'gpu{gpu}'}"] = (t, gpu)
    for kind in ("contig", "frag"):
        t = (torch.randn(*shapes[("bfloat16", kind)], generator=g) * 3).to(torch.bfloat16)
        out[f"bfloat16-{kind}-gpu0"] = (t, 0)
    return out
"""

ENCODER = (
    TENSORS
    + """
import json, sys
from embcache.clients import EmbCacheClient
out = {"sha": {}, "device_bytes": 0}
with EmbCacheClient(sys.argv[1]) as client:
    before = client.stats()["bytes_copied"]["d2h"]
    for key, (t, gpu) in tensors().items():
        out["sha"][key] = sha(t)
        if gpu is not None:  # PutFromDevice: the daemon copies it from this GPU
            t = t.to(f"cuda:{gpu}")
            out["device_bytes"] += t.numel() * t.element_size()
        assert client.put(key, t) is True, key
    out["device_puts"] = client._state.caps.device_puts
    out["d2h"] = client.stats()["bytes_copied"]["d2h"] - before
print(json.dumps(out))
"""
)

# One JSON line per "get" read from stdin. No torch.cuda.set_device: the GPU is named only
# by the get (the process's current device stays cuda:0 for the cuda:1 decoder).
DECODER = (
    TENSORS
    + """
import json, sys, torch
from embcache.clients import EmbCacheClient
from embcache.clients.device.pools import process_device_pools
target, index, keys = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
dev = torch.device("cuda", index)
torch.empty(1, device=dev)  # CUDA is up before we say so
print(json.dumps({"ready": index}), flush=True)
with EmbCacheClient(target) as client:
    for line in sys.stdin:
        if line.strip() != "get":
            break
        out = {"sha": {}, "device": {}, "view": {}}
        with client.get(keys + ["missing"], device=dev, zero_copy=True) as got:
            assert got[-1] is None
            pools = list(process_device_pools()._tensors.values())
            for key, t in zip(keys, got):
                assert t is not None, key
                out["device"][key] = str(t.device)
                out["view"][key] = any(
                    p.data_ptr() <= t.data_ptr() < p.data_ptr() + p.numel() for p in pools
                )
                out["sha"][key] = sha(t)
        del got, t
        client.stats()  # its next call releases the leases of the views that are gone
        out["pools"] = [str(p.device) for p in pools]
        out["opens"] = process_device_pools().opens
        out["no_device"] = sorted(client._state.no_device)
        out["ready_events"] = client._state.caps.ready_events
        print(json.dumps({"round": out}), flush=True)
print(json.dumps({"bye": index}), flush=True)
"""
)

FILLERS = 127  # x 8 pages: 1016 of a pool's 1024 pages (256 MiB), 8 left at the end


class Child:
    """A Python child that answers each command line on its stdin with a JSON line; stderr
    goes to ``log``. ``close`` ends it by its pid (EOF on stdin, SIGKILL if it lingers)."""

    def __init__(self, code: str, *args: str, log: Path) -> None:
        self.log = log
        self._err = open(log, "w")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(code), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._err,
            text=True,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def send(self, command: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def answer(self, field: str, timeout: float = 60) -> Any:
        """The ``field`` of the next JSON line that has it."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                raise AssertionError(
                    f"no {field!r} from pid {self.proc.pid} within {timeout}s\n{self.tail()}"
                ) from None
            if line is None:
                code = self.proc.wait(timeout=10)
                raise AssertionError(f"pid {self.proc.pid} exited ({code})\n{self.tail()}")
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if isinstance(msg, dict) and field in msg:
                return msg[field]

    def ask(self, command: str, field: str = "round") -> Any:
        self.send(command)
        return self.answer(field)

    def tail(self) -> str:
        self._err.flush()
        return self.log.read_text()[-4000:]

    def close(self) -> None:
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()  # EOF: the child's command loop ends
        except OSError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._reader.join(timeout=10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._err.close()


@pytest.fixture(params=["fd", "legacy"])
def daemon(request: pytest.FixtureRequest) -> Iterator[str]:
    """``embcache serve --gpus 0,1`` with a 256 MiB device pool per GPU; yields its target."""
    with tempfile.TemporaryDirectory(prefix="ecmgpu-") as tmp:
        sock = os.path.join(tmp, "g.sock")
        flags = [
            *("--grpc-socket", sock, "--host-pool-bytes", "1GiB"),
            *("--device-pool-bytes", "256MiB", "--gpus", "0,1"),
            *("--ipc-mode", request.param, "--drain-grace-s", "1"),
            *("--device-free-reserve", "0"),  # pools are fragmented on purpose below
        ]
        child = DaemonProcess(flags, timeout=120)
        try:
            assert len(child.ready["device_pools"]) == 2, child.ready
            yield f"unix:{sock}"
        finally:
            assert child.stop(timeout=30) == 0


def fragment_device_pools(target: str) -> None:
    """Make both device pools' largest free run 8 pages: fill each with 2 MiB (8-page)
    entries through Gets naming its GPU, then evict every other entry."""
    from embcache.kernels import cuda_mem
    from embcache.proto.embcache.v1 import embcache_pb2 as pb

    filler = torch.zeros(2 * MiB, dtype=torch.uint8)
    keys = [f"filler-{i}" for i in range(FILLERS)]
    with EmbCacheClient(target) as client:
        for key in keys:
            client.put(key, filler)
        for gpu in range(2):
            uuid = cuda_mem.gpu_uuid(gpu)
            for i in range(0, len(keys), 64):
                reply = client._conn.call(
                    lambda md, to, b=keys[i : i + 64], u=uuid: client._conn.stub.Get(
                        pb.GetRequest(keys=b, gpu_uuid=u), timeout=to, metadata=md
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
        for device in client.stats()["device"]:
            assert device["largest_free_run_pages"] == 8, device


def check_round(out: dict[str, Any], index: int, expected: dict[str, str]) -> None:
    """A decoder's answer: every byte right, every tensor on its own GPU, one pool opened
    (its GPU's), contiguous entries zero-copy views of it (``zero_copy=True``), fragmented
    ones gathered."""
    assert out["sha"] == expected, {k: v == expected[k] for k, v in out["sha"].items()}
    assert set(out["device"].values()) == {f"cuda:{index}"}, out["device"]
    assert out["pools"] == [f"cuda:{index}"] and out["opens"] == 1, out
    assert out["no_device"] == [] and out["ready_events"], out  # no host fallback
    for key, view in out["view"].items():
        assert view == ("-contig-" in key), (index, key, view)


def test_decoders_on_two_gpus_read_the_same_entries(daemon: str, tmp_path: Path) -> None:
    """An encoder puts bytes and CUDA tensors (PutFromDevice from cuda:1 and cuda:0); a
    decoder on cuda:0, then one on cuda:1, then both at once get every entry: the bytes are
    the same everywhere, each decoder's tensors are on its own GPU, GPU 1's copies come
    from one source (GPU 0 or the host, as the daemon's measured rates chose), the
    concurrent round is all resident hits, and both device pools hold the entries."""
    target = daemon
    ns: dict[str, Any] = {}
    exec(TENSORS, ns)
    made = ns["tensors"]()
    expected = {key: ns["sha"](t) for key, (t, _) in made.items()}
    total = sum(t.numel() * t.element_size() for t, _ in made.values())
    keys = list(expected)
    decoders = [
        Child(DECODER, target, str(i), json.dumps(keys), log=tmp_path / f"decoder{i}.log")
        for i in range(2)
    ]
    try:
        fragment_device_pools(target)
        enc = run(ENCODER, target, timeout=120)
        assert enc["sha"] == expected
        assert enc["device_puts"] and enc["d2h"] >= enc["device_bytes"] > 0, enc
        assert [d.answer("ready") for d in decoders] == [0, 1]
        with EmbCacheClient(target) as client:
            s0 = client.stats()
            check_round(decoders[0].ask("get"), 0, expected)
            s1 = client.stats()
            assert grown(s0["bytes_copied"], s1["bytes_copied"]) == {"h2d": total, "d2d": 0}
            assert s1["device_resident"][0] - s0["device_resident"][0] == len(keys)

            check_round(decoders[1].ask("get"), 1, expected)
            s2 = client.stats()
            moved = grown(s1["bytes_copied"], s2["bytes_copied"])
            assert moved in ({"h2d": total, "d2d": 0}, {"h2d": 0, "d2d": total}), moved
            print("GPU 1's copies came from", "GPU 0" if moved["d2d"] else "the host")

            for d in decoders:
                d.send("get")
            for i, d in enumerate(decoders):
                check_round(d.answer("round"), i, expected)
            s3 = client.stats()
            assert grown(s2["bytes_copied"], s3["bytes_copied"]) == {"h2d": 0, "d2d": 0}
            assert s3["leases_active"] == 0
            assert [p["tier"] for p in s3["device"]] == ["device:0", "device:1"]
            kept = FILLERS - FILLERS // 2
            assert s3["device_resident"] == [kept + len(keys)] * 2, s3["device_resident"]
            entries = sum(-(-t.numel() * t.element_size() // PAGE) for t, _ in made.values())
            pages = kept * 8 + entries
            assert [p["used_pages"] for p in s3["device"]] == [pages, pages], s3["device"]
    finally:
        for d in decoders:
            d.close()


@pytest.mark.parametrize("mode", ["fd", "legacy"])
def test_slabs_reach_their_peers_and_leave_the_current_device(mode: str) -> None:
    # A slab on GPU 1 made for peer 0 is read by GPU 0 directly (VMM slabs grant the
    # access themselves), and neither making it nor exporting a tensor of GPU 1 changes
    # the caller's current device.
    from embcache.kernels import cuda_ipc, cuda_mem

    torch.cuda.set_device(0)
    slab = cuda_mem.DeviceSlab(1, 4 * MiB, mode, peers=[0])
    try:
        assert torch.cuda.current_device() == 0
        slab.tensor[: 4 * MiB].fill_(7)
        torch.cuda.synchronize(1)
        here = torch.zeros(4 * MiB, dtype=torch.uint8, device="cuda:0")
        here.copy_(slab.tensor[: 4 * MiB])
        torch.cuda.synchronize(0)
        assert bool((here == 7).all())
        cuda_ipc.export_tensor(torch.ones(16, device="cuda:1"))
        assert torch.cuda.current_device() == 0
    finally:
        slab.close()
