"""The scheduler half of the connector: which items to load, and the pins that keep them.

vLLM asks ``has_cache_item`` once per item while it schedules, and calls
``ensure_cache_available`` for each request first. The first call for a request looks all
its not-yet-computed items up in one batched call and remembers the answers for the step.

With ``scheduler_pin`` (the default) the lookup is a host ``get``: one call that answers
whether each entry exists, gives its dtype and shape (so rows, width and dtype are checked
here, and a mismatch is a plain miss that vLLM encodes itself), and takes a lease that
keeps the entry from being evicted until the worker has loaded it. The scheduler process
only maps the daemon's shared memory; it never touches CUDA. Without the pin the lookup is
``exists``; the worker then checks what it loads, and a load that fails there fails its
requests through ``take_unavailable_requests`` (vLLM 0.33 fails them with a retryable error;
the client's retry encodes again).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from embcache.clients import EmbCacheClient, LeasedTensors
from embcache.errors import EmbCacheError
from embcache.integrations.keys import entry_key
from embcache.integrations.vllm.metadata import (
    EmbCacheConnectorMetadata,
    EmbCacheWorkerMetadata,
    LoadSpec,
    add_counts,
)
from embcache.integrations.vllm.settings import ENGINE, ConnectorSettings

log = logging.getLogger("embcache.integrations.vllm")


@dataclass
class _Pin:
    """A lease on one entry, held from the lookup until the worker has loaded it."""

    leased: LeasedTensors
    dtype: str
    shape: tuple[int, ...]
    taken_at: float
    requests: set[str] = field(default_factory=set)


@dataclass
class _Pending:
    """An item scheduled for a load this step."""

    key: str
    rows: int
    shape: tuple[int, ...] | None
    requests: set[str]
    available: bool = True


class SchedulerSide:
    """Lookups, pins, this step's loads, and the requests whose loads failed."""

    def __init__(
        self,
        settings: ConnectorSettings,
        namespace: str,
        dtype: str,
        width: int,
        *,
        is_consumer: bool,
        connect: Callable[[], EmbCacheClient],
    ) -> None:
        self.settings = settings
        self.namespace = namespace
        self.dtype = dtype
        self.width = width  # the model's embedding width, for placeholders only
        self.is_consumer = is_consumer
        self._connect = connect
        self._client: EmbCacheClient | None = None
        self._pins: dict[str, _Pin] = {}
        self._found: dict[str, bool] = {}  # this step's answers (pins outlive the step)
        self._pending: dict[str, _Pending] = {}
        self._loading: dict[str, set[str]] = {}  # identifier -> requests, until reported
        self._unavailable: set[str] = set()
        self.stats: dict[str, int] = {}

    @property
    def client(self) -> EmbCacheClient:
        """The scheduler's own client, opened on first use (in the scheduler process)."""
        if self._client is None:
            self._client = self._connect()
        return self._client

    def key(self, identifier: str) -> str:
        """The embcache key of a vLLM identifier."""
        return entry_key(ENGINE, self.namespace, identifier)

    # -- lookups ---------------------------------------------------------------------
    def has(self, identifier: str, rows: int | None = None) -> bool:
        """Whether ``identifier`` can be loaded (looked up once per step)."""
        if identifier in self._pins:
            return True
        if identifier not in self._found:
            self.lookup({identifier: rows})
        return self._found[identifier]

    def lookup(self, wanted: dict[str, int | None], request_id: str | None = None) -> None:
        """Look up the identifiers not answered yet this step, in one call.

        Args:
            wanted: identifier -> rows the request expects (None: not known here).
            request_id: the request asking, so its pins end with it.
        """
        fresh = {i: r for i, r in wanted.items() if i not in self._found and i not in self._pins}
        for identifier in wanted:
            pin = self._pins.get(identifier)
            if pin is not None and request_id is not None:
                pin.requests.add(request_id)
        if not fresh:
            return
        keys = [self.key(i) for i in fresh]
        try:
            # The pin's host get fetches shared-tier misses itself: a prefetch before it
            # would only add a call. Without the pin, exists() does not fetch: warm first.
            if self.settings.prefetch and not self.settings.scheduler_pin:
                self.client.prefetch(keys)
            if self.settings.scheduler_pin:
                self._pin_lookup(fresh, keys, request_id)
            else:
                for identifier, found in zip(fresh, self.client.exists(keys), strict=True):
                    self._found[identifier] = bool(found)
                    self._count("hits" if found else "misses")
        except (EmbCacheError, OSError) as exc:  # daemon away: everything is a miss
            log.warning("embcache lookup failed (%s): %d item(s) count as misses", exc, len(keys))
            for identifier in fresh:
                self._found[identifier] = False
            self._count("misses", len(fresh))

    def _pin_lookup(
        self, fresh: dict[str, int | None], keys: list[str], request_id: str | None
    ) -> None:
        leased = self.client.get(keys, ttl_s=self.settings.pin_ttl_s)
        now = time.monotonic()
        for (identifier, rows), tensor, lease_id in zip(
            fresh.items(), leased.tensors, _lease_per_item(leased), strict=True
        ):
            if tensor is None or lease_id is None:
                self._found[identifier] = False
                self._count("misses")
                continue
            dtype, shape = str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape)
            one = LeasedTensors([tensor], [lease_id], self.client.release)
            if not self._usable(dtype, shape, rows):
                log.info(
                    "embcache entry %s is %s %s, want %s x %s rows: a miss",
                    identifier,
                    dtype,
                    shape,
                    self.dtype,
                    rows,
                )
                _release(one)
                self._found[identifier] = False
                self._count("mismatches")
                self._count("misses")
                continue
            pin = _Pin(one, dtype, shape, now)
            if request_id is not None:
                pin.requests.add(request_id)
            self._pins[identifier] = pin
            self._found[identifier] = True
            self._count("hits")
        # Each item's lease now lives in its own pin; the batch object releases nothing.
        leased.released = True

    def _usable(self, dtype: str, shape: tuple[int, ...], rows: int | None) -> bool:
        if dtype != self.dtype or len(shape) != 2:
            return False
        return rows is None or shape[0] == rows

    # -- the step's loads ------------------------------------------------------------
    def ensure(self, request: Any, num_computed_tokens: int) -> bool:
        """Look up the request's items that are not computed yet; never defers it."""
        wanted: dict[str, int | None] = {}
        for index, feature in enumerate(request.mm_features):
            position = feature.mm_position
            if position.offset + position.length <= num_computed_tokens:
                continue
            wanted[feature.identifier] = int(request.get_num_encoder_embeds(index))
        if wanted:
            self.lookup(wanted, request.request_id)
        return True

    def after_alloc(self, request: Any, index: int) -> None:
        """Schedule the load of item ``index`` if it is to come from embcache."""
        if not self.is_consumer:
            return
        identifier = request.mm_features[index].identifier
        rows = int(request.get_num_encoder_embeds(index))
        if not self.has(identifier, rows):
            return
        pin = self._pins.get(identifier)
        pending = self._pending.get(identifier)
        if pending is None:
            shape = pin.shape if pin is not None else None
            pending = _Pending(self.key(identifier), rows, shape, set())
            self._pending[identifier] = pending
        pending.requests.add(request.request_id)
        if pin is not None:
            pin.requests.add(request.request_id)
            if pin.shape[0] != rows:  # pinned for another request's row count
                pending.available = False

    def build_meta(self) -> EmbCacheConnectorMetadata:
        """This step's loads; starts the next step (answers are looked up again)."""
        loads = []
        for identifier, p in self._pending.items():
            loads.append(
                LoadSpec(
                    identifier=identifier,
                    key=p.key,
                    rows=p.rows,
                    dtype=self.dtype,
                    shape=p.shape,
                    request_ids=tuple(sorted(p.requests)),
                    available=p.available,
                    fallback_width=self.width,
                )
            )
            self._loading.setdefault(identifier, set()).update(p.requests)
            if not p.available:
                self._unavailable.update(p.requests)
        self._pending.clear()
        self._found.clear()
        self._renew_pins()
        return EmbCacheConnectorMetadata(loads=loads)

    def _renew_pins(self) -> None:
        now = time.monotonic()
        stale = [p for p in self._pins.values() if now - p.taken_at > self.settings.pin_ttl_s / 2]
        if not stale:
            return
        try:
            self.client.renew(
                [i for p in stale for i in p.leased.lease_ids], self.settings.pin_ttl_s
            )
        except (EmbCacheError, OSError) as exc:
            log.warning("embcache could not renew %d pin(s): %s", len(stale), exc)
            return
        for p in stale:
            p.taken_at = now

    # -- what the workers reported ---------------------------------------------------
    def on_worker_meta(self, meta: EmbCacheWorkerMetadata | None) -> None:
        """Release the pins of reported items; fail the requests of failed loads."""
        if meta is None:
            return
        self.stats = add_counts(self.stats, meta.stats)
        for identifier in meta.loaded | set(meta.failed):
            requests = self._loading.pop(identifier, set())
            if identifier in meta.failed:
                log.warning(
                    "embcache load of %s failed (%s): failing %d request(s), retryable",
                    identifier,
                    meta.failed[identifier],
                    len(requests),
                )
                self._unavailable.update(requests)
            self._drop_pin(identifier)

    def request_finished(self, request_id: str) -> None:
        """Drop the request from its pins; a pin no request needs is released."""
        for identifier, pin in list(self._pins.items()):
            pin.requests.discard(request_id)
            if not pin.requests and identifier not in self._loading:
                self._drop_pin(identifier)

    def take_unavailable(self) -> set[str]:
        """The requests whose items could not be loaded since the last call."""
        taken, self._unavailable = self._unavailable, set()
        return taken

    def take_stats(self) -> dict[str, int]:
        """The counts since the last call (this half's and its workers')."""
        taken, self.stats = self.stats, {}
        return taken

    def close(self) -> None:
        """Release every pin and close the client."""
        for identifier in list(self._pins):
            self._drop_pin(identifier)
        if self._client is not None:
            self._client.close()
            self._client = None

    def _drop_pin(self, identifier: str) -> None:
        pin = self._pins.pop(identifier, None)
        if pin is not None:
            _release(pin.leased)

    def _count(self, name: str, n: int = 1) -> None:
        self.stats[name] = self.stats.get(name, 0) + n


def _lease_per_item(leased: LeasedTensors) -> Iterable[int | None]:
    """Each item's lease id (None for a miss): ``get`` gives one lease per hit, in order."""
    ids = iter(leased.lease_ids)
    return [None if t is None else next(ids) for t in leased.tensors]


def _release(leased: LeasedTensors) -> None:
    try:
        leased.release()
    except (EmbCacheError, OSError) as exc:  # expired or daemon away: nothing to hold
        log.debug("embcache pin release: %s", exc)
