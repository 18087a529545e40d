"""EmbCacheECConnector against vLLM's real classes (0.33 and 0.34) and a real daemon (CPU).

vLLM's factory builds the connector from a real ``VllmConfig``; saves and loads go through
vLLM's V2 model runner's ``ActiveECConnector`` and the scheduler-side hooks in the order of
vLLM's scheduler (``vllm_kit.Engine``), with real requests and scheduler outputs.
"""

from __future__ import annotations

import importlib.util
import os
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
    from vllm.v1.worker.gpu.ec_connector import ActiveECConnector

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
    """Save ``items`` through vLLM's V2 ``ActiveECConnector`` on a producer worker; returns
    the next report's worker metadata (the puts finish in the background)."""
    ensure_ec_transfer_initialized(kit.vllm_config(model, "ec_producer", extra, **kw))
    try:
        connector = get_ec_transfer()
        cache: dict[str, torch.Tensor] = {}
        active = ActiveECConnector(connector._vllm_config, cache)
        out = kit.scheduler_output(EmbCacheConnectorMetadata())
        with active.maybe_get_output(out) as output:
            cache.update(items)  # the encoder's outputs of this step
        assert output.ec_connector_worker_meta is None  # nothing stored yet: never waits
        assert connector.wait_for_saves(30)
        return connector.build_connector_worker_meta()
    finally:
        ensure_ec_transfer_shutdown()


def consumer_engine(model: Any, extra: dict[str, Any], encode: Any = None) -> Any:
    """A consumer engine (scheduler and worker connectors) whose encoder is ``encode``."""
    sched = make(model, "ec_consumer", extra, ECConnectorRole.SCHEDULER)
    worker = make(model, "ec_consumer", extra, ECConnectorRole.WORKER)
    return kit.Engine(sched, worker, encode or (lambda i: pytest.fail(f"encoded {i}")))


def close(engine: Any) -> None:
    engine.sched.shutdown()
    engine.worker.shutdown()


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

    local = embeds(5, 3)
    engine = consumer_engine(model, extra, encode=lambda i: local)
    engine.add(kit.request("r1", [("img-a", 12), ("img-b", 7), ("img-c", 5)]))
    engine.step()  # looked up and pinned: the request waits for the stagings
    assert engine.waiting and "r1" not in engine.read
    # The scheduler's pins keep the entries until the worker holds them.
    assert client.evict([engine.sched.key_for("img-a")]) == ["leased"]
    engine.run()
    assert engine.done == {"r1": "ok"} and engine.encoded == ["img-c"]  # never saved
    read = engine.read["r1"]
    for identifier, tensor in items.items():
        assert torch.equal(read[identifier], tensor) and read[identifier].dtype == torch.bfloat16
    assert torch.equal(read["img-c"], local)
    # Staged copies are the worker's own: the pins ended, the entries may go.
    assert client.evict([engine.sched.key_for("img-a")]) == ["evicted"]
    stats = engine.sched.get_ec_connector_stats().reduce()
    assert (stats["hits"], stats["misses"], stats["loads"], stats["staged"]) == (2, 1, 2, 2)
    assert stats["load_bytes"] == (12 + 7) * WIDTH * 2 and stats["load_failures"] == 0
    assert engine.sched.get_ec_connector_stats() is None  # counts are per interval
    close(engine)


def test_has_cache_item_is_batched_and_memoised(model: Any, extra: dict[str, Any]) -> None:
    produce(model, extra, {"m1": embeds(3, 3)})
    sched = make(model, "ec_consumer", {**extra, "prefetch": False}, ECConnectorRole.SCHEDULER)
    client = sched._scheduler.lookups._connect()
    calls = []
    real_pin = client.pin
    client.pin = lambda *a, **k: calls.append(a) or real_pin(*a, **k)
    sched._scheduler.lookups._client = client
    req = kit.request("r", [("m1", 3), ("m2", 3)])
    assert not sched.ensure_cache_available(req, 0)  # m1 is to be staged first
    assert len(calls) == 1 and len(calls[0][0]) == 2  # one call for both items
    assert not sched.has_cache_item("m1") and not sched.has_cache_item("m2")
    sched.build_connector_meta(kit.scheduler_output(None))
    assert not sched.ensure_cache_available(req, 0) and len(calls) == 1  # m1 staging
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
    lookups = sched._scheduler.lookups
    client = lookups._client = lookups._connect()
    asked: list[list[str]] = []
    real = client.prefetch
    client.prefetch = lambda keys, *a, **k: asked.append(list(keys)) or real(keys, *a, **k)
    sched.ensure_cache_available(kit.request("r", [("p1", 3), ("p2", 3)]), 0)
    lookups.wait([sched.key_for("p1"), sched.key_for("p2")], 30)
    assert lookups.answer(sched.key_for("p1")).found
    assert not lookups.answer(sched.key_for("p2")).found
    assert asked == ([] if pin else [[sched.key_for("p1"), sched.key_for("p2")]])
    sched.shutdown()


