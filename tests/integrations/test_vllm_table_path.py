"""The vLLM connector on the daemon's node: lookups answered from the daemon's read table
inline in the scheduler step, stagings copied out of the pool, no Get, pin, release or
renew call, and the same guarantees as the call path (docs/integrations.md).

Each test runs its own daemon (the process-wide table and pool mappings then belong to it
alone); the daemon's counters say what reached it: a hit through a call counts in ``hits``
only, a read from the table in ``hits`` and ``read_table.reads`` (posted by the reader), a
miss through a call in ``misses``.
"""

from __future__ import annotations

import importlib.util
import signal
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
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
    from embcache.clients._sync.connection import Connection
    from embcache.clients._sync.stateless_calls import StatelessCalls
    from embcache.clients.device import read_table as client_table
    from embcache.integrations.vllm.metadata import EmbCacheConnectorMetadata
    from embcache.service.daemon_process import DaemonProcess

WIDTH = 64
pytestmark = pytest.mark.skipif(not client_table.ORDERED_STORES, reason="x86-64 only")


@pytest.fixture
def daemon() -> Iterator[DaemonProcess]:
    """A daemon of this test only (overrides the module-wide one of conftest.py)."""
    name = f"embcache-vt-{uuid.uuid4().hex[:10]}"
    with tempfile.TemporaryDirectory(prefix="embcache-vt-") as folder:
        proc = DaemonProcess(
            [
                "--grpc-socket",
                str(Path(folder) / "d.sock"),
                "--host-pool-bytes",
                "32MiB",
                "--shm-name",
                name,
            ]
        )
        try:
            yield proc
        finally:
            proc.stop()
            for suffix in ("", ".index", ".index.tmp", ".reads"):  # what a killed one leaves
                (Path("/dev/shm") / f"{name}{suffix}").unlink(missing_ok=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return kit.model_config(kit.write_model(tmp_path_factory.mktemp("model")))


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Every pin, get, release and renew made through a client of this process (with a
    non-empty list of leases for the last two), by name."""
    seen: dict[str, int] = {}

    def counting(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            if name not in ("release", "renew") or (args and list(args[0])):
                seen[name] = seen.get(name, 0) + 1
            return real(self, *args, **kwargs)

        return call

    # Each where the call is made: releases of leased tensors and reads of bytes come from
    # the client's parts, not through its public methods.
    owners = {"release": Connection, "renew": StatelessCalls, "get_bytes": StatelessCalls}
    for name in ("pin", "get", "release", "renew", "get_bytes"):
        owner = owners.get(name, EmbCacheClient)
        monkeypatch.setattr(owner, name, counting(name, getattr(owner, name)))
    return seen


def extra_for(daemon: DaemonProcess) -> dict[str, Any]:
    return {"embcache_target": daemon.unix_target, "namespace": f"t-{uuid.uuid4().hex[:12]}"}


def embeds(rows: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, WIDTH, generator=g).to(torch.bfloat16)


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


def engine(model: Any, extra: dict[str, Any], truth: dict[str, torch.Tensor]) -> Any:
    """A consumer whose own encoder gives the true embeddings (what a correct run reads)."""
    config = kit.vllm_config(model, "ec_consumer", extra)
    sched = ECConnectorFactory.create_connector(config, ECConnectorRole.SCHEDULER)
    worker = ECConnectorFactory.create_connector(config, ECConnectorRole.WORKER)
    return kit.Engine(sched, worker, lambda i: truth[i].clone())


def close(e: Any) -> None:
    e.sched.shutdown()
    e.worker.shutdown()


def assert_read_truth(e: Any, truth: dict[str, torch.Tensor]) -> None:
    assert set(e.done.values()) <= {"ok"}
    for rid, read in e.read.items():
        for identifier, tensor in read.items():
            assert torch.equal(tensor, truth[identifier]), (rid, identifier)
    for identifier, tensor in e.cache.items():
        assert torch.equal(tensor.cpu(), truth[identifier]), identifier


def counters(client: EmbCacheClient) -> dict[str, int]:
    s = client.stats()
    return {
        "hits": s["hits"],
        "misses": s["misses"],
        "table_reads": s["read_table"]["reads"],
        "leases_active": s["leases_active"],
    }


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def warmed(model: Any, extra: dict[str, Any], truth: dict[str, torch.Tensor]) -> Any:
    """A consumer engine whose scheduler and worker clients have their sessions open (one
    request for an item "warm" taken through whatever path its first lookup takes)."""
    e = engine(model, extra, truth)
    e.add(kit.request("warm", [("warm", 2)]))
    e.run()
    assert e.done == {"warm": "ok"} and e.encoded == []
    return e


def test_lookup_stage_and_use_make_no_call(
    model: Any, daemon: DaemonProcess, calls: dict[str, int]
) -> None:
    """Once the clients are connected, a request's items are looked up from the table in
    the scheduler step itself, staged by copies out of the pool and used: the daemon
    answers no Get (hit or miss), no lease is taken, nothing is released or renewed, and
    the model reads the true embeddings."""
    truth = {"warm": embeds(2, 0), **{f"img{i}": embeds(3 + i, i + 1) for i in range(3)}}
    extra = extra_for(daemon)
    save(model, extra, truth)
    e = warmed(model, extra, truth)
    with EmbCacheClient(daemon.unix_target) as probe:
        before = counters(probe)
        calls.clear()
        e.add(kit.request("r1", [("img0", 3), ("img1", 4)]))
        e.add(kit.request("r2", [("img2", 5)], max_tokens=1))
        steps = e.steps
        e.step()  # the lookups are answered inline: every item is sent to stage at once
        items = e.sched._sched()._items
        assert {items[e.sched.key_for(f"img{i}")].state for i in range(3)} == {"staging"}
        e.run()
        assert e.done == {"warm": "ok", "r1": "ok", "r2": "ok"} and e.encoded == []
        assert_read_truth(e, truth)
        assert e.steps - steps == 3  # look up and stage; hear it staged; use
        assert calls == {}  # no pin, no get, no release or renew
        wait_for(lambda: counters(probe)["table_reads"] == before["table_reads"] + 3)
        after = counters(probe)
        assert after["hits"] - after["table_reads"] == before["hits"] - before["table_reads"]
        assert after["misses"] == before["misses"] and after["leases_active"] == 0
    stats = e.sched.get_ec_connector_stats().reduce()
    assert stats["hits"] == 4 and stats["staged"] == 4 and stats.get("lookup_errors", 0) == 0
    close(e)


def test_keys_the_table_does_not_list_are_asked_in_the_background(
    model: Any, daemon: DaemonProcess, calls: dict[str, int]
) -> None:
    """A request with a stored item and one never stored: the stored one is answered from
    the table, the other by one background pin (a miss the daemon counts), and it is
    encoded; nothing stays leased."""
    truth = {"warm": embeds(2, 0), "here": embeds(4, 7), "absent": embeds(3, 8)}
    extra = extra_for(daemon)
    save(model, extra, {k: truth[k] for k in ("warm", "here")})
    e = warmed(model, extra, truth)
    with EmbCacheClient(daemon.unix_target) as probe:
        before = counters(probe)
        calls.clear()
        e.add(kit.request("r", [("here", 4), ("absent", 3)]))
        e.run()
        assert e.done["r"] == "ok" and e.encoded == ["absent"]
        assert_read_truth(e, truth)
        assert calls.get("pin") == 1 and "get" not in calls
        after = counters(probe)
        assert after["misses"] == before["misses"] + 1 and after["leases_active"] == 0
    close(e)


def test_eviction_between_lookup_and_staging_is_a_clean_failed_load(
    model: Any, daemon: DaemonProcess
) -> None:
    """The table's answer holds nothing: the entry can be evicted between the lookup and
    the worker's staging. That staging fails, the item is encoded by vLLM (a max_tokens=1
    request reads the true embeddings) and nothing is cached under its identifier."""
    truth = {"warm": embeds(2, 0), "gone": embeds(6, 11), "kept": embeds(2, 12)}
    extra = extra_for(daemon)
    save(model, extra, truth)
    e = warmed(model, extra, truth)
    evicted: list[str] = []

    with EmbCacheClient(daemon.unix_target) as admin:

        def evict_once_staged(out: Any) -> None:
            meta = out.ec_connector_metadata
            keys = [s.key for s in getattr(meta, "stage", ())]
            gone = e.sched.key_for("gone")
            if gone in keys and not evicted:
                evicted.extend(admin.evict([gone]))  # no lease to stop it

        e.add(kit.request("r", [("gone", 6), ("kept", 2)], max_tokens=1))
        for _ in range(100):
            e.step(before_worker=evict_once_staged)
            if not e.waiting:
                break
        assert evicted == ["evicted"]
        assert e.done == {"warm": "ok", "r": "ok"} and e.encoded == ["gone"]
        assert_read_truth(e, truth)
        stats = e.sched.get_ec_connector_stats().reduce()
        assert stats["stage_failures"] == 1 and stats["loads"] >= 2  # "warm" and "kept"
        # A second request for it reads vLLM's encoder cache: the true embeddings again.
        e.add(kit.request("r2", [("gone", 6)], max_tokens=1))
        e.run()
        assert e.done["r2"] == "ok" and e.encoded == ["gone"]
        assert_read_truth(e, truth)
    close(e)


def test_a_client_that_cannot_map_the_pool_goes_through_calls(
    model: Any, daemon: DaemonProcess, calls: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A remote-like client (the pool's boot id is another machine's): no table is read;
    lookups are background pins, stagings calls, and the items still load right."""
    import embcache.clients.device.shm as shm

    monkeypatch.setattr(shm, "boot_id", lambda: "another-node")
    truth = {"warm": embeds(2, 0), "far": embeds(5, 21)}
    extra = extra_for(daemon)
    save(model, extra, truth)
    e = warmed(model, extra, truth)
    with EmbCacheClient(daemon.unix_target) as probe:
        before = counters(probe)
        calls.clear()
        e.add(kit.request("r", [("far", 5)]))
        e.run()
        assert e.done["r"] == "ok" and e.encoded == []
        assert_read_truth(e, truth)
        assert calls.get("pin") == 1  # the lookup asked the daemon
        time.sleep(0.2)  # releases go out in the background
        after = counters(probe)
        assert after["table_reads"] == before["table_reads"]  # nothing read from a table
        assert after["hits"] > before["hits"] and after["leases_active"] == 0
    close(e)


