"""Real vLLM objects for the connector tests: a ``VllmConfig`` over a tiny model config
written to disk, requests with multimodal features, scheduler outputs.

Also used by tests/gpu/test_integrations_gpu.py and bench/vllm_connector.py (by path).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def allow_cpu_platform_without_triton_cpu() -> None:
    """vLLM 0.34's x86 CPU platform refuses to build a config without triton-cpu; the
    connector never runs a kernel, so these tests tell it Triton is there."""
    import vllm.triton_utils as triton_utils

    triton_utils.HAS_TRITON = True


# A Llama-shaped text model: vLLM inspects its architecture while it builds the config,
# and a multimodal architecture would pull in imaging packages this CPU CI does not have.
TINY_MODEL = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 4,
    "vocab_size": 256,
    "max_position_embeddings": 2048,
    "torch_dtype": "bfloat16",
}
MODULE = "embcache.integrations.vllm.connector"


def write_model(folder: Path) -> Path:
    """A model folder vLLM can build a ``ModelConfig`` from (config only, no weights)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(TINY_MODEL))
    return folder


def model_config(folder: Path, dtype: str = "bfloat16") -> Any:
    from vllm.config import ModelConfig

    return ModelConfig(model=str(folder), skip_tokenizer_init=True, dtype=dtype)


def vllm_config(
    model: Any,
    role: str,
    extra: dict[str, Any],
    *,
    by_name: bool = False,
    rank: int = 0,
    tp: int = 1,
    prefix_caching: bool = True,
    mm_processor_cache_gb: float = 4,
    connector: str = "EmbCacheECConnector",
) -> Any:
    """A real ``VllmConfig`` carrying the EC transfer config.

    The tiny model is a text architecture; it gets a fresh ``MultiModalConfig`` here (vLLM
    refuses an encode-only instance without one, and marks it encoder-only in place).
    """
    allow_cpu_platform_without_triton_cpu()
    from vllm.config import (
        CacheConfig,
        ECTransferConfig,
        MultiModalConfig,
        ParallelConfig,
        VllmConfig,
    )

    model.multimodal_config = MultiModalConfig(mm_processor_cache_gb=mm_processor_cache_gb)

    ec = ECTransferConfig(
        ec_connector=connector,
        ec_role=role,
        ec_connector_module_path=None if by_name or connector != "EmbCacheECConnector" else MODULE,
        ec_connector_extra_config=extra,
    )
    parallel = ParallelConfig(tensor_parallel_size=tp)
    parallel.rank = rank
    return VllmConfig(
        model_config=model,
        ec_transfer_config=ec,
        parallel_config=parallel,
        cache_config=CacheConfig(enable_prefix_caching=prefix_caching),
    )


def request(
    request_id: str,
    items: list[tuple[str, int]],
    offset: int = 4,
    *,
    max_tokens: int = 1,
    cache_salt: str | None = None,
    ec_transfer_params: dict[str, Any] | None = None,
) -> Any:
    """A real ``Request`` with one image feature per (identifier, rows), placed back to back."""
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    features, pos = [], offset
    for identifier, rows in items:
        features.append(
            MultiModalFeatureSpec(
                data=None,
                modality="image",
                identifier=identifier,
                mm_position=PlaceholderRange(offset=pos, length=rows),
            )
        )
        pos += rows
    return Request(
        request_id=request_id,
        prompt_token_ids=[1] * (pos + 4),
        sampling_params=SamplingParams(
            max_tokens=max_tokens,
            extra_args={"ec_transfer_params": ec_transfer_params} if ec_transfer_params else None,
        ),
        pooling_params=None,
        mm_features=features,
        cache_salt=cache_salt,
    )


def scheduler_output(meta: Any, finished: set[str] | None = None) -> Any:
    from vllm.v1.core.sched.output import SchedulerOutput

    out = SchedulerOutput.make_empty()
    out.ec_connector_metadata = meta
    if finished:
        out.finished_req_ids = set(finished)
    return out


def scheduler_step(connector: Any, req: Any) -> Any:
    """What vLLM's scheduler does for one request in one step: ensure, look each item up,
    allocate the ones found, build the step's metadata and scheduler output."""
    if connector.ensure_cache_available(req, 0):
        for index, feature in enumerate(req.mm_features):
            if connector.has_cache_item(feature.identifier):
                connector.update_state_after_alloc(req, index)
    return scheduler_output(connector.build_connector_meta(scheduler_output(None)))


