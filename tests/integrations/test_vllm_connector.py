"""EmbCacheECConnector against vLLM 0.33's real classes and a real daemon (CPU).

vLLM's factory builds the connector from a real ``VllmConfig``; saves go through vLLM's
``ECConnectorModelRunnerMixin``, loads through the scheduler-side hooks, a real
``SchedulerOutput`` and the mixin's connector-output context, as the model runner does.
"""

from __future__ import annotations

import importlib.util
import pickle
import sys
import uuid
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

if importlib.util.find_spec("vllm") is None:  # pragma: no cover - CI installs it
    pytest.skip("vllm is not installed (scripts/install_engines.sh)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).parent))
# vLLM's import chain reaches torch.jit APIs that this torch deprecates; nothing else is
# let through (pyproject's filterwarnings = error).
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
    from vllm.plugins import load_general_plugins
    from vllm.v1.outputs import ECConnectorOutput
    from vllm.v1.worker.ec_connector_model_runner_mixin import (
        ECConnectorModelRunnerMixin as Mixin,
    )

    from embcache.errors import InvalidArgument
    from embcache.integrations.vllm import register
    from embcache.integrations.vllm.connector import EmbCacheECConnector
    from embcache.integrations.vllm.metadata import (
        EmbCacheConnectorMetadata,
        EmbCacheWorkerMetadata,
    )

WIDTH = 64


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return kit.model_config(kit.write_model(tmp_path_factory.mktemp("model")))


@pytest.fixture
def extra(daemon: Any) -> dict[str, Any]:
    # A namespace of its own per test: tests never see each other's entries.
    return {"embcache_target": daemon.unix_target, "namespace": f"t-{uuid.uuid4().hex[:12]}"}


def make(model: Any, role: str, extra: dict[str, Any], which: ECConnectorRole, **kw: Any) -> Any:
    return ECConnectorFactory.create_connector(kit.vllm_config(model, role, extra, **kw), which)


def embeds(rows: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, WIDTH, generator=g).to(dtype)


def produce(model: Any, extra: dict[str, Any], items: dict[str, torch.Tensor], **kw: Any) -> Any:
    """Save ``items`` through vLLM's worker mixin on a producer worker; returns the next
    step's worker metadata (the puts finish in the background, after this step's report)."""
    ensure_ec_transfer_initialized(kit.vllm_config(model, "ec_producer", extra, **kw))
    try:
        connector = get_ec_transfer()
        cache: dict[str, torch.Tensor] = {}
        out = kit.scheduler_output(EmbCacheConnectorMetadata())
        with Mixin.maybe_get_ec_connector_output(out, cache) as output:
            for identifier, tensor in items.items():
                cache[identifier] = tensor
                Mixin.maybe_save_ec_to_connector(cache, identifier)
        assert output.ec_connector_worker_meta is None  # nothing stored yet: never waits
        assert connector.wait_for_saves(30)
        return connector.build_connector_worker_meta()
    finally:
        ensure_ec_transfer_shutdown()


def consume(model: Any, extra: dict[str, Any], meta: Any) -> tuple[dict[str, torch.Tensor], Any]:
    """Load ``meta``'s items through the mixin on a consumer worker: (cache, output)."""
    ensure_ec_transfer_initialized(kit.vllm_config(model, "ec_consumer", extra))
    try:
        cache: dict[str, torch.Tensor] = {}
        with Mixin.maybe_get_ec_connector_output(kit.scheduler_output(meta), cache) as output:
            pass
        return cache, output
    finally:
        ensure_ec_transfer_shutdown()


def test_factory_by_module_path_and_by_name(model: Any, extra: dict[str, Any]) -> None:
    by_path = make(model, "ec_producer", extra, ECConnectorRole.SCHEDULER)
    assert type(by_path) is EmbCacheECConnector and by_path.is_producer
    load_general_plugins()  # vLLM's own loader runs the entry point
    assert "EmbCacheECConnector" in ECConnectorFactory._registry
    register()  # vLLM runs plugins in every process, maybe twice: no error
    by_name = make(model, "ec_consumer", extra, ECConnectorRole.WORKER, by_name=True)
    assert type(by_name) is EmbCacheECConnector and by_name.is_consumer
    assert by_name.role is ECConnectorRole.WORKER
    with pytest.raises(RuntimeError, match="scheduler-side"):
        by_name.has_cache_item("x")
    for c in (by_path, by_name):
        c.shutdown()


def test_save_then_load_round_trip(model: Any, extra: dict[str, Any], client: Any) -> None:
    items = {"img-a": embeds(12, 1), "img-b": embeds(7, 2)}
    worker_meta = produce(model, extra, items)
    assert worker_meta.stats["saves"] == 2
    assert worker_meta.stats["save_bytes"] == sum(t.numel() * 2 for t in items.values())

    sched = make(model, "ec_consumer", extra, ECConnectorRole.SCHEDULER)
    req = kit.request("r1", [("img-a", 12), ("img-b", 7), ("img-c", 5)])
    out = kit.scheduler_step(sched, req)
    meta = out.ec_connector_metadata
    assert [s.identifier for s in meta.loads] == ["img-a", "img-b"]  # img-c: never saved
    assert [s.shape for s in meta.loads] == [(12, WIDTH), (7, WIDTH)]
    # The scheduler's pins keep the entries: an operator's evict cannot take them now.
    assert client.evict([sched.key_for("img-a")]) == ["leased"]

    cache, output = consume(model, extra, pickle.loads(pickle.dumps(meta)))
    for identifier, tensor in items.items():
        assert torch.equal(cache[identifier], tensor)
        assert cache[identifier].dtype == torch.bfloat16
    assert "img-c" not in cache
    wmeta = output.ec_connector_worker_meta
    assert wmeta.loaded == {"img-a", "img-b"} and not wmeta.failed

    sched.update_connector_output(output)  # the pins end once the worker has the items
    assert client.evict([sched.key_for("img-a")]) == ["evicted"]
    assert sched.take_unavailable_requests() == set()
    stats = sched.get_ec_connector_stats().reduce()
    assert (stats["hits"], stats["misses"], stats["loads"]) == (2, 1, 2)
    assert stats["load_bytes"] == (12 + 7) * WIDTH * 2
    assert sched.get_ec_connector_stats() is None  # counts are per interval
    sched.shutdown()


def test_has_cache_item_is_batched_and_memoised(model: Any, extra: dict[str, Any]) -> None:
    produce(model, extra, {"m1": embeds(3, 3)})
    sched = make(model, "ec_consumer", {**extra, "prefetch": False}, ECConnectorRole.SCHEDULER)
    req = kit.request("r", [("m1", 3), ("m2", 3)])
    sched.ensure_cache_available(req, 0)
    calls = []
    real_get = sched._scheduler.client.get
    sched._scheduler.client.get = lambda *a, **k: calls.append(a) or real_get(*a, **k)
    assert sched.has_cache_item("m1") and not sched.has_cache_item("m2")
    assert sched.has_cache_item("m1") and not sched.has_cache_item("m2")
    assert calls == []  # answered by the one batched lookup of ensure_cache_available
    sched.build_connector_meta(kit.scheduler_output(None))
    assert not sched.has_cache_item("m2") and len(calls) == 1  # a new step asks again
    sched.shutdown()


@pytest.mark.parametrize("pin", [True, False])
def test_prefetch_only_where_the_lookup_would_not_fetch(
    model: Any, extra: dict[str, Any], pin: bool
) -> None:
    """The pin's host get fetches shared-tier misses itself, so only exists() lookups are
    preceded by a prefetch."""
    produce(model, extra, {"p1": embeds(3, 3)})
    cfg = {**extra, "scheduler_pin": pin, "prefetch": True}
    sched = make(model, "ec_consumer", cfg, ECConnectorRole.SCHEDULER)
    client = sched._scheduler.client
    asked: list[list[str]] = []
    real = client.prefetch
    client.prefetch = lambda keys, *a, **k: asked.append(list(keys)) or real(keys, *a, **k)
    sched.ensure_cache_available(kit.request("r", [("p1", 3), ("p2", 3)]), 0)
    assert sched.has_cache_item("p1") and not sched.has_cache_item("p2")
    assert asked == ([] if pin else [[sched.key_for("p1"), sched.key_for("p2")]])
    sched.shutdown()


def test_scheduler_never_initialises_cuda(model: Any, extra: dict[str, Any]) -> None:
    produce(model, extra, {"c1": embeds(4, 4)})
    sched = make(model, "ec_consumer", extra, ECConnectorRole.SCHEDULER)
    kit.scheduler_step(sched, kit.request("r", [("c1", 4)]))
    assert not torch.cuda.is_initialized()
    sched.shutdown()


def test_miss_after_has_cache_item_without_pin(
    model: Any, extra: dict[str, Any], client: Any
) -> None:
    extra = {**extra, "scheduler_pin": False}
    produce(model, extra, {"gone": embeds(6, 5)})
    sched = make(model, "ec_consumer", extra, ECConnectorRole.SCHEDULER)
    req = kit.request("r-gone", [("gone", 6)])
    out = kit.scheduler_step(sched, req)
    assert [s.shape for s in out.ec_connector_metadata.loads] == [None]  # width not known
    assert client.evict([sched.key_for("gone")]) == ["evicted"]  # evicted in between

    cache, output = consume(model, extra, out.ec_connector_metadata)
    assert cache["gone"].shape == (6, WIDTH)  # a placeholder keeps the step running
    assert "gone" in output.ec_connector_worker_meta.failed
    sched.update_connector_output(output)
    assert sched.take_unavailable_requests() == {"r-gone"}  # vLLM fails it, retryable
    assert sched.take_unavailable_requests() == set()
    stats = sched.get_ec_connector_stats().reduce()
    assert stats["load_failures"] == 1 and stats["loads"] == 0
    sched.shutdown()


@pytest.mark.parametrize("pin", [True, False])
def test_mismatched_rows_and_dtype_are_misses(model: Any, extra: dict[str, Any], pin: bool) -> None:
    extra = {**extra, "scheduler_pin": pin}
    produce(model, extra, {"rows": embeds(10, 6), "f32": embeds(5, 7, torch.float32)})
    sched = make(model, "ec_consumer", extra, ECConnectorRole.SCHEDULER)
    req = kit.request("r-mis", [("rows", 12), ("f32", 5)])
    out = kit.scheduler_step(sched, req)
    if pin:  # seen in the scheduler: vLLM encodes both itself
        assert out.ec_connector_metadata.loads == []
        stats = sched.get_ec_connector_stats().reduce()
        assert stats["mismatches"] == 2 and stats["misses"] == 2
    else:  # seen by the worker: a failed load, not a crash
        cache, output = consume(model, extra, out.ec_connector_metadata)
        failed = output.ec_connector_worker_meta.failed
        assert set(failed) == {"rows", "f32"}
        assert "rows" in failed["rows"] and "float32" in failed["f32"]
        assert cache["rows"].shape == (12, WIDTH) and cache["f32"].dtype == torch.bfloat16
        sched.update_connector_output(output)
        assert sched.take_unavailable_requests() == {"r-mis"}
    sched.shutdown()


def test_metadata_pickles(model: Any, extra: dict[str, Any]) -> None:
    produce(model, extra, {"p": embeds(2, 8)})
    sched = make(model, "ec_consumer", extra, ECConnectorRole.SCHEDULER)
    meta = kit.scheduler_step(sched, kit.request("rp", [("p", 2)])).ec_connector_metadata
    again = pickle.loads(pickle.dumps(meta))
    assert again == meta and isinstance(again, EmbCacheConnectorMetadata)
    a = EmbCacheWorkerMetadata(loaded={"x", "y"}, stats={"loads": 2})
    b = EmbCacheWorkerMetadata(failed={"y": "gone"}, stats={"loads": 1, "load_failures": 1})
    both = pickle.loads(pickle.dumps(a.aggregate(b)))
    assert both.loaded == {"x"} and both.failed == {"y": "gone"}
    assert both.stats == {"loads": 3, "load_failures": 1}
    sched.shutdown()


def test_request_local_identifiers_are_refused(model: Any, extra: dict[str, Any]) -> None:
    config = kit.vllm_config(
        model, "ec_consumer", extra, prefix_caching=False, mm_processor_cache_gb=0
    )
    with pytest.raises(InvalidArgument, match="request-local"):
        ECConnectorFactory.create_connector(config, ECConnectorRole.SCHEDULER)
    config.ec_transfer_config.ec_connector_extra_config["allow_request_local_ids"] = True
    ECConnectorFactory.create_connector(config, ECConnectorRole.SCHEDULER).shutdown()
    # Either cache on is enough: identifiers are content hashes again.
    for kw in ({"prefix_caching": True, "mm_processor_cache_gb": 0}, {"prefix_caching": False}):
        config = kit.vllm_config(model, "ec_consumer", extra, **kw)
        ECConnectorFactory.create_connector(config, ECConnectorRole.SCHEDULER).shutdown()


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({}, "embcache_target"),
        ({"embcache_target": "unix:/x", "embcache_targte": 1}, "unknown"),
        ({"embcache_target": "unix:/x", "save_ranks": "some"}, "save_ranks"),
        ({"embcache_target": "unix:/x", "pin_ttl_s": 0}, "pin_ttl_s"),
        ({"embcache_target": "unix:/x", "namespace": "a/b"}, "namespace"),
    ],
)
def test_bad_extra_config(model: Any, extra: dict[str, Any], match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        make(model, "ec_consumer", extra, ECConnectorRole.SCHEDULER)


def test_namespace_follows_model_and_dtype(model: Any, daemon: Any) -> None:
    extra = {"embcache_target": daemon.unix_target}
    first = make(model, "ec_producer", extra, ECConnectorRole.SCHEDULER)
    again = make(model, "ec_consumer", extra, ECConnectorRole.SCHEDULER)
    other = kit.model_config(Path(model.model), dtype="float16")  # same model, other dtype
    third = make(other, "ec_consumer", extra, ECConnectorRole.SCHEDULER)
    assert first.namespace == again.namespace != third.namespace
    name = Path(model.model).name
    assert first.key_for("h").startswith(f"vllm/{name}-") and first.key_for("h").endswith("/h")
    for c in (first, again, third):
        c.shutdown()


def test_tensor_parallel_rank_zero_saves(model: Any, extra: dict[str, Any], client: Any) -> None:
    keys = {}
    for rank in (1, 0):
        produce(model, extra, {f"tp{rank}": embeds(3, 10 + rank)}, rank=rank, tp=2)
        keys[rank] = make(model, "ec_producer", extra, ECConnectorRole.SCHEDULER).key_for(
            f"tp{rank}"
        )
    assert client.exists([keys[0], keys[1]]) == [True, False]
    produce(model, {**extra, "save_ranks": "all"}, {"tp1b": embeds(3, 12)}, rank=1, tp=2)
    sched = make(model, "ec_producer", extra, ECConnectorRole.SCHEDULER)
    assert client.exists(sched.key_for("tp1b"))
    assert sched.has_cache_item("tp1b")  # a producer skips encoding what is stored
    sched.shutdown()


def test_worker_output_without_embcache_meta(model: Any, extra: dict[str, Any]) -> None:
    sched = make(model, "ec_consumer", extra, ECConnectorRole.SCHEDULER)
    sched.update_connector_output(ECConnectorOutput())  # a step with nothing to report
    with pytest.raises(InvalidArgument, match="foreign"):
        sched.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=object()))  # type: ignore[arg-type]
    sched.shutdown()