def test_an_open_breaker_answers_no_lookup_from_the_table(
    model: Any, daemon: DaemonProcess
) -> None:
    """While the breaker is open (the daemon failed calls) the scheduler takes no item
    from the daemon at all, table or not: every item is encoded."""
    truth = {"warm": embeds(2, 0), "b": embeds(3, 31)}
    extra = {**extra_for(daemon), "breaker_cooldown_s": 60}
    save(model, extra, truth)
    e = warmed(model, extra, truth)
    lookups = e.sched._sched().lookups
    for _ in range(3):
        lookups.breaker.failed("a test's failure")
    assert lookups.breaker.is_open
    e.add(kit.request("r", [("b", 3)]))
    e.run()
    assert e.done["r"] == "ok" and e.encoded == ["b"]
    assert_read_truth(e, truth)
    close(e)


def test_a_daemon_killed_after_connecting_is_noticed_at_the_lookup(
    model: Any, daemon: DaemonProcess
) -> None:
    """A killed daemon leaves its table mapped and open. The table lookup notices that its
    session's socket is closed (no daemon to load from): the item is not sent to a staging
    doomed to fail, the lookup's call fails instead and the item is encoded."""
    truth = {"warm": embeds(2, 0), "k": embeds(3, 41)}
    extra = extra_for(daemon)
    save(model, extra, truth)
    e = warmed(model, extra, truth)
    daemon.stop(timeout=10, sig=signal.SIGKILL)
    e.add(kit.request("r", [("k", 3)], max_tokens=1))
    e.run()
    assert e.done == {"warm": "ok", "r": "ok"} and e.encoded == ["k"]
    assert_read_truth(e, truth)
    stats = e.sched.get_ec_connector_stats().reduce()
    assert stats["lookup_errors"] >= 1 and stats.get("stage_failures", 0) == 0
    close(e)
