"""A producer's saves, off the forward pass: queued per step, put by a background thread.

``save_caches`` runs inside the model runner's encoder loop, so it must not wait for the
daemon. It records a CUDA event on the tensor's current stream (the encoder's output is
complete once the event fires) and queues the tensor; at the end of the step the step's
items go to a background thread as one batch. That thread waits on each event (a host
wait, off the forward stream) and calls ``put_many``: a CUDA tensor goes to the daemon by
CUDA IPC where the daemon has CUDA, else its bytes are streamed. The queue holds a
reference to each tensor until its put has returned, so vLLM freeing its encoder-cache
entry meanwhile cannot recycle the memory under the copy.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from embcache.clients import EmbCacheClient, RpcFailed
from embcache.integrations.vllm.closing import close_in_background

log = logging.getLogger("embcache.integrations.vllm")


@dataclass(slots=True)
class _Item:
    key: str
    tensor: torch.Tensor
    event: Any  # torch.cuda.Event, or None for a CPU tensor


class Saver:
    """Step-batched background puts, bounded by ``max_pending`` items."""

    def __init__(self, connect: Callable[[], EmbCacheClient], max_pending: int) -> None:
        self._connect = connect
        self._client: EmbCacheClient | None = None
        self._max_pending = max_pending
        self._step: list[_Item] = []
        self._queue: queue.Queue[list[_Item] | None] = queue.Queue()
        self._lock = threading.Lock()
        self._pending = 0  # items queued or being put
        self._idle = threading.Condition(self._lock)
        self._counts: dict[str, int] = {}
        self._thread: threading.Thread | None = None

    def add(self, key: str, tensor: torch.Tensor) -> None:
        """Queue one tensor for this step's batch (returns at once).

        Raises:
            TypeError: ``tensor`` is not a torch tensor.
        """
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"encoder output for {key!r} is {type(tensor).__name__}, not a tensor")
        with self._lock:
            if self._pending + len(self._step) >= self._max_pending:
                self._counts["saves_dropped"] = self._counts.get("saves_dropped", 0) + 1
                log.warning("embcache: %d saves pending, dropping %s", self._pending, key)
                return
        event = None
        if tensor.is_cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(tensor.device))
        self._step.append(_Item(key, tensor.detach(), event))

    def flush(self) -> None:
        """Hand this step's items to the background thread as one batch."""
        if not self._step:
            return
        batch, self._step = self._step, []
        with self._lock:
            self._pending += len(batch)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="embcache-saver", daemon=True)
            self._thread.start()
        self._queue.put(batch)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every queued save has been put (or failed); False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def take_counts(self) -> dict[str, int]:
        """Saves, bytes, failures and drops since the last call."""
        with self._lock:
            taken, self._counts = self._counts, {}
        return taken

    def close(self, timeout: float = 30.0) -> None:
        """Put what is queued (up to ``timeout``), stop the thread, close the client."""
        self.flush()
        self.wait(timeout)
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout)
            self._thread = None
        if self._client is not None:
            self._client.close()
            self._client = None

    def _reconnect(self) -> None:
        """Close the client after the daemon failed: the next batch connects afresh."""
        client, self._client = self._client, None
        close_in_background(client, "saver")

    def _run(self) -> None:
        while True:
            batch = self._queue.get()
            if batch is None:
                return
            try:
                self._put(batch)
            finally:
                with self._idle:
                    self._pending -= len(batch)
                    self._idle.notify_all()

    def _put(self, batch: list[_Item]) -> None:
        """Put one step's batch; each item is counted by its own outcome."""
        counts: dict[str, int] = {}
        stored: list[_Item] = []
        failed = 0
        try:
            for item in batch:
                if item.event is not None:
                    item.event.synchronize()
            if self._client is None:
                self._client = self._connect()
            self._client.put_many([(i.key, i.tensor) for i in batch])
            stored = batch
        except Exception as exc:  # a batch call is all or nothing: learn each item's fate
            log.warning("embcache: a batch of %d save(s) failed (%s); one by one", len(batch), exc)
            for index, item in enumerate(batch):
                try:
                    if self._client is None:
                        self._client = self._connect()
                    self._client.put(item.key, item.tensor)
                    stored.append(item)
                except (RpcFailed, OSError) as one:  # the daemon is away: so are the rest
                    log.warning("embcache: %d save(s) lost: %s", len(batch) - index, one)
                    failed += len(batch) - index
                    self._reconnect()
                    break
                except Exception as one:  # this item (a bad key, no room): the next may fit
                    log.warning("embcache: save of %s failed: %s", item.key, one)
                    failed += 1
        if stored:
            counts["saves"] = len(stored)
            counts["save_bytes"] = sum(i.tensor.numel() * i.tensor.element_size() for i in stored)
        if failed:
            counts["save_failures"] = failed
        with self._lock:
            for name, n in counts.items():
                self._counts[name] = self._counts.get(name, 0) + n
