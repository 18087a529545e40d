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


def request(request_id: str, items: list[tuple[str, int]], offset: int = 4) -> Any:
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
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        mm_features=features,
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
    assert connector.ensure_cache_available(req, 0) is True
    for index, feature in enumerate(req.mm_features):
        if connector.has_cache_item(feature.identifier):
            connector.update_state_after_alloc(req, index)
    return scheduler_output(connector.build_connector_meta(scheduler_output(None)))