def test_scheduler_never_initialises_cuda(model: Any, extra: dict[str, Any]) -> None:
    produce(model, extra, {"c1": embeds(4, 4)})
    engine = consumer_engine(model, extra)
    engine.add(kit.request("r", [("c1", 4)]))
    engine.run()
    assert engine.done == {"r": "ok"} and not torch.cuda.is_initialized()
    close(engine)


@pytest.mark.parametrize("pin", [True, False])
def test_evicted_before_staging_is_encoded(
    model: Any, extra: dict[str, Any], client: Any, pin: bool
) -> None:
    """An entry gone between the lookup and the worker's load is encoded instead: the
    request runs once, on the right embeddings, and nothing else is put in any cache."""
    extra = {**extra, "scheduler_pin": pin}
    produce(model, extra, {"gone": embeds(6, 5)})
    truth = embeds(6, 5)
    engine = consumer_engine(model, extra, encode=lambda i: truth.clone())
    engine.add(kit.request("r-gone", [("gone", 6)]))
    engine.sched.ensure_cache_available(engine.waiting[0], 0)
    engine.sched._scheduler.lookups.wait([engine.sched.key_for("gone")], 30)
    if pin:  # pinned: an operator cannot take it; a restart could, which evict stands for
        assert client.evict([engine.sched.key_for("gone")]) == ["leased"]
        engine.sched._scheduler.lookups._client.release(
            [engine.sched._scheduler._items[engine.sched.key_for("gone")].lease_id]
        )
    assert client.evict([engine.sched.key_for("gone")]) == ["evicted"]
    engine.run()
    assert engine.done == {"r-gone": "ok"} and engine.encoded == ["gone"]
    assert torch.equal(engine.read["r-gone"]["gone"], truth)
    stats = engine.sched.get_ec_connector_stats().reduce()
    assert stats["stage_failures"] == 1 and stats["loads"] == 0 and stats["load_failures"] == 0
    close(engine)


@pytest.mark.parametrize("pin", [True, False])
def test_mismatched_rows_and_dtype_are_misses(model: Any, extra: dict[str, Any], pin: bool) -> None:
    extra = {**extra, "scheduler_pin": pin}
    produce(model, extra, {"rows": embeds(10, 6), "f32": embeds(5, 7, torch.float32)})
    engine = consumer_engine(model, extra, encode=lambda i: embeds(12 if i == "rows" else 5, 9))
    engine.add(kit.request("r-mis", [("rows", 12), ("f32", 5)]))
    engine.run()
    assert engine.done == {"r-mis": "ok"} and sorted(engine.encoded) == ["f32", "rows"]
    assert engine.read["r-mis"]["rows"].shape == (12, WIDTH)
    assert engine.read["r-mis"]["f32"].dtype == torch.bfloat16
    stats = engine.sched.get_ec_connector_stats().reduce()
    if pin:  # seen in the scheduler
        assert stats["mismatches"] == 2 and stats["misses"] == 2
    else:  # seen by the worker's staging
        assert stats["stage_failures"] == 2
    close(engine)


def test_metadata_pickles(model: Any, extra: dict[str, Any]) -> None:
    produce(model, extra, {"p": embeds(2, 8)})
    sched = make(model, "ec_consumer", extra, ECConnectorRole.SCHEDULER)
    req = kit.request("rp", [("p", 2)])
    sched.ensure_cache_available(req, 0)
    sched._scheduler.lookups.wait([sched.key_for("p")], 30)
    meta = kit.scheduler_step(sched, req).ec_connector_metadata
    assert [s.key for s in meta.stage] == [sched.key_for("p")]
    again = pickle.loads(pickle.dumps(meta))
    assert again == meta and isinstance(again, EmbCacheConnectorMetadata)
    a = EmbCacheWorkerMetadata(staged={"x", "y"}, stats={"staged": 2})
    b = EmbCacheWorkerMetadata(failed={"y": "gone"}, stats={"staged": 1, "stage_failures": 1})
    both = pickle.loads(pickle.dumps(a.aggregate(b)))
    assert both.staged == {"x"} and both.failed == {"y": "gone"}
    assert both.stats == {"staged": 3, "stage_failures": 1}
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


