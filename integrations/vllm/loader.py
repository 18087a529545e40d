"""A consumer's loads: this step's items into vLLM's encoder cache, checked.

Items whose shape the scheduler saw (pinned) are fetched with one ``get_into`` into one
buffer on the worker's GPU (the daemon copies straight into it), then each item is cloned
out of it into a tensor of its own, so vLLM can free items one at a time; a lone item keeps
the buffer itself. Items of unknown shape come through ``get`` to the device and are
cloned before the leases end. Every item is checked against what the request expects
(rows, 2-D, dtype, and the pinned shape): a mismatch, a miss or a failed call is reported
as a failed load, and the item gets a zero placeholder of the expected shape so the step
can run; the scheduler fails its requests before their output is used further.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass, field

import torch

from embcache.clients import EmbCacheClient
from embcache.errors import EmbCacheError
from embcache.integrations.vllm.metadata import LoadSpec

log = logging.getLogger("embcache.integrations.vllm")
_ALIGN = 16


@dataclass
class LoadReport:
    """What one step's loads did."""

    loaded: set[str] = field(default_factory=set)
    failed: dict[str, str] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)

    def ok(
        self, spec: LoadSpec, tensor: torch.Tensor, cache: MutableMapping[str, torch.Tensor]
    ) -> None:
        """``spec`` loaded: its tensor goes into the encoder cache and is counted."""
        cache[spec.identifier] = tensor
        self.loaded.add(spec.identifier)
        self._count("loads")
        self._count("load_bytes", tensor.numel() * tensor.element_size())

    def fail(
        self,
        spec: LoadSpec,
        reason: str,
        cache: MutableMapping[str, torch.Tensor],
        device: torch.device,
    ) -> None:
        """``spec`` failed (``reason``): a zero placeholder of its shape keeps the step running,
        and the request is reported failed (vLLM fails it, retryable)."""
        width = spec.shape[1] if spec.shape and len(spec.shape) == 2 else spec.fallback_width
        cache[spec.identifier] = torch.zeros(
            (spec.rows, max(width, 1)), dtype=getattr(torch, spec.dtype), device=device
        )
        self.failed[spec.identifier] = reason
        self._count("load_failures")

    def _count(self, name: str, n: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + n


def mismatch(spec: LoadSpec, dtype: str, shape: tuple[int, ...]) -> str | None:
    """Why an entry of ``dtype`` x ``shape`` cannot serve ``spec`` (None: it can)."""
    if dtype != spec.dtype:
        return f"dtype {dtype}, want {spec.dtype}"
    if len(shape) != 2 or shape[0] != spec.rows:
        return f"shape {shape}, want {spec.rows} rows"
    if spec.shape is not None and tuple(shape) != tuple(spec.shape):
        return f"shape {shape}, pinned as {spec.shape}"
    return None


class Loader:
    """Loads the scheduler's ``LoadSpec``s of one step into the encoder cache."""

    def __init__(self, connect: Callable[[], EmbCacheClient]) -> None:
        self._connect = connect
        self._client: EmbCacheClient | None = None

    @property
    def client(self) -> EmbCacheClient:
        """This worker's client (opened on the first load)."""
        if self._client is None:
            self._client = self._connect()
        return self._client

    def load(
        self,
        specs: Sequence[LoadSpec],
        cache: MutableMapping[str, torch.Tensor],
        device: torch.device,
    ) -> LoadReport:
        """Fill ``cache[spec.identifier]`` for every spec not there yet.

        Args:
            specs: this step's loads (``EmbCacheConnectorMetadata.loads``).
            cache: vLLM's encoder cache (identifier -> tensor on the worker's device).
            device: where the tensors go.

        Returns:
            The loaded and failed identifiers and the counts.
        """
        report = LoadReport()
        sized, unsized = [], []
        for spec in specs:
            if spec.identifier in cache:
                report.loaded.add(spec.identifier)  # already here (loaded or encoded before)
            elif not spec.available:
                report.fail(spec, "not available at scheduling", cache, device)
            elif spec.shape is not None:
                sized.append(spec)
            else:
                unsized.append(spec)
        if sized:
            self._load_into(sized, cache, device, report)
        if unsized:
            self._load_leased(unsized, cache, device, report)
        return report

    def _load_into(
        self,
        specs: list[LoadSpec],
        cache: MutableMapping[str, torch.Tensor],
        device: torch.device,
        report: LoadReport,
    ) -> None:
        offsets, end = [], 0
        for spec in specs:
            assert spec.shape is not None
            offsets.append(end)
            nbytes = _nbytes(spec.shape, spec.dtype)
            end += -(-nbytes // _ALIGN) * _ALIGN
        buffer = torch.empty(max(end, 1), dtype=torch.uint8, device=device)
        try:
            results = self.client.get_into([s.key for s in specs], buffer, offsets)
        except (EmbCacheError, OSError, ValueError) as exc:
            for spec in specs:
                report.fail(spec, f"get_into failed: {exc}", cache, device)
            return
        for spec, result in zip(specs, results, strict=True):
            if not result.found:
                report.fail(spec, "not found (evicted since the lookup?)", cache, device)
                continue
            why = mismatch(spec, result.dtype, result.shape)
            if why is not None:
                report.fail(spec, why, cache, device)
                continue
            view = result.view(buffer)
            report.ok(spec, view if len(specs) == 1 else view.clone(), cache)

    def _load_leased(
        self,
        specs: list[LoadSpec],
        cache: MutableMapping[str, torch.Tensor],
        device: torch.device,
        report: LoadReport,
    ) -> None:
        try:
            leased = self.client.get([s.key for s in specs], device=device)
        except (EmbCacheError, OSError, ValueError) as exc:
            for spec in specs:
                report.fail(spec, f"get failed: {exc}", cache, device)
            return
        with leased as tensors:
            for spec, tensor in zip(specs, tensors, strict=True):
                if tensor is None:
                    report.fail(spec, "not found (evicted since the lookup?)", cache, device)
                    continue
                dtype = str(tensor.dtype).removeprefix("torch.")
                why = mismatch(spec, dtype, tuple(tensor.shape))
                if why is not None:
                    report.fail(spec, why, cache, device)
                    continue
                report.ok(spec, tensor.to(device, copy=True), cache)

    def close(self) -> None:
        """Close the client."""
        if self._client is not None:
            self._client.close()
            self._client = None


def _nbytes(shape: Sequence[int], dtype: str) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n * torch.empty((), dtype=getattr(torch, dtype)).element_size()
