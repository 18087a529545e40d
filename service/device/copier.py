"""How the device tier moves bytes: one copy call, the put streams, and copy accounting.

Gets, get-into and puts from a device all copy between the host pool and device memory
through :meth:`Copier.transfer` (``kernels.transfer_ranges`` with the daemon's backend and
SM budget), so the choice of copy path is made in one place. Copies that no device pool's
stream orders (out of a client's tensor, or into a client's buffer on a GPU without a pool)
run on a put stream per GPU, or, for a put, on the caller's own stream (``puts.py``).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable

import numpy as np
import torch

from embcache import kernels
from embcache.kernels.transfer import Backend
from embcache.service.host.host_pool import HostPool

CopyObserver = Callable[[str, int, float], None]  # (direction, nbytes, seconds) per copy


class Copier:
    """The copy path of the device tier (module docstring)."""

    def __init__(
        self,
        host: HostPool,
        *,
        backend: Backend,
        sm_budget: int,
        observer: CopyObserver | None = None,
    ) -> None:
        self.host = host
        self.backend = backend  # "auto", or one forced in the settings
        self.config = kernels.TransferConfig(sm_budget=sm_budget)
        self.observer = observer  # told of every finished copy (the metrics)
        self._put_streams: dict[int, torch.cuda.Stream] = {}
        self._copied: Counter[str] = Counter()  # direction -> bytes queued
        self._lock = threading.Lock()  # the counter is bumped from worker threads too

    def transfer(
        self,
        src: torch.Tensor,
        dst: torch.Tensor,
        s: np.ndarray,
        d: np.ndarray,
        n: np.ndarray,
        stream: torch.cuda.Stream | None,
        *,
        checked: bool = True,
    ) -> None:
        """Copy row ranges ``src[s:s+n] -> dst[d:d+n]`` on ``stream``.

        ``checked=False``: ``kernels.transfer_planned``, for a plan made from the
        allocators' own runs, which holds by construction (its checks cost more host time
        than queuing the copy)."""
        on_cuda = src.device.type == "cuda" or dst.device.type == "cuda"
        backend: Backend = self.backend if on_cuda else "torch"
        if not checked:
            kernels.transfer_planned(
                src, dst, s, d, n, stream=stream, backend=backend, config=self.config
            )
            return
        kernels.transfer_ranges(
            src,
            dst,
            s,
            d,
            n,
            stream=stream,
            backend=backend,
            host_registered=self.host.registered,
            config=self.config,
        )

    def stream_for(self, t: torch.Tensor) -> torch.cuda.Stream | None:
        """The put stream of ``t``'s GPU (None for a CPU tensor)."""
        if not t.is_cuda:
            return None
        index = t.get_device()
        if index not in self._put_streams:
            self._put_streams[index] = torch.cuda.Stream(t.device)
        return self._put_streams[index]

    @staticmethod
    def record(stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
        """An event after the work queued on ``stream`` so far (None without a stream)."""
        if stream is None:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def count(self, direction: str, nbytes: int) -> None:
        """``nbytes`` queued for copying in ``direction`` (``h2d``, ``d2h``, ``d2d``)."""
        if nbytes:
            with self._lock:
                self._copied[direction] += nbytes

    def copied(self) -> dict[str, int]:
        """Bytes queued so far, by direction (the stats' ``bytes_copied``)."""
        with self._lock:
            return {d: self._copied[d] for d in ("h2d", "d2h", "d2d")}

    def observe(self, direction: str, nbytes: int, seconds: float) -> None:
        """One finished copy, for the metrics' bandwidth histogram."""
        if self.observer is not None and nbytes:
            self.observer(direction, nbytes, seconds)

    def close(self) -> None:
        """Wait for the copies on the put streams (a put the engine dropped as it closed may
        still be copying into the host pool, which is unmapped next)."""
        for stream in self._put_streams.values():
            stream.synchronize()
