"""``EmbCacheECConnector``: embcache as vLLM's encoder-cache (EC) connector.

Encoder instances (``ec_producer``) put each item's embeddings into the node's embcache
daemon; prefill/decode instances (``ec_consumer``) find them there and load them into
their encoder cache instead of running the encoder. vLLM builds one instance per role:
the scheduler's (lookups, pins, the step's loads: ``scheduler_side.py``) and one per
worker (saves: ``saver.py``; loads: ``loader.py``). Load it with
``--ec-transfer-config '{"ec_connector": "EmbCacheECConnector",
"ec_connector_module_path": "embcache.integrations.vllm.connector", ...}'``
(docs/integrations.md).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
)

from embcache.clients import EmbCacheClient
from embcache.errors import InvalidArgument
from embcache.integrations.keys import entry_key, scoped
from embcache.integrations.vllm.loader import Loader
from embcache.integrations.vllm.lookups import Breaker, Lookups
from embcache.integrations.vllm.metadata import EmbCacheConnectorMetadata, EmbCacheWorkerMetadata
from embcache.integrations.vllm.saver import Saver
from embcache.integrations.vllm.scheduler_side import SchedulerSide
from embcache.integrations.vllm.settings import (
    ENGINE,
    ConnectorSettings,
    check_identifiers_are_content_hashes,
    namespace_for,
)
from embcache.integrations.vllm.stats import EmbCacheECStats, EmbCachePromMetrics

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ECConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("embcache.integrations.vllm")


class EmbCacheECConnector(ECConnectorBase):
    """vLLM EC connector backed by an embcache daemon (module docstring)."""

    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        """Check the settings and prepare this role's half; connects on first use.

        Raises:
            InvalidArgument: a bad ``ec_connector_extra_config``, or request-local
                multimodal identifiers (see ``settings.check_identifiers_are_content_hashes``).
            ValueError: no ``ec_transfer_config`` (from vLLM's base class).
        """
        super().__init__(vllm_config=vllm_config, role=role)
        assert vllm_config.ec_transfer_config is not None
        self.settings = ConnectorSettings.from_extra_config(
            vllm_config.ec_transfer_config.ec_connector_extra_config
        )
        check_identifiers_are_content_hashes(vllm_config, self.settings)
        self.namespace = namespace_for(vllm_config, self.settings)
        model = vllm_config.model_config
        self._dtype = str(model.dtype).removeprefix("torch.")
        self._scheduler: SchedulerSide | None = None
        self._saver: Saver | None = None
        self._loader: Loader | None = None
        self._worker_counts: dict[str, int] = {}
        if role == ECConnectorRole.SCHEDULER:
            s = self.settings
            lookups = Lookups(
                self._lookup_client,
                pin=s.scheduler_pin and self.is_consumer,
                prefetch=s.prefetch and not s.scheduler_pin,
                ttl_s=s.pin_ttl_s,
                deadline_s=s.lookup_timeout_s,
                breaker=Breaker(s.breaker_failures, s.breaker_cooldown_s, time.monotonic),
            )
            self._scheduler = SchedulerSide(
                s,
                self.namespace,
                self._dtype,
                is_consumer=self.is_consumer,
                is_producer=self.is_producer,
                lookups=lookups,
            )
        else:
            if self.is_producer and self._saves_on_this_rank(vllm_config):
                self._saver = Saver(self._connect, self.settings.max_pending_saves)
            if self.is_consumer:
                self._loader = Loader(self._connect, self.settings.embcache_timeout_s)
        log.info(
            "embcache EC connector: role=%s producer=%s consumer=%s namespace=%s target=%s",
            role.name,
            self.is_producer,
            self.is_consumer,
            self.namespace,
            self.settings.embcache_target,
        )

    def _connect(self) -> EmbCacheClient:
        return EmbCacheClient(
            self.settings.embcache_target,
            token=self.settings.embcache_token,
            timeout=self.settings.embcache_timeout_s,
            client_name=f"vllm-ec-{self.role.name.lower()}",
        )

    def _lookup_client(self) -> EmbCacheClient:
        """The scheduler's client: its calls have the short lookup deadline."""
        return EmbCacheClient(
            self.settings.embcache_target,
            token=self.settings.embcache_token,
            timeout=self.settings.lookup_timeout_s,
            client_name="vllm-ec-scheduler",
        )

    def _saves_on_this_rank(self, vllm_config: VllmConfig) -> bool:
        """Tensor-parallel ranks hold the same encoder output: rank 0 saves it (by default)."""
        if self.settings.save_ranks == "all":
            return True
        return _tp_rank(vllm_config) == 0

    def key_for(self, identifier: str, scope: str | None = None) -> str:
        """The embcache key of a vLLM multimodal identifier (in a cache-salt scope)."""
        return entry_key(ENGINE, self.namespace, scoped(identifier, scope))

    # -- worker side -----------------------------------------------------------------
    def save_caches(
        self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any
    ) -> None:
        """Queue ``encoder_cache[mm_hash]`` for this step's background put (never waits).

        Raises:
            KeyError: ``mm_hash`` is not in ``encoder_cache``.
            TypeError: its value is not a tensor.
        """
        if self._saver is None:
            return
        tensor = encoder_cache[mm_hash]
        scopes = self._bound_meta().save_scopes.get(mm_hash) or ("",)
        for scope in scopes:  # once per cache salt of the requests that needed it
            try:
                key = self.key_for(mm_hash, scope or None)
            except InvalidArgument as exc:  # an identifier no key can hold: not saved
                log.warning("embcache: not saving %r: %s", mm_hash[:80], exc)
                self._add_counts({"save_failures": 1})
                continue
            self._saver.add(key, tensor)

    def _bound_meta(self) -> EmbCacheConnectorMetadata:
        meta = self._connector_metadata
        if meta is None:
            return EmbCacheConnectorMetadata()
        if not isinstance(meta, EmbCacheConnectorMetadata):
            raise InvalidArgument(
                "embcache connector got foreign metadata", type=type(meta).__name__
            )
        return meta

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        """Move the step's staged items into ``encoder_cache`` (cannot fail: they are
        here already) and start staging the items of later steps in the background."""
        if self._loader is None:
            return
        meta = self._bound_meta()
        if meta.stage or meta.use or meta.drop:
            self._loader.step(meta.stage, meta.use, meta.drop, encoder_cache, _worker_device())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Hand this step's saves to the background thread; loads finish synchronously,
        saves never hold a request, so both sets are empty."""
        if self._saver is not None:
            self._saver.flush()
        return None, None

    def build_connector_worker_meta(self) -> EmbCacheWorkerMetadata | None:
        """What loaded and failed this step, and the counts since the last report."""
        if self._saver is not None:
            self._saver.flush()
            self._add_counts(self._saver.take_counts())
        meta = EmbCacheWorkerMetadata()
        if self._loader is not None:
            report = self._loader.take_report()
            self._add_counts(report.counts)
            meta.staged, meta.failed = report.staged, report.failed
            meta.used, meta.use_failed = report.used, report.use_failed
        if not (meta.staged or meta.failed or meta.used or meta.use_failed or self._worker_counts):
            return None
        meta.stats, self._worker_counts = self._worker_counts, {}
        return meta

    def wait_for_stagings(self, timeout: float | None = None) -> bool:
        """Block until the stagings started so far are done (tests); False on timeout."""
        return self._loader is None or self._loader.wait_idle(30.0 if timeout is None else timeout)

    def wait_for_saves(self, timeout: float | None = None) -> bool:
        """Block until the queued saves are stored (tests, shutdown); False on timeout."""
        if self._saver is None:
            return True
        self._saver.flush()
        return self._saver.wait(timeout)

    def _add_counts(self, counts: dict[str, int]) -> None:
        for name, n in counts.items():
            self._worker_counts[name] = self._worker_counts.get(name, 0) + n

    # -- scheduler side --------------------------------------------------------------
    def _sched(self) -> SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError("scheduler-side call on a worker-side embcache connector")
        return self._scheduler

    def has_cache_item(self, identifier: str) -> bool:
        """Whether the item comes from embcache this step: already staged on the workers
        (a consumer), or stored (a producer, which then does not encode it)."""
        return self._sched().has(identifier)

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        """Look the request's pending items up (in the background) and stage the ones
        found; False defers the request while that is under way (scheduler_side.py)."""
        return self._sched().ensure(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        """Item ``index`` is scheduled: use its staged copy, or save it under the
        request's key scope (a producer)."""
        self._sched().after_alloc(request, index)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        """This step's stagings, uses and drops (picklable); starts the next step."""
        return self._sched().build_meta()

    def update_connector_output(self, connector_output: ECConnectorOutput) -> None:
        """Staged items become hits, failed stagings misses."""
        meta = connector_output.ec_connector_worker_meta
        if meta is not None and not isinstance(meta, EmbCacheWorkerMetadata):
            raise InvalidArgument("embcache connector got foreign worker metadata")
        self._sched().on_worker_meta(meta)

    def take_unavailable_requests(self) -> set[str]:
        """Requests to fail: none, as an item is scheduled only once a worker holds it."""
        return self._sched().take_unavailable() if self._scheduler is not None else set()

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request's items; a producer returns ``ec_transfer_params`` that
        announce its items (and its namespace) to the consumer."""
        if self._scheduler is None:
            return False, None
        return False, self._scheduler.request_finished(request)

    def get_ec_connector_stats(self) -> EmbCacheECStats | None:
        """Counts since the last call: the scheduler's lookups plus its workers' loads
        and saves (which arrive in the worker metadata)."""
        if self._scheduler is None:
            return None
        counts = self._scheduler.take_stats()
        return EmbCacheECStats(data=counts) if any(counts.values()) else None

    @classmethod
    def build_ec_connector_stats(cls, data: dict[str, Any] | None = None) -> EmbCacheECStats:
        """Stats from their serialised ``data`` (vLLM's logger process)."""
        return EmbCacheECStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> EmbCachePromMetrics:
        """Prometheus counters ``vllm:embcache_<name>`` (hits, misses, loads, saves, ...)."""
        return EmbCachePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        """Store what is queued, release the pins, close the clients."""
        if self._saver is not None:
            self._saver.close()
        if self._loader is not None:
            self._loader.close()
        if self._scheduler is not None:
            self._scheduler.close()


def _tp_rank(vllm_config: Any) -> int:
    """This worker's tensor-parallel rank: vLLM's group where it is initialised, else the
    global rank modulo the tensor-parallel size."""
    try:
        from vllm.distributed.parallel_state import (
            get_tensor_model_parallel_rank,
            model_parallel_is_initialized,
        )

        if model_parallel_is_initialized():
            return int(get_tensor_model_parallel_rank())
    except ImportError:  # pragma: no cover - older layouts
        pass
    parallel = vllm_config.parallel_config
    return int(parallel.rank) % max(int(parallel.tensor_parallel_size), 1)


def _worker_device() -> torch.device:
    """The worker's device: its current CUDA device, the CPU where there is none."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
