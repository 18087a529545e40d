"""The scheduler half of the connector: which items come from embcache, and when.

vLLM turns a ``has_cache_item`` yes into an item its model reads in that very step, and it
learns of a worker's failure only after that step's tokens are out (it calls
``take_unavailable_requests`` before ``update_connector_output``). So an item is said to
be in the cache only once a worker already holds it: each item goes

    looking -> (miss: vLLM encodes it) | staging -> staged -> used

``ensure_cache_available`` looks the items up through ``lookups.Lookups``: inline from the
daemon's read table on its node (dtype and shape, no call, nothing held), else with a call
off the scheduler loop (a pin: a lease, dtype and shape), and defers the request
while an answer or a staging is outstanding, up to ``defer_limit_s``; then the item is
encoded instead. A found entry is staged: the step's metadata tells the workers to load it
apart from vLLM's encoder cache; the worker reports it staged (or failed: the item is
simply encoded) and only then does ``has_cache_item`` say yes, and the step that schedules
it moves the staged tensor into the encoder cache, which cannot fail. A failed load never
reaches the model or any cache.

A request whose producer announced an item in ``ec_transfer_params`` and whose lookup
misses waits for the save to land (up to ``announced_wait_s``) instead of encoding.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from embcache.integrations.keys import entry_key, salt_scope, scoped
from embcache.integrations.vllm.lookups import Answer, Lookups
from embcache.integrations.vllm.metadata import (
    EmbCacheConnectorMetadata,
    EmbCacheWorkerMetadata,
    StageSpec,
    UseSpec,
    add_counts,
)
from embcache.integrations.vllm.settings import ENGINE, ConnectorSettings

log = logging.getLogger("embcache.integrations.vllm")

LOOKING, STAGE, STAGING, STAGED, USED, MISS, HIT = (
    "looking",
    "stage",
    "staging",
    "staged",
    "used",
    "miss",
    "hit",
)
# The ec_transfer_params field that carries a producer's namespace per item.
PARAM_NAMESPACE = "embcache_namespace"


@dataclass
class _Item:
    """One entry the scheduler is finding, staging or using (by its embcache key)."""

    identifier: str
    key: str
    rows: int
    since: float  # first asked
    state: str = LOOKING
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    lease_id: int = 0
    pinned_at: float = 0.0
    touched: float = 0.0
    requests: set[str] = field(default_factory=set)


class SchedulerSide:
    """Lookups, stagings and uses of one scheduler, and the requests to fail."""

    def __init__(
        self,
        settings: ConnectorSettings,
        namespace: str,
        dtype: str,
        *,
        is_consumer: bool,
        is_producer: bool,
        lookups: Lookups,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.namespace = namespace
        self.dtype = dtype
        self.is_consumer = is_consumer
        self.is_producer = is_producer
        self.lookups = lookups
        self._clock = clock
        self._items: dict[str, _Item] = {}
        self._current: tuple[str, dict[str, str]] | None = None  # (request, identifier->key)
        self._use: dict[str, UseSpec] = {}
        self._drop: set[str] = set()
        self._save_scopes: dict[str, set[str]] = {}
        self._unavailable: set[str] = set()
        # request -> identifiers already scheduled for it (in vLLM's encoder cache from then
        # on: a later chunk of the same request needs no lookup)
        self._scheduled: dict[str, set[str]] = {}
        self._wait_left = settings.lookup_wait_ms / 1000
        self._warned_namespaces: set[str] = set()
        self._step_started = clock()
        self.stats: dict[str, int] = {}

    def key(self, identifier: str, scope: str | None = None) -> str:
        """The embcache key of a vLLM identifier in a key scope."""
        return entry_key(ENGINE, self.namespace, scoped(identifier, scope))

    def scope_of(self, request: Any) -> str | None:
        """The key scope of a request (its cache salt), where keys are salted."""
        if not self.settings.salt_keys:
            return None
        return salt_scope(getattr(request, "cache_salt", None))

    # -- ensure_cache_available ------------------------------------------------------
    def ensure(self, request: Any, num_computed_tokens: int) -> bool:
        """Whether the request's pending items are settled (found and staged, or to be
        encoded); False defers the request to the next step."""
        now = self._clock()
        scope = self.scope_of(request)
        announced = self._announced(request)
        keys: dict[str, str] = {}
        wanted: list[_Item] = []
        scheduled = self._scheduled.get(request.request_id, ())
        for index, feature in enumerate(request.mm_features):
            position = feature.mm_position
            if position.offset + position.length <= num_computed_tokens:
                continue
            if feature.identifier in scheduled:
                continue
            key = self.key(feature.identifier, scope)
            keys[feature.identifier] = key
            item = self._items.get(key)
            if item is None:
                rows = int(request.get_num_encoder_embeds(index))
                item = self._items[key] = _Item(feature.identifier, key, rows, now)
            item.touched = now
            item.requests.add(request.request_id)
            wanted.append(item)
        self._current = (request.request_id, keys)
        looking = [i.key for i in wanted if i.state == LOOKING]
        if looking:
            self.lookups.ask(looking)
            if any(self.lookups.answer(k) is None for k in looking) and self._wait_left > 0:
                started = self._clock()
                self.lookups.wait(looking, self._wait_left)
                self._wait_left -= self._clock() - started
        settled = True
        for item in wanted:
            if item.state == LOOKING:
                answer = self.lookups.answer(item.key)
                if answer is not None:
                    self._settle(item, answer, announced.get(item.identifier), now)
            if item.state in (LOOKING, STAGE, STAGING):
                if now - item.since > self.settings.defer_limit_s:
                    log.warning(
                        "embcache: %s still %s after %.1f s: encoding it instead",
                        item.identifier,
                        item.state,
                        now - item.since,
                    )
                    self._count("gave_up")
                    self._to_miss(item)
                else:
                    settled = False
        if not settled:
            self._count("deferred")
        return settled

    def _announced(self, request: Any) -> dict[str, str]:
        """identifier -> namespace, for the items the request's producer announced."""
        params = getattr(request, "ec_transfer_params", None)
        if not isinstance(params, dict):
            return {}
        out = {}
        for identifier, entry in params.items():
            if isinstance(entry, dict) and isinstance(entry.get(PARAM_NAMESPACE), str):
                out[str(identifier)] = entry[PARAM_NAMESPACE]
        return out

    def _settle(self, item: _Item, answer: Answer, announced_ns: str | None, now: float) -> None:
        """Move a looked-up item on: staged next, a hit, a miss, or another look."""
        if not answer.found:
            if announced_ns is not None and announced_ns != self.namespace:
                self._count("namespace_mismatches")
                if announced_ns not in self._warned_namespaces:
                    self._warned_namespaces.add(announced_ns)
                    log.warning(
                        "embcache: the producer saved under namespace %r, this instance "
                        "reads %r: every such item misses (set the same 'namespace', or "
                        "load the same weights and config on both)",
                        announced_ns,
                        self.namespace,
                    )
            elif (
                announced_ns is not None
                and not answer.error
                and now - item.since < self.settings.announced_wait_s
            ):
                self.lookups.forget(item.key)  # the save is on its way: look again
                self.lookups.ask([item.key])
                return
            self._count("misses")  # a failed call also counts in lookup_errors
            self._to_miss(item)
            return
        if answer.shape is not None and not self._usable(answer.dtype, answer.shape, item.rows):
            log.info(
                "embcache entry %s is %s %s, want %s x %s rows: a miss",
                item.identifier,
                answer.dtype,
                answer.shape,
                self.dtype,
                item.rows,
            )
            self.lookups.release([answer.lease_id])
            self._count("mismatches")
            self._count("misses")
            self._to_miss(item)
            return
        self._count("hits")
        if not self.is_consumer:  # a producer only skips encoding what is stored
            self.lookups.release([answer.lease_id])
            item.state = HIT
            return
        item.dtype, item.shape = answer.dtype or self.dtype, answer.shape
        item.lease_id = answer.lease_id
        item.pinned_at = now
        item.state = STAGE

    def _usable(self, dtype: str | None, shape: tuple[int, ...], rows: int) -> bool:
        return dtype == self.dtype and len(shape) == 2 and shape[0] == rows

    def _to_miss(self, item: _Item) -> None:
        if item.state in (STAGING, STAGED):
            self._drop.add(item.key)
        self.lookups.release([item.lease_id])
        item.lease_id = 0
        item.state = MISS

    # -- has_cache_item / update_state_after_alloc -----------------------------------
    def _item_for(self, identifier: str) -> _Item | None:
        """The item of the request vLLM is scheduling (it asks ``ensure`` first)."""
        if self._current is None:
            return None
        key = self._current[1].get(identifier)
        return None if key is None else self._items.get(key)

    def has(self, identifier: str) -> bool:
        """Whether ``identifier`` comes from embcache this step: staged on the workers
        (a consumer), or stored (a producer, which then skips encoding it)."""
        item = self._item_for(identifier)
        if item is None:
            return False
        return item.state == (STAGED if self.is_consumer else HIT)

    def after_alloc(self, request: Any, index: int) -> None:
        """Item ``index`` is scheduled: a staged one is used; one to encode on a producer
        is saved under the request's key scope."""
        identifier = request.mm_features[index].identifier
        self._scheduled.setdefault(request.request_id, set()).add(identifier)
        scope = self.scope_of(request)
        item = self._items.get(self.key(identifier, scope))
        if self.is_consumer and item is not None and item.state in (STAGED, USED):
            use = self._use.get(item.key)
            ids = {request.request_id, *(use.request_ids if use else ())}
            self._use[item.key] = UseSpec(identifier, item.key, tuple(sorted(ids)))
            item.state = USED
            return
        if not self.is_producer or (item is not None and item.state == HIT):
            return
        self._save_scopes.setdefault(identifier, set()).add(scope or "")

    # -- build_connector_meta --------------------------------------------------------
    def build_meta(self) -> EmbCacheConnectorMetadata:
        """This step's stagings, uses, drops and save scopes; starts the next step."""
        now = self._clock()
        stage = []
        for item in self._items.values():
            if item.state == STAGE:
                assert item.dtype is not None
                shape = item.shape if item.shape is not None else (item.rows, -1)
                stage.append(StageSpec(item.key, item.dtype, shape))
                item.state = STAGING
        for key, item in list(self._items.items()):
            if item.state in (MISS, HIT) and item.touched < self._step_started:
                # An answer holds while requests that asked this step wait: ask again later.
                self.lookups.forget(key)
                del self._items[key]
            elif item.state == USED and key in self._use:
                self.lookups.forget(key)
                del self._items[key]  # the worker moves it into vLLM's cache this step
            elif item.state in (STAGED, STAGE, STAGING) and (
                now - item.touched > self.settings.defer_limit_s
            ):
                self._drop.add(key)  # no request has asked for it lately
                self.lookups.release([item.lease_id])
                self.lookups.forget(key)
                del self._items[key]
        meta = EmbCacheConnectorMetadata(
            stage=stage,
            use=list(self._use.values()),
            drop=sorted(self._drop),
            save_scopes={i: tuple(sorted(s)) for i, s in self._save_scopes.items()},
        )
        self._use, self._drop, self._save_scopes = {}, set(), {}
        self._current = None
        self._step_started = now
        self._wait_left = self.settings.lookup_wait_ms / 1000
        self._renew(now)
        return meta

    def _renew(self, now: float) -> None:
        stale = [
            i
            for i in self._items.values()
            if i.lease_id and now - i.pinned_at > self.settings.pin_ttl_s / 2
        ]
        if stale:
            self.lookups.renew([i.lease_id for i in stale])
            for i in stale:
                i.pinned_at = now

    # -- update_connector_output -----------------------------------------------------
    def on_worker_meta(self, meta: EmbCacheWorkerMetadata | None) -> None:
        """Staged items become hits; failed stagings become misses (encoded instead)."""
        if meta is None:
            return
        self.stats = add_counts(self.stats, meta.stats)
        for key in meta.staged:
            item = self._items.get(key)
            if item is None or item.state != STAGING:
                self._drop.add(key)  # nobody waits for it any more
                continue
            item.state = STAGED
            self.lookups.release([item.lease_id])  # the worker holds the bytes now
            item.lease_id = 0
        for key, reason in meta.failed.items():
            self._drop.add(key)  # ranks that did stage it let it go
            item = self._items.get(key)
            if item is not None and item.state in (STAGING, STAGED):
                log.warning("embcache staging of %s failed (%s): encoding it", key, reason)
                self._to_miss(item)
        for identifier, reason in meta.use_failed.items():
            log.error("embcache: %s was not staged on a worker (%s)", identifier, reason)
            self._count("load_failures")

    def take_unavailable(self) -> set[str]:
        """Requests to fail (none: an item is only scheduled once a worker holds it)."""
        taken, self._unavailable = self._unavailable, set()
        return taken

    def request_finished(self, request: Any) -> dict[str, Any] | None:
        """Forget the request; a producer announces what it saves (``ec_transfer_params``)."""
        rid = request.request_id
        self._scheduled.pop(rid, None)
        for key, item in list(self._items.items()):
            item.requests.discard(rid)
            if not item.requests and item.state not in (USED,):
                if item.state in (STAGING, STAGED):
                    self._drop.add(key)
                self.lookups.release([item.lease_id])
                self.lookups.forget(key)
                del self._items[key]
        features = getattr(request, "mm_features", None) or []
        if self.is_consumer or not features:
            return None
        params: dict[str, Any] = {}
        for index, feature in enumerate(features):
            entry = params.setdefault(
                feature.identifier,
                {"modality": feature.modality, "item_indices": [], PARAM_NAMESPACE: self.namespace},
            )
            entry["item_indices"].append(index)
        return params

    def take_stats(self) -> dict[str, int]:
        """The counts since the last call (this half's, its lookups' and its workers')."""
        taken, self.stats = add_counts(self.stats, self.lookups.take_counts()), {}
        return {k: v for k, v in taken.items() if v}

    def close(self) -> None:
        """Release every pin (in the background, bounded) and stop the lookups."""
        self.lookups.release([i.lease_id for i in self._items.values()])
        self._items.clear()
        self.lookups.close()

    def _count(self, name: str, n: int = 1) -> None:
        self.stats[name] = self.stats.get(name, 0) + n
