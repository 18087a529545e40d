"""The connector's settings: ``ec_connector_extra_config`` checked, and the key namespace.

Settings are read once, when vLLM builds the connector, so a typo or a bad value stops the
engine at start-up with the field's name instead of surfacing as misses in production.
Nothing here imports vLLM: the config object is read through its attributes, which keeps
this module importable (and its checks testable) without the engine.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, fields
from typing import Any

from embcache.errors import InvalidArgument
from embcache.integrations.keys import check_namespace, derive_namespace

ENGINE = "vllm"


@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    """What ``ec_connector_extra_config`` may hold (docs/integrations.md lists each field)."""

    embcache_target: str
    embcache_token: str | None = None
    embcache_timeout_s: float = 30.0
    namespace: str | None = None
    save_ranks: str = "first"
    allow_request_local_ids: bool = False
    scheduler_pin: bool = True
    pin_ttl_s: float = 60.0
    prefetch: bool = True
    max_pending_saves: int = 1024
    lookup_timeout_s: float = 2.0
    lookup_wait_ms: float = 5.0
    defer_limit_s: float = 5.0
    announced_wait_s: float = 5.0
    breaker_failures: int = 3
    breaker_cooldown_s: float = 10.0
    salt_keys: bool = True

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> ConnectorSettings:
        """Check and convert the extra config.

        Args:
            extra: ``ec_transfer_config.ec_connector_extra_config``.

        Returns:
            The settings; ``embcache_token`` falls back to the ``EMBCACHE_TOKEN`` variable.

        Raises:
            InvalidArgument: a missing target, an unknown field, or a value of the wrong
                type or range.
        """
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise InvalidArgument(
                "unknown field(s) in ec_connector_extra_config",
                unknown=unknown,
                known=sorted(known),
            )
        target = extra.get("embcache_target")
        if not isinstance(target, str) or not target:
            raise InvalidArgument(
                "ec_connector_extra_config needs embcache_target (unix:/path or host:port)"
            )
        if extra.get("embcache_token") is None and os.environ.get("EMBCACHE_TOKEN"):
            extra["embcache_token"] = os.environ["EMBCACHE_TOKEN"]
        settings = cls(**extra)
        settings._check()
        return settings

    def _check(self) -> None:
        if self.embcache_token is not None and not isinstance(self.embcache_token, str):
            raise InvalidArgument("embcache_token must be a string")
        for name in (
            "embcache_timeout_s",
            "pin_ttl_s",
            "lookup_timeout_s",
            "defer_limit_s",
            "breaker_cooldown_s",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise InvalidArgument(f"{name} must be a positive number", value=value)
        if self.save_ranks not in ("first", "all"):
            raise InvalidArgument("save_ranks must be 'first' or 'all'", value=self.save_ranks)
        for name in ("lookup_wait_ms", "announced_wait_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise InvalidArgument(f"{name} must be a number >= 0", value=value)
        failures = self.breaker_failures
        if isinstance(failures, bool) or not isinstance(failures, int) or failures < 1:
            raise InvalidArgument("breaker_failures must be a positive integer", value=failures)
        for name in ("allow_request_local_ids", "scheduler_pin", "prefetch", "salt_keys"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidArgument(f"{name} must be true or false", value=getattr(self, name))
        pending = self.max_pending_saves
        if isinstance(pending, bool) or not isinstance(pending, int) or pending < 1:
            raise InvalidArgument("max_pending_saves must be a positive integer", value=pending)
        if self.namespace is not None:
            check_namespace(self.namespace)


def namespace_for(vllm_config: Any, settings: ConnectorSettings) -> str:
    """The key namespace: the override, else derived from what makes the embeddings.

    The digest covers the model's configuration (without the local path it was loaded
    from), the identity of its weights (``weights_identity``), the dtype and the
    multimodal processor options, so two instances that load one checkpoint from
    different paths agree, and a different checkpoint or dtype cannot read their entries.
    """
    if settings.namespace is not None:
        return settings.namespace
    model = vllm_config.model_config
    hf_config = getattr(model, "hf_config", None)
    as_dict = hf_config.to_dict() if hf_config is not None else {}
    readable = as_dict.get("model_type") or (as_dict.get("architectures") or ["model"])[0]
    parts = {
        "model": str(readable),
        "config": config_digest(as_dict),
        "weights": weights_identity(model),
        "dtype": str(getattr(model, "dtype", None)),
        "processor": processor_options(model),
    }
    return derive_namespace(parts)


# Keys of a Hugging Face config that name where or with what it was loaded, not the model.
_LOCAL_CONFIG_KEYS = ("_name_or_path", "name_or_path", "_commit_hash", "transformers_version")


def config_digest(as_dict: dict[str, Any]) -> str:
    """A digest of a Hugging Face config without its local or tool-version fields."""
    kept = {k: v for k, v in as_dict.items() if k not in _LOCAL_CONFIG_KEYS}
    blob = json.dumps(kept, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def processor_options(model_config: Any) -> str:
    """The multimodal processor options (they change what the encoder sees); options that
    do not change the embeddings (cache sizes) are not among them."""
    mm_config = getattr(model_config, "multimodal_config", None)
    kwargs = getattr(mm_config, "mm_processor_kwargs", None) if mm_config is not None else None
    return json.dumps(kwargs, sort_keys=True, default=str)


def weights_identity(model_config: Any) -> str:
    """What identifies the weights, independent of the path they were loaded from.

    A local folder: the digest of its weights index (``*.index.json``), else of its weight
    files' names and sizes. A hub model: its id and the resolved commit (or the revision
    asked for).
    """
    path = str(getattr(model_config, "model", "") or "")
    if path and os.path.isdir(path):
        names = sorted(os.listdir(path))
        index = [n for n in names if n.endswith(".index.json")]
        digest = hashlib.sha256()
        if index:
            for name in index:
                with open(os.path.join(path, name), "rb") as f:
                    digest.update(f.read())
        else:
            for name in names:
                if name.endswith((".safetensors", ".bin", ".pt", ".gguf")):
                    size = os.path.getsize(os.path.join(path, name))
                    digest.update(f"{name}:{size}\n".encode())
        return "local:" + digest.hexdigest()[:16]
    hf_config = getattr(model_config, "hf_config", None)
    commit = getattr(hf_config, "_commit_hash", None) if hf_config is not None else None
    return f"hub:{path}@{commit or getattr(model_config, 'revision', None)}"


def check_identifiers_are_content_hashes(vllm_config: Any, settings: ConnectorSettings) -> None:
    """Refuse a configuration whose multimodal identifiers are request-local.

    With the processor cache off (``mm_processor_cache_gb == 0``) and prefix caching off,
    vLLM names each item ``<request>-<modality>-<index>`` instead of hashing its content:
    such a key never matches another request's, so every lookup would miss (or, with ids
    reused across restarts, hit another request's embeddings).

    Raises:
        InvalidArgument: such a configuration, unless ``allow_request_local_ids`` is set
            (for deployments that pass their own ``multi_modal_uuids``).
    """
    mm_config = getattr(vllm_config.model_config, "multimodal_config", None)
    if mm_config is None or settings.allow_request_local_ids:
        return
    prefix_caching = bool(getattr(vllm_config.cache_config, "enable_prefix_caching", False))
    if getattr(mm_config, "mm_processor_cache_gb", None) == 0 and not prefix_caching:
        raise InvalidArgument(
            "with mm_processor_cache_gb=0 and prefix caching off, vLLM's multimodal "
            "identifiers are request-local, not content hashes: embcache entries would never "
            "be found again. Enable prefix caching or the processor cache, or set "
            "allow_request_local_ids=true if every request carries multi_modal_uuids"
        )
