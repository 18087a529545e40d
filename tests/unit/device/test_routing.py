"""Multi-GPU routing on CPU "devices": per-pool accounting, peer copies chosen by measured
rates, a failed pool taken out of service while the others serve."""

from __future__ import annotations

import os

import pytest
import torch
from pydantic import ValidationError

from embcache.errors import DeviceUnavailable, InvalidArgument
from embcache.service.config import Settings
from embcache.service.device.pool import DevicePool
from embcache.service.device.routing import HOST, PeerRates
from embcache.service.engine import CacheEngine

PAGE = 4096


@pytest.fixture
def engine(shm_name: str):
    s = Settings(host_pool_bytes=64 * PAGE, page_bytes=PAGE, shm_name=shm_name, device="cpu")
    pools = [DevicePool(torch.device("cpu"), 8 * PAGE, PAGE, index=i) for i in range(2)]
    with CacheEngine(s, device_pools=pools) as e:
        yield e


def blob(n: int, seed: int) -> torch.Tensor:
    return torch.randint(
        0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )


def read(e: CacheEngine, dl) -> torch.Tensor:  # type: ignore[no-untyped-def]
    pool = e.device_tier.pool(e.device_tier.index_of(dl.gpu_uuid))  # type: ignore[arg-type]
    pages = pool.tensor.view(-1, pool.page_bytes)[list(dl.page_ids)].reshape(-1)
    return pages[: dl.lease.nbytes]


def test_pools_are_separate_and_routed_by_uuid(engine: CacheEngine) -> None:
    tier = engine.device_tier
    assert [tier.index_of(u) for u in ("CPU-0", "CPU-1", "GPU-nope")] == [0, 1, None]
    engine.put("a", blob(3 * PAGE, 1))
    engine.put("b", blob(PAGE, 2))
    [da], _ = engine.device.get(["a"], "dec", device=0)
    [db], _ = engine.device.get(["b"], "dec", device=1)
    assert da is not None and db is not None and da.gpu_uuid == "CPU-0" and db.gpu_uuid == "CPU-1"
    s = engine.stats()
    assert [d.used_pages for d in s.device] == [3, 1] and s.device_resident == [1, 1]
    assert [d.tier for d in s.device] == ["device:0", "device:1"]
    info = engine.entry_info("a")
    assert info is not None and info.residency == ("host", "device:0")


@pytest.mark.parametrize(("peer", "host", "expect"), [(100.0, 10.0, "d2d"), (5.0, 50.0, "h2d")])
def test_resident_elsewhere_uses_the_faster_source(
    engine: CacheEngine, peer: float, host: float, expect: str
) -> None:
    engine.device_tier.rates = PeerRates({(0, 1): peer, (HOST, 1): host})
    a = blob(3 * PAGE + 100, 5)
    engine.put("a", a)
    engine.device.get(["a"], "dec", device=0)  # resident on pool 0
    before = dict(engine.stats().bytes_copied)
    observed: list[tuple[str, int]] = []
    engine.device_tier.copier.observer = lambda d, nbytes, seconds: observed.append((d, nbytes))
    [d1], _ = engine.device.get(["a"], "dec", device=1)
    after = engine.stats().bytes_copied
    assert d1 is not None and torch.equal(read(engine, d1), a)
    grown = {k for k in after if after[k] > before.get(k, 0)}
    assert grown == {expect} and observed == [(expect, len(a))]  # the metrics' direction too
    assert engine.entry_info("a").residency == ("host", "device:0", "device:1")  # type: ignore[union-attr]


def test_unmeasured_rates_mean_host(engine: CacheEngine) -> None:
    assert engine.device_tier.rates.rates == {}  # CPU pools are not calibrated
    engine.put("a", blob(PAGE, 1))
    engine.device.get(["a"], "dec", device=0)
    engine.device.get(["a"], "dec", device=1)
    assert engine.stats().bytes_copied["d2d"] == 0


def test_eviction_is_per_pool(engine: CacheEngine) -> None:
    for i in range(4):
        engine.put(f"k{i}", blob(4 * PAGE, i))
    engine.device.get(["k0", "k1"], "dec", device=0)  # fills pool 0 (8 pages), leased
    engine.device.get(["k2"], "x", device=1)
    engine.drop_owner("x")
    engine.device.get(["k3"], "y", device=1)
    engine.drop_owner("y")
    engine.device.get(["k0"], "z", device=1)  # pool 1 evicts its LRU (k2), not pool 0
    pools = engine.device_tier.pools
    assert pools[0].evictions == 0 and pools[1].evictions == 1
    assert [engine.entry_info(f"k{i}").residency for i in range(3)] == [  # type: ignore[union-attr]
        ("host", "device:0", "device:1"),
        ("host", "device:0"),
        ("host",),
    ]