def test_namespace_follows_weights_and_config_not_path(
    model: Any, daemon: Any, tmp_path: Path
) -> None:
    extra = {"embcache_target": daemon.unix_target}
    first = make(model, "ec_producer", extra, ECConnectorRole.SCHEDULER)
    moved = kit.model_config(kit.write_model(tmp_path / "elsewhere" / "copy"))
    again = make(moved, "ec_consumer", extra, ECConnectorRole.SCHEDULER)  # same checkpoint
    other = kit.model_config(Path(model.model), dtype="float16")  # same model, other dtype
    third = make(other, "ec_consumer", extra, ECConnectorRole.SCHEDULER)
    assert first.namespace == again.namespace != third.namespace
    (tmp_path / "elsewhere" / "copy" / "model.safetensors.index.json").write_text("{}")
    fourth = make(
        kit.model_config(tmp_path / "elsewhere" / "copy"),
        "ec_consumer",
        extra,
        ECConnectorRole.SCHEDULER,
    )
    assert fourth.namespace != first.namespace  # other weights
    assert first.key_for("h").startswith("vllm/llama-") and first.key_for("h").endswith("/h")
    for c in (first, again, third, fourth):
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
    req = kit.request("r-tp", [("tp1b", 3)])
    sched.ensure_cache_available(req, 0)
    sched._scheduler.lookups.wait([sched.key_for("tp1b")], 30)
    assert sched.ensure_cache_available(req, 0)
    assert sched.has_cache_item("tp1b")  # a producer skips encoding what is stored
    sched.shutdown()


def test_worker_output_without_embcache_meta(model: Any, extra: dict[str, Any]) -> None:
    sched = make(model, "ec_consumer", extra, ECConnectorRole.SCHEDULER)
    sched.update_connector_output(ECConnectorOutput())  # a step with nothing to report
    with pytest.raises(InvalidArgument, match="foreign"):
        sched.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=object()))  # type: ignore[arg-type]
    sched.shutdown()


def test_runs_against_the_vllm_version_asked_for() -> None:
    """test_vllm_versions.py runs this module against another vLLM: it must be that one."""
    import vllm

    expected = os.environ.get("EMBCACHE_VLLM_EXPECT")
    assert vllm.__version__.startswith(("0.33.", "0.34."))
    if expected:
        assert vllm.__version__ == expected


def test_a_later_chunk_of_a_scheduled_item_needs_no_lookup(
    model: Any, extra: dict[str, Any]
) -> None:
    """Once vLLM has scheduled an item for a request (encoded or loaded), the request's
    next prefill chunk, still inside that item, is not deferred to look it up again."""
    produce(model, extra, {"chunked": embeds(8, 11)})
    sched = make(model, "ec_consumer", extra, ECConnectorRole.SCHEDULER)
    req = kit.request("r-chunks", [("chunked", 8)], offset=4)
    sched.update_state_after_alloc(req, 0)  # scheduled in an earlier step
    assert sched.ensure_cache_available(req, 8)  # mid-item: nothing to wait for
    sched.request_finished(req)
    assert not sched.ensure_cache_available(kit.request("r-new", [("chunked", 8)]), 0)
    sched.shutdown()


def test_a_rank_still_staging_finishes_before_use(model: Any, extra: dict[str, Any]) -> None:
    """Tensor-parallel ranks stage at their own pace and the scheduler hears of the first:
    a rank told to use an item it is still fetching waits for it rather than miss it."""
    from embcache.integrations.vllm.metadata import StageSpec, UseSpec

    item = embeds(3, 12)
    produce(model, extra, {"tp-skew": item})
    worker = make(model, "ec_consumer", extra, ECConnectorRole.WORKER)
    key = worker.key_for("tp-skew")
    cache: dict[str, torch.Tensor] = {}
    for meta in (
        EmbCacheConnectorMetadata(stage=[StageSpec(key, "bfloat16", (3, WIDTH))]),
        EmbCacheConnectorMetadata(use=[UseSpec("tp-skew", key, ("r",))]),
    ):
        worker.bind_connector_metadata(meta)
        worker.start_load_caches(cache)  # the use comes right after the staging started
        worker.clear_connector_metadata()
    assert torch.equal(cache["tp-skew"], item)
    report = worker.build_connector_worker_meta()
    assert report.used == {"tp-skew"} and not report.use_failed
    worker.shutdown()