class Engine:
    """One vLLM engine's EC path, step by step, in the order of vLLM's ``Scheduler``
    (``schedule`` then ``update_from_output``) and V2 model runner (``ActiveECConnector``).

    The scheduler-side connector and a worker-side one (built by vLLM's factory) are real,
    as are requests, scheduler outputs and the connector output; what stands in for vLLM's
    scheduler is its call order, and for the model a function that reads every scheduled
    item from the encoder cache (vLLM raises ``Encoder cache miss`` where one is absent)
    and encodes the items vLLM would encode itself with ``encode``. A request that runs
    is done after ``max_tokens`` steps; its "output" is what the model read.
    """

    def __init__(self, sched: Any, worker: Any, encode: Any) -> None:
        from vllm.v1.worker.gpu.ec_connector import ActiveECConnector

        self.sched = sched
        self.worker = worker
        self.encode = encode
        self.cache: dict[str, Any] = {}  # the worker's encoder cache
        self.active = ActiveECConnector.__new__(ActiveECConnector)
        self.active.encoder_cache = self.cache
        self.active.ec_connector = worker
        self.active.save_new_caches = worker.is_producer
        self.cached: set[str] = set()  # what the scheduler's encoder-cache manager holds
        self.waiting: list[Any] = []
        self.read: dict[str, dict[str, Any]] = {}  # request -> identifier -> embeddings
        self.done: dict[str, str] = {}  # request -> "ok" or "error"
        self.encoded: list[str] = []
        self.steps = 0

    def add(self, req: Any) -> None:
        self.waiting.append(req)

    def step(self, before_worker: Any = None) -> None:
        """One schedule, execute, update_from_output; ``before_worker(scheduler_output)``
        runs between the scheduler's step and the worker's (a fault to inject there)."""
        from vllm.v1.outputs import ECConnectorOutput

        self.steps += 1
        sched, scheduled, encode_now = self.sched, [], []
        for req in list(self.waiting):
            if req.mm_features and not sched.ensure_cache_available(req, 0):
                continue  # deferred to a later step
            for index, feature in enumerate(req.mm_features):
                if feature.identifier in self.cached:
                    continue
                if not sched.has_cache_item(feature.identifier):
                    encode_now.append(feature.identifier)
                self.cached.add(feature.identifier)
                sched.update_state_after_alloc(req, index)
            scheduled.append(req)
        out = scheduler_output(sched.build_connector_meta(scheduler_output(None)))
        if before_worker is not None:
            before_worker(out)
        with self.active.maybe_get_output(out) as output:
            for identifier in encode_now:  # the model runner's encoder
                self.cache[identifier] = self.encode(identifier)
                self.encoded.append(identifier)
            for req in scheduled:  # gather_mm_embeddings
                read = self.read.setdefault(req.request_id, {})
                for feature in req.mm_features:
                    if feature.identifier not in self.cache:
                        raise RuntimeError(f"Encoder cache miss for {feature.identifier}.")
                    read[feature.identifier] = self.cache[feature.identifier].clone()
        output = output if output is not None else ECConnectorOutput()
        # Scheduler.update_from_output: tokens first, then failed requests, then the
        # connector's output.
        for req in scheduled:
            self.waiting.remove(req)
            self.done[req.request_id] = "ok"  # max_tokens=1: its token is out now
            sched.request_finished(req)
        for rid in sched.take_unavailable_requests():
            self.done[rid] = "error" if rid not in self.done else self.done[rid] + "+error"
        sched.update_connector_output(output)
        wait = getattr(self.worker, "wait_for_stagings", None)
        if wait is not None:  # background stagings land before the next step here
            wait(30)

    def run(self, limit_s: float = 60, pause_s: float = 0.005) -> None:
        """Step until no request waits (a real engine keeps stepping while any does),
        pausing a little between steps as a busy engine's forward passes would."""
        import time

        end = time.monotonic() + limit_s
        while self.waiting and time.monotonic() < end:
            self.step()
            if self.waiting and pause_s:
                time.sleep(pause_s)