def test_failed_pool_is_taken_out_of_service(
    engine: CacheEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine.put("a", blob(PAGE, 1))
    tier = engine.device_tier

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(tier.copier, "transfer", broken)
    with pytest.raises(DeviceUnavailable):
        engine.device.get(["a"], "dec", device=0)
    assert tier.pools[0].failed and engine.stats().leases_active == 0
    with pytest.raises(DeviceUnavailable, match="out of service"):
        engine.device.get(["a"], "dec", device=0)
    monkeypatch.undo()
    [d1], _ = engine.device.get(["a"], "dec", device=1)  # the other GPU keeps serving
    assert d1 is not None and torch.equal(read(engine, d1), blob(PAGE, 1))


def test_gpu_list_setting() -> None:
    assert Settings().gpu_indices(4) == [0, 1, 2, 3]
    assert Settings(gpus="2, 0").gpu_indices(4) == [2, 0]
    with pytest.raises(ValueError, match="visible"):
        Settings(gpus="5").gpu_indices(2)
    for bad in ("x", "1,1", "-1", ""):
        with pytest.raises(ValidationError):
            Settings(gpus=bad)


def test_calibration_skips_a_pair_with_no_peer_path(monkeypatch: pytest.MonkeyPatch) -> None:
    # Two "GPUs" whose 1 -> 0 copy fails (no peer access): the host rates and the working
    # direction are measured, the failing pair gets no rate and so is never chosen.
    from types import SimpleNamespace

    from embcache.service.device import routing as device_routing

    pools = [
        SimpleNamespace(device=torch.device("cuda", i), index=i, tensor=torch.zeros(64))
        for i in range(2)
    ]

    def timed(dst: torch.Tensor, src: torch.Tensor, pool: object) -> float:
        if src is not None and src.data_ptr() == pools[1].tensor.data_ptr():
            raise RuntimeError("CUDA error: invalid argument")
        return 10.0

    monkeypatch.setattr(device_routing, "_time_copy", timed)
    rates = PeerRates.calibrate(pools, torch.zeros(64), nbytes=64)  # type: ignore[arg-type]
    assert rates.rates == {(HOST, 0): 10.0, (HOST, 1): 10.0, (0, 1): 10.0}
    assert not rates.prefer_peer(1, 0)


def test_engine_that_fails_to_start_leaves_nothing(
    shm_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A failure after the host pool exists (here: calibration) unlinks the segment, so the
    # next start with the same name works; pools the caller passed in stay the caller's.
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("CUDA error: invalid argument")

    s = Settings(host_pool_bytes=64 * PAGE, page_bytes=PAGE, shm_name=shm_name, device="cpu")
    pool = DevicePool(torch.device("cpu"), 8 * PAGE, PAGE)
    with monkeypatch.context() as m:
        m.setattr(PeerRates, "calibrate", broken)
        with pytest.raises(RuntimeError, match="invalid argument"):
            CacheEngine(s, device_pools=[pool])
    assert not os.path.exists(f"/dev/shm/{shm_name}")
    with CacheEngine(s, device_pools=[pool]) as e:
        e.put("a", blob(PAGE, 1))
        [d], _ = e.device.get(["a"], "dec", device=0)
        assert d is not None and torch.equal(read(e, d), blob(PAGE, 1))


def test_a_failed_pool_shows_in_stats_metrics_and_readiness(
    engine: CacheEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prometheus_client import generate_latest

    from embcache.service.observability.metrics import Metrics
    from embcache.service.transport.http.health import readiness

    engine.put("a", blob(PAGE, 1))

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with monkeypatch.context() as m:
        m.setattr(engine.device_tier.copier, "transfer", broken)
        with pytest.raises(DeviceUnavailable):
            engine.device.get(["a"], "dec", device=1)
    pools = engine.stats().device
    assert pools[0].out_of_service == "" and "illegal memory access" in pools[1].out_of_service
    text = generate_latest(Metrics(engine).registry).decode()
    assert 'embcache_pool_in_service{device="0",tier="device"} 1.0' in text
    assert 'embcache_pool_in_service{device="1",tier="device"} 0.0' in text
    state = readiness(engine)
    assert state.status == "ready" and state.devices_out_of_service == [1]  # GPU 0 serves


def test_evicting_one_device_pool_keeps_the_other_copies(engine: CacheEngine) -> None:
    from embcache.service.engine import EvictOutcome

    a, b = blob(2 * PAGE, 1), blob(PAGE, 2)
    engine.put("a", a)
    engine.put("b", b)
    for device in (0, 1):
        [d], _ = engine.device.get(["a"], "dec", device=device)
        engine.release([d.lease.lease_id])  # type: ignore[union-attr]
    [held], _ = engine.device.get(["b"], "dec", device=0)
    assert engine.device.evict(["a", "b", "nope"], 0) == [
        EvictOutcome.EVICTED,
        EvictOutcome.LEASED,  # a leased entry is never dropped
        EvictOutcome.NOT_FOUND,
    ]
    assert engine.entry_info("a").residency == ("host", "device:1")  # type: ignore[union-attr]
    assert engine.device.evict(["a"], 0) == [EvictOutcome.NOT_FOUND]  # no copy there now
    assert engine.device.evict(["a", "a"], 1) == [EvictOutcome.EVICTED, EvictOutcome.NOT_FOUND]
    [again], _ = engine.device.get(["a"], "dec", device=1)  # back on pool 1
    engine.release([again.lease.lease_id])  # type: ignore[union-attr]
    pools = engine.stats().device
    assert pools[0].used_pages == 1 and pools[1].used_pages == 2  # b stays; a stays on 1
    assert engine.device.evict_bytes(1, 1) == (1, 2 * PAGE)  # LRU on pool 1 only: a
    assert engine.stats().device[1].used_pages == 0
    engine.release([held.lease.lease_id])  # type: ignore[union-attr]
    [d0], _ = engine.device.get(["a"], "dec", device=0)  # copied again from the host
    assert d0 is not None and torch.equal(read(engine, d0), a)
    with pytest.raises(DeviceUnavailable):
        engine.device.evict(["a"], 2)
    with pytest.raises(InvalidArgument):
        engine.device.evict_bytes(0, -1)
