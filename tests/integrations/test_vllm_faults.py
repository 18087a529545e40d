"""The vLLM connector when the daemon fails: dies, hangs, cannot be mapped, races a save.

Each test drives real vLLM objects in the order of vLLM's scheduler and V2 model runner
(``vllm_kit.Engine``: ``take_unavailable_requests`` before ``update_connector_output``),
with a daemon of its own that it kills, stops or unmaps. What a user must never see:
a token computed from embeddings that are not the item's, an engine that crashes, or a
scheduler that waits on the daemon.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import signal
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

if importlib.util.find_spec("vllm") is None:  # pragma: no cover - CI installs it
    pytest.skip("vllm is not installed (scripts/install_engines.sh)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).parent))
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", r"`torch\.jit\.", DeprecationWarning)
    import vllm_kit as kit
    from vllm.distributed.ec_transfer import (
        ensure_ec_transfer_initialized,
        ensure_ec_transfer_shutdown,
        get_ec_transfer,
    )
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory
    from vllm.v1.worker.gpu.ec_connector import ActiveECConnector

    from embcache.clients import EmbCacheClient
    from embcache.integrations.vllm.metadata import EmbCacheConnectorMetadata
    from embcache.service.daemon_process import DaemonProcess

WIDTH = 64
SHM = Path("/dev/shm")


class Daemon:
    """A daemon of one test, with the pid to kill or stop and the files to clean up."""

    def __init__(self, folder: Path) -> None:
        self.shm_name = f"embcache-vf-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.proc = DaemonProcess(
            [
                "--grpc-socket",
                str(folder / "d.sock"),
                "--host-pool-bytes",
                "32MiB",
                "--shm-name",
                self.shm_name,
            ]
        )
        self.target = self.proc.unix_target
        self.stopped = False

    def sigstop(self) -> None:
        os.kill(self.proc.proc.pid, signal.SIGSTOP)
        self.stopped = True

    def sigcont(self) -> None:
        os.kill(self.proc.proc.pid, signal.SIGCONT)
        self.stopped = False

    def kill(self) -> None:
        if self.stopped:
            self.sigcont()
        self.proc.stop(timeout=10, sig=signal.SIGKILL)

    def close(self) -> None:
        if self.stopped:
            self.sigcont()
        self.proc.stop(timeout=20)
        for suffix in ("", ".index", ".index.tmp", ".reads"):  # what a killed one leaves
            (SHM / f"{self.shm_name}{suffix}").unlink(missing_ok=True)


@pytest.fixture
def own_daemon() -> Iterator[Daemon]:
    with tempfile.TemporaryDirectory(prefix="embcache-vf-") as folder:
        d = Daemon(Path(folder))
        try:
            yield d
        finally:
            d.close()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return kit.model_config(kit.write_model(tmp_path_factory.mktemp("model")))


def extra_for(d: Daemon, **kw: Any) -> dict[str, Any]:
    return {
        "embcache_target": d.target,
        "namespace": f"f-{uuid.uuid4().hex[:12]}",
        "embcache_timeout_s": 3,
        "lookup_timeout_s": 0.5,
        "breaker_cooldown_s": 0.3,
        **kw,
    }


def embeds(rows: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, WIDTH, generator=g).to(torch.bfloat16)


def make(model: Any, role: str, extra: dict[str, Any], which: ECConnectorRole) -> Any:
    return ECConnectorFactory.create_connector(kit.vllm_config(model, role, extra), which)


def engine(
    model: Any, extra: dict[str, Any], truth: dict[str, torch.Tensor], role: str = "ec_consumer"
) -> Any:
    """An engine whose own encoder gives the true embeddings (what a correct run reads)."""
    sched = make(model, role, extra, ECConnectorRole.SCHEDULER)
    worker = make(model, role, extra, ECConnectorRole.WORKER)
    return kit.Engine(sched, worker, lambda i: truth[i].clone())


def close(e: Any) -> None:
    e.sched.shutdown()
    e.worker.shutdown()


def save(model: Any, extra: dict[str, Any], items: dict[str, torch.Tensor]) -> None:
    """Store ``items`` as a producer worker does (vLLM's V2 ``ActiveECConnector``)."""
    ensure_ec_transfer_initialized(kit.vllm_config(model, "ec_producer", extra))
    try:
        connector = get_ec_transfer()
        cache: dict[str, torch.Tensor] = {}
        active = ActiveECConnector(connector._vllm_config, cache)
        with active.maybe_get_output(kit.scheduler_output(EmbCacheConnectorMetadata())):
            cache.update(items)
        assert connector.wait_for_saves(30)
    finally:
        ensure_ec_transfer_shutdown()


def assert_read_truth(e: Any, truth: dict[str, torch.Tensor]) -> None:
    """Every request ran once, on the items' true embeddings, and vLLM's encoder cache
    holds nothing else under their identifiers."""
    assert set(e.done.values()) <= {"ok"}
    for rid, read in e.read.items():
        for identifier, tensor in read.items():
            assert torch.equal(tensor, truth[identifier]), (rid, identifier)
    for identifier, tensor in e.cache.items():
        assert torch.equal(tensor.cpu(), truth[identifier]), identifier


def test_daemon_dies_between_lookup_and_load_max_tokens_1(model: Any, own_daemon: Daemon) -> None:
    """The lookup found (and pinned) the item, then the daemon died before the worker
    loaded it. A max_tokens=1 request is done after one step, so the only correct outcome
    is that its one step reads the true embeddings: the item is encoded, not zeros."""
    truth = {"img": embeds(8, 1), "img2": embeds(4, 2)}
    extra = extra_for(own_daemon)
    save(model, extra, truth)
    e = engine(model, extra, truth)
    e.add(kit.request("r1", [("img", 8), ("img2", 4)], max_tokens=1))

    def kill_once_a_load_is_scheduled(out: Any) -> None:
        meta = out.ec_connector_metadata  # the workers' loads of this step
        scheduled = getattr(meta, "loads", None) or getattr(meta, "stage", None)
        if scheduled and own_daemon.proc.proc.poll() is None:
            own_daemon.kill()

    for _ in range(200):  # until the lookup has found the items and a load is scheduled
        e.step(before_worker=kill_once_a_load_is_scheduled)
        if own_daemon.proc.proc.poll() is not None or not e.waiting:
            break
        time.sleep(0.01)
    assert own_daemon.proc.proc.poll() is not None, "no load was ever scheduled"
    e.run()
    assert e.done == {"r1": "ok"} and sorted(e.encoded) == ["img", "img2"]
    assert_read_truth(e, truth)
    # A second request for the same image reads vLLM's cache: the true embeddings again.
    e.add(kit.request("r2", [("img", 8)], max_tokens=1))
    e.run()
    assert e.done["r2"] == "ok" and sorted(e.encoded) == ["img", "img2"]
    assert_read_truth(e, truth)
    close(e)


def test_daemon_dies_after_staging_still_loads(model: Any, own_daemon: Daemon) -> None:
    """Once the worker holds an item, the daemon dying changes nothing for it."""
    truth = {"img": embeds(8, 3)}
    extra = extra_for(own_daemon)
    save(model, extra, truth)
    e = engine(model, extra, truth)
    e.add(kit.request("r1", [("img", 8)]))
    for _ in range(10):
        e.step()
        if e.sched.has_cache_item("img") or not e.waiting:
            break
        e.sched.ensure_cache_available(e.waiting[0], 0)
        if e.sched.has_cache_item("img"):
            break
    own_daemon.kill()
    e.run()
    assert e.done == {"r1": "ok"} and e.encoded == []
    assert_read_truth(e, truth)
    close(e)


def test_unmappable_pool_is_a_plain_lookup(
    model: Any, own_daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A daemon whose host pool this process cannot map (another node, a pod without the
    daemon's /dev/shm): the lookup never maps it, so it neither raises nor misses."""
    import embcache.clients.device.read_table as read_table
    import embcache.clients.device.shm as shm
    import embcache.clients.device.shm_write as shm_write

    truth = {"far": embeds(6, 4), "none": embeds(2, 5)}
    extra = extra_for(own_daemon)
    # Another node: neither the pool nor its read table is mapped here, by the saver either.
    for module in (shm, read_table, shm_write):
        monkeypatch.setattr(module, "boot_id", lambda: "another-node")
    save(model, extra, {"far": truth["far"]})
    with EmbCacheClient(own_daemon.target) as c:  # the client indeed cannot map it
        key = f"vllm/{extra['namespace']}/far"
        # Views are asked for: the reply's location is one this process cannot map.
        with c.get([key], zero_copy=True) as got:
            assert torch.equal(got[0], truth["far"])
        assert c._state.pool_local is False
        assert c.describe_listed([key]) is None  # a session is open, but no table here
    e = engine(model, extra, truth)
    e.add(kit.request("r1", [("far", 6), ("none", 2)]))
    e.run()
    assert e.done == {"r1": "ok"}
    assert_read_truth(e, truth)
    stats = e.sched.get_ec_connector_stats().reduce()
    assert stats["hits"] == 1 and stats["misses"] == 1 and stats["lookup_errors"] == 0
    close(e)


def test_any_lookup_failure_is_a_counted_miss(
    model: Any,
    own_daemon: Daemon,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Whatever the lookup raises (here a bug's StopIteration) is a miss, logged and
    counted, never an exception out of ensure_cache_available."""
    truth = {"x": embeds(3, 6)}
    extra = extra_for(own_daemon)
    e = engine(model, extra, truth)

    def broken(*a: Any, **k: Any) -> Any:
        raise StopIteration

    for call in ("get", "pin", "exists"):  # whichever the lookup uses
        if hasattr(EmbCacheClient, call):
            monkeypatch.setattr(EmbCacheClient, call, broken)
    e.add(kit.request("r1", [("x", 3)]))
    with caplog.at_level(logging.WARNING, logger="embcache.integrations.vllm"):
        e.run()
    assert e.done == {"r1": "ok"} and e.encoded == ["x"]
    assert "StopIteration" in caplog.text
    stats = e.sched.get_ec_connector_stats().reduce()
    assert stats["lookup_errors"] >= 1 and stats["misses"] >= 1
    close(e)


def test_killed_daemon_every_lookup_misses(model: Any, own_daemon: Daemon) -> None:
    truth = {f"k{i}": embeds(3, 10 + i) for i in range(4)}
    extra = extra_for(own_daemon)
    save(model, extra, truth)
    own_daemon.kill()
    e = engine(model, extra, truth)
    for i in range(4):
        e.add(kit.request(f"r{i}", [(f"k{i}", 3)]))
    e.run()
    assert e.done == {f"r{i}": "ok" for i in range(4)}
    assert sorted(e.encoded) == sorted(truth)
    assert_read_truth(e, truth)
    stats = e.sched.get_ec_connector_stats().reduce()
    assert stats["lookup_errors"] >= 1 and stats["hits"] == 0
    close(e)


def test_hung_daemon_does_not_hold_the_scheduler(model: Any, own_daemon: Daemon) -> None:
    """A daemon that stops answering (SIGSTOP) rather than refusing: lookups go out in the
    background, the breaker opens once one is past its deadline, and every request is
    encoded meanwhile; text-only requests never wait. Once the daemon answers again the
    breaker closes and items are found again."""
    truth = {f"h{i}": embeds(4, 20 + i) for i in range(1, 7)}
    extra = extra_for(own_daemon, embcache_timeout_s=60, lookup_timeout_s=60)
    extra["lookup_timeout_s"] = 0.5  # the scheduler's deadline; the worker's stays long
    save(model, extra, truth)
    e = engine(model, extra, truth)
    own_daemon.sigstop()
    started = time.monotonic()
    e.add(kit.request("text", []))
    for i in (1, 4, 5, 6):  # one after the other: each lookup fails on its own
        e.add(kit.request(f"r{i}", [(f"h{i}", 4)]))
        e.run()
    # Far below the 60 s a blocked call would take: the scheduler never waited on it.
    assert time.monotonic() - started < 30
    assert e.done == {"text": "ok", "r1": "ok", "r4": "ok", "r5": "ok", "r6": "ok"}
    assert e.encoded == ["h1", "h4", "h5", "h6"]
    assert_read_truth(e, truth)
    stats = e.sched.get_ec_connector_stats().reduce()
    assert stats["breaker_trips"] >= 1 and stats["lookup_errors"] >= 3
    own_daemon.sigcont()
    time.sleep(0.5)  # past the breaker's cooldown: the next lookup is its probe
    e.add(kit.request("r2", [("h2", 4)]))
    e.run()
    e.add(kit.request("r3", [("h3", 4)]))
    e.run()
    assert e.done["r3"] == "ok" and "h3" not in e.encoded
    assert_read_truth(e, truth)
    close(e)


def test_pins_are_held_only_until_staged(model: Any, own_daemon: Daemon) -> None:
    """A long queue does not pile up leases: a pin lives from the lookup until the
    worker holds the item (or the request leaves)."""
    truth = {f"q{i}": embeds(2, 30 + i) for i in range(12)}
    extra = extra_for(own_daemon)
    save(model, extra, truth)
    e = engine(model, extra, truth)
    for i in range(12):
        e.add(kit.request(f"r{i}", [(f"q{i}", 2)]))
    e.run()
    assert len(e.done) == 12 and e.encoded == []
    assert_read_truth(e, truth)
    time.sleep(0.2)  # the releases go out in the background
    with EmbCacheClient(own_daemon.target) as c:
        keys = [e.sched.key_for(f"q{i}") for i in range(12)]
        assert c.evict(keys) == ["evicted"] * 12  # nothing leased any more
    close(e)


def test_save_in_flight_is_waited_for(model: Any, own_daemon: Daemon) -> None:
    """The producer announces its items in ec_transfer_params; a consumer that looks one
    up before its put has landed waits for it (bounded) instead of encoding it again."""
    truth = {"late": embeds(5, 40)}
    extra = extra_for(own_daemon)
    producer = make(model, "ec_producer", extra, ECConnectorRole.SCHEDULER)
    done_on_producer = kit.request("p1", [("late", 5)])
    _, params = producer.request_finished(done_on_producer)
    assert params["late"]["embcache_namespace"] == producer.namespace
    e = engine(model, extra, truth)
    e.add(kit.request("c1", [("late", 5)], ec_transfer_params=params))
    e.step()
    e.step()
    assert e.waiting and e.encoded == []  # announced, not there yet: it waits
    save(model, extra, truth)  # the put lands
    e.run()
    assert e.done == {"c1": "ok"} and e.encoded == []
    assert_read_truth(e, truth)
    producer.shutdown()
    close(e)


def test_namespace_mismatch_is_reported(
    model: Any, own_daemon: Daemon, caplog: pytest.LogCaptureFixture
) -> None:
    truth = {"n": embeds(3, 50)}
    producer = make(model, "ec_producer", extra_for(own_daemon), ECConnectorRole.SCHEDULER)
    _, params = producer.request_finished(kit.request("p", [("n", 3)]))
    e = engine(model, extra_for(own_daemon), truth)  # another namespace
    e.add(kit.request("c", [("n", 3)], ec_transfer_params=params))
    with caplog.at_level(logging.WARNING, logger="embcache.integrations.vllm"):
        e.run()
    assert e.done == {"c": "ok"} and e.encoded == ["n"]  # no wait for what never lands
    assert "namespace" in caplog.text and producer.namespace in caplog.text
    assert e.sched.get_ec_connector_stats().reduce()["namespace_mismatches"] == 1
    producer.shutdown()
    close(e)


def test_cache_salt_scopes_keys(model: Any, own_daemon: Daemon) -> None:
    """A tenant's items (cache_salt) are read only by requests with the same salt."""
    truth = {"secret": embeds(4, 60)}
    extra = extra_for(own_daemon)
    prod = engine(model, extra, truth, role="ec_producer")
    prod.add(kit.request("p", [("secret", 4)], cache_salt="tenant-a"))
    prod.run()
    assert prod.worker.wait_for_saves(30)
    with EmbCacheClient(own_daemon.target) as c:
        assert not c.exists(prod.sched.key_for("secret"))  # not in the shared scope
    close(prod)
    e = engine(model, extra, truth)
    e.add(kit.request("other", [("secret", 4)], cache_salt="tenant-b"))
    e.add(kit.request("plain", [("secret", 4)]))
    e.run()
    assert e.encoded == ["secret"]  # neither could read tenant a's entry
    e2 = engine(model, extra, truth)
    e2.add(kit.request("same", [("secret", 4)], cache_salt="tenant-a"))
    e2.run()
    assert e2.done == {"same": "ok"} and e2.encoded == []
    assert_read_truth(e2, truth)
    close(e)
    close(e2)


def test_saves_are_counted_per_item(model: Any, own_daemon: Daemon) -> None:
    """One item the daemon refuses does not count the batch's other items as failed."""
    extra = extra_for(own_daemon)
    ensure_ec_transfer_initialized(kit.vllm_config(model, "ec_producer", extra))
    try:
        connector = get_ec_transfer()
        cache: dict[str, torch.Tensor] = {}
        active = ActiveECConnector(connector._vllm_config, cache)
        with active.maybe_get_output(kit.scheduler_output(EmbCacheConnectorMetadata())):
            cache["good"] = embeds(3, 70)
            cache["also-good"] = embeds(2, 71)
            cache["huge"] = (
                torch.zeros(48 << 20, dtype=torch.uint8).view(torch.bfloat16).view(-1, WIDTH)
            )  # > the pool
        assert connector.wait_for_saves(30)
        stats = connector.build_connector_worker_meta().stats
    finally:
        ensure_ec_transfer_shutdown()
    assert stats["saves"] == 2 and stats["save_failures"] == 1
