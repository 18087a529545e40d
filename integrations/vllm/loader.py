"""A consumer's loads: items staged ahead of their step, then handed to vLLM's cache.

The scheduler asks a worker to stage an item one step (or more) before any request reads
it. A background thread fetches the step's stagings with one ``get_into`` into one buffer
on the worker's device (the daemon copies straight into it; items of unknown width come
through ``get``), checks each against what was pinned (dtype, shape), and keeps each in a
tensor of its own, apart from vLLM's encoder cache. The scheduler learns which items are
staged from the worker metadata, and only then lets a request read them: the step that
does moves the staged tensor into the encoder cache, which cannot fail. A staging that
fails (a miss, a mismatch, a daemon that died or hangs) is reported, the item is encoded
instead, and nothing is written under its identifier anywhere.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass, field

import torch

from embcache.clients import EmbCacheClient
from embcache.integrations.vllm.closing import close_in_background
from embcache.integrations.vllm.metadata import StageSpec, UseSpec

log = logging.getLogger("embcache.integrations.vllm")
_ALIGN = 16
_Job = tuple[list[StageSpec], torch.device]


@dataclass
class StepReport:
    """What a worker did since its last report."""

    staged: set[str] = field(default_factory=set)
    failed: dict[str, str] = field(default_factory=dict)
    used: set[str] = field(default_factory=set)
    use_failed: dict[str, str] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)

    def count(self, name: str, n: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + n

    def empty(self) -> bool:
        return not (self.staged or self.failed or self.used or self.use_failed or self.counts)


def mismatch(spec: StageSpec, dtype: str, shape: tuple[int, ...]) -> str | None:
    """Why an entry of ``dtype`` x ``shape`` cannot serve ``spec`` (None: it can)."""
    if dtype != spec.dtype:
        return f"dtype {dtype}, want {spec.dtype}"
    if len(shape) != 2 or shape[0] != spec.shape[0]:
        return f"shape {shape}, want {spec.shape[0]} rows"
    if spec.shape[1] >= 0 and tuple(shape) != tuple(spec.shape):
        return f"shape {shape}, pinned as {spec.shape}"
    return None


class Loader:
    """Stages items in the background and hands them to the encoder cache when used."""

    def __init__(self, connect: Callable[[], EmbCacheClient], wait_s: float = 30.0) -> None:
        self._connect = connect
        self._wait_s = wait_s
        self._client: EmbCacheClient | None = None
        self._lock = threading.Lock()
        self._landed = threading.Condition(self._lock)
        self._staged: dict[str, torch.Tensor] = {}
        self._in_flight: set[str] = set()
        self._dropped: set[str] = set()  # dropped while in flight: discard on arrival
        self._report = StepReport()
        self._queue: queue.Queue[_Job | threading.Event | None] = queue.Queue()
        self._thread: threading.Thread | None = None

    def step(
        self,
        stage: Sequence[StageSpec],
        use: Sequence[UseSpec],
        drop: Sequence[str],
        cache: MutableMapping[str, torch.Tensor],
        device: torch.device,
    ) -> None:
        """One step's part: drop, use (into ``cache``), then start the new stagings."""
        with self._lock:
            for key in drop:
                self._staged.pop(key, None)
                if key in self._in_flight:
                    self._dropped.add(key)
            # Tensor-parallel ranks stage at their own pace and the scheduler hears of the
            # first: a rank still fetching an item it is told to use finishes that first.
            pending = [u.key for u in use if u.key in self._in_flight]
            if pending:
                self._landed.wait_for(
                    lambda: not any(k in self._in_flight for k in pending), self._wait_s
                )
            for spec in use:
                tensor = self._staged.pop(spec.key, None)
                if tensor is None:
                    if spec.identifier not in cache:
                        self._report.use_failed[spec.identifier] = "not staged on this worker"
                    continue
                cache[spec.identifier] = tensor
                self._report.used.add(spec.identifier)
                self._report.count("loads")
                self._report.count("load_bytes", tensor.numel() * tensor.element_size())
            fresh = [s for s in stage if s.key not in self._staged and s.key not in self._in_flight]
            self._in_flight.update(s.key for s in fresh)
            self._dropped.difference_update(s.key for s in fresh)
        if fresh:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="embcache-stager", daemon=True
                )
                self._thread.start()
            self._queue.put((fresh, device))

    def take_report(self) -> StepReport:
        """What happened since the last call."""
        with self._lock:
            report, self._report = self._report, StepReport()
        return report

    def staged_keys(self) -> set[str]:
        """Keys staged on this worker now (tests, diagnostics)."""
        with self._lock:
            return set(self._staged)

    def wait_idle(self, timeout: float) -> bool:
        """Wait until the stagings started so far are done (tests); False on timeout."""
        if self._thread is None:
            return True
        done = threading.Event()
        self._queue.put(done)  # FIFO: set once every earlier staging is done
        return done.wait(timeout)

    def _reconnect(self) -> None:
        """Close the client after a failure: the next staging connects afresh."""
        client, self._client = self._client, None
        close_in_background(client, "loader")

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread (bounded), drop what is staged, close the client."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout)
            self._thread = None
        with self._lock:
            self._staged.clear()
        if self._client is not None:
            try:
                self._client.close()
            except Exception as exc:  # closing must not fail a shutdown
                log.debug("embcache loader client close: %s", exc)
            self._client = None

    # -- the thread ----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            if isinstance(job, threading.Event):
                job.set()
                continue
            specs, device = job
            results: dict[str, torch.Tensor | str] = {}
            try:
                self._fetch(specs, device, results)
            except Exception as exc:  # a failed staging is a miss, never a crash
                log.warning("embcache staging failed: %s: %s", type(exc).__name__, exc)
                self._reconnect()
                for spec in specs:
                    results.setdefault(spec.key, f"{type(exc).__name__}: {exc}")
            with self._lock:
                for spec in specs:
                    self._in_flight.discard(spec.key)
                    got = results.get(spec.key, "no result")
                    if spec.key in self._dropped:
                        self._dropped.discard(spec.key)
                        continue
                    if isinstance(got, torch.Tensor):
                        self._staged[spec.key] = got
                        self._report.staged.add(spec.key)
                        self._report.count("staged")
                    else:
                        self._report.failed[spec.key] = got
                        self._report.count("stage_failures")
                self._landed.notify_all()

    def _fetch(
        self, specs: list[StageSpec], device: torch.device, out: dict[str, torch.Tensor | str]
    ) -> None:
        if self._client is None:
            self._client = self._connect()
        if device.type == "cuda":
            torch.cuda.set_device(device)
        sized = [s for s in specs if s.shape[1] >= 0]
        unsized = [s for s in specs if s.shape[1] < 0]
        if sized:
            self._fetch_into(sized, device, out)
        if unsized:
            self._fetch_leased(unsized, device, out)
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()  # complete before reported

    def _fetch_into(
        self, specs: list[StageSpec], device: torch.device, out: dict[str, torch.Tensor | str]
    ) -> None:
        offsets, end = [], 0
        for spec in specs:
            offsets.append(end)
            end += -(-_nbytes(spec.shape, spec.dtype) // _ALIGN) * _ALIGN
        buffer = torch.empty(max(end, 1), dtype=torch.uint8, device=device)
        assert self._client is not None
        results = self._client.get_into([s.key for s in specs], buffer, offsets)
        for spec, result in zip(specs, results, strict=True):
            if not result.found:
                out[spec.key] = "not found (evicted or the daemon restarted)"
                continue
            why = mismatch(spec, result.dtype, tuple(result.shape))
            if why is not None:
                out[spec.key] = why
                continue
            view = result.view(buffer)
            out[spec.key] = view if len(specs) == 1 else view.clone()

    def _fetch_leased(
        self, specs: list[StageSpec], device: torch.device, out: dict[str, torch.Tensor | str]
    ) -> None:
        assert self._client is not None
        with self._client.get([s.key for s in specs], device=device) as tensors:
            for spec, tensor in zip(specs, tensors, strict=True):
                if tensor is None:
                    out[spec.key] = "not found (evicted or the daemon restarted)"
                    continue
                dtype = str(tensor.dtype).removeprefix("torch.")
                why = mismatch(spec, dtype, tuple(tensor.shape))
                if why is not None:
                    out[spec.key] = why
                    continue
                out[spec.key] = tensor.to(device, copy=True)


def _nbytes(shape: Sequence[int], dtype: str) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n * torch.empty((), dtype=getattr(torch, dtype)).element_size()
