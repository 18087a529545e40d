"""Multi-GPU routing: where a device copy comes from, and pools that fail.

An entry already resident on GPU A and wanted on GPU B can be copied A -> B over the GPU
interconnect instead of host -> B. Which is faster depends on the machine (NVLink, PCIe
switch topology, NUMA), so the choice comes from rates timed at start-up
(:meth:`PeerRates.calibrate`), never from a constant. Rates can also be given (tests,
operators who timed their own).

A pool whose device raises a CUDA error is taken out of service: its residencies are
forgotten on the host side and gets for that GPU fail with DeviceUnavailable, while the
other pools go on serving.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from embcache.service.device.copy_plan import merge_runs
from embcache.service.device.pool import DevicePool
from embcache.service.device.residency import Residency
from embcache.service.host.allocator import page_byte_runs
from embcache.service.host.entries import Entry

log = logging.getLogger(__name__)
HOST = -1  # source index of the host pool in the rate table


@dataclass
class PeerRates:
    """Copy rates (gigabytes per second) timed at start-up or given: ``rates[(src, dst)]``,
    ``src`` a pool index or HOST."""

    rates: dict[tuple[int, int], float] = field(default_factory=dict)

    def prefer_peer(self, src: int, dst: int) -> bool:
        """Copy from pool ``src`` rather than from the host when its rate is higher."""
        peer = self.rates.get((src, dst))
        host = self.rates.get((HOST, dst))
        return peer is not None and host is not None and peer > host

    def best_source(self, entry: Entry, dst: int, pools: list[DevicePool]) -> int | None:
        """The fastest pool holding a finished copy of ``entry``, if it beats the host."""
        best: tuple[float, int] | None = None
        for pool in pools:
            if pool.index == dst or pool.failed or not pool.is_resident(entry):
                continue
            if not self.prefer_peer(pool.index, dst):
                continue
            rate = self.rates[(pool.index, dst)]
            if best is not None and rate <= best[0]:
                continue
            res = pool.peek(entry)
            if res is None or (res.event is not None and not res.event.query()):
                continue  # still loading there: the host copy is ready now
            best = (rate, pool.index)
        return None if best is None else best[1]

    @classmethod
    def calibrate(
        cls, pools: list[DevicePool], host: torch.Tensor, nbytes: int = 64 << 20
    ) -> PeerRates:
        """Time host -> each GPU and each GPU -> each other GPU (at start-up), with copies
        of ``nbytes`` or less; fewer than two GPUs: no rates, nothing to choose."""
        rates: dict[tuple[int, int], float] = {}
        cuda = [p for p in pools if p.device.type == "cuda"]
        if len(cuda) < 2:
            return cls(rates)
        n = min(nbytes, host.numel(), *(p.tensor.numel() for p in cuda))
        for dst in cuda:
            rates[(HOST, dst.index)] = _time_copy(dst.tensor[:n], host[:n], dst)
            for src in cuda:
                if src is dst:
                    continue
                try:
                    rates[(src.index, dst.index)] = _time_copy(dst.tensor[:n], src.tensor[:n], dst)
                except RuntimeError as exc:  # no peer path: that pair is never chosen
                    log.warning("no copies from pool %d to %d: %s", src.index, dst.index, exc)
        log.info(
            "copy rates (GB/s, -1 = host): %s",
            {f"{s}->{d}": round(r, 1) for (s, d), r in rates.items()},
        )
        return cls(rates)


def _time_copy(dst: torch.Tensor, src: torch.Tensor, pool: DevicePool, reps: int = 3) -> float:
    stream = pool.stream
    assert stream is not None
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)  # warm-up (peer mapping, first touch)
        stream.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            dst.copy_(src, non_blocking=True)
        stream.synchronize()
    return reps * dst.numel() / (time.perf_counter() - t0) / 1e9


def copy_between_pools(
    src_pool: DevicePool, dst_pool: DevicePool, items: list[tuple[Residency, Residency, int]]
) -> None:
    """Queue device-to-device copies of several entries' pages, ``(source residency,
    destination residency, nbytes)`` each, from ``src_pool`` to ``dst_pool``.

    On GPUs: one ``cudaMemcpyAsync`` per piece on the destination pool's stream (the
    destination GPU pulls over the interconnect), so the get's ready event covers them by
    stream order. The source residencies are complete already (``best_source`` takes only
    those), so nothing waits before the copies; after them, the source pool's stream waits
    for this one, so a reuse of those pages after an eviction there comes after the reads.
    Not a torch ``copy_`` per piece: each pays cross-device event syncs, which made peer
    copies slower than the host path (docs/device.md, "Several GPUs").
    """
    so: list[int] = []
    do: list[int] = []
    ln: list[int] = []
    for src, dst, nbytes in items:
        if not nbytes:
            continue
        if len(src.runs) == 1 and len(dst.runs) == 1:  # the usual case: one piece
            so.append(src.runs[0][0] * src_pool.page_bytes)
            do.append(dst.runs[0][0] * dst_pool.page_bytes)
            ln.append(nbytes)
            continue
        s, d, n = merge_runs(
            page_byte_runs(src.runs, src_pool.page_bytes, nbytes),
            page_byte_runs(dst.runs, dst_pool.page_bytes, nbytes),
        )
        so += s.tolist()
        do += d.tolist()
        ln += n.tolist()
    from embcache import kernels

    rt = kernels.cuda_runtime() if dst_pool.stream is not None else None
    if rt is None or src_pool.stream is None or dst_pool.stream is None:  # CPU test pools
        for s_, d_, n_ in zip(so, do, ln, strict=True):
            dst_pool.tensor[d_ : d_ + n_].copy_(src_pool.tensor[s_ : s_ + n_])
        return
    stream = dst_pool.stream
    src_base, dst_base = src_pool.tensor.data_ptr(), dst_pool.tensor.data_ptr()
    with torch.cuda.device(dst_pool.device):
        for s_, d_, n_ in zip(so, do, ln, strict=True):
            rt.memcpy_async(dst_base + d_, src_base + s_, n_, stream.cuda_stream)
    src_pool.stream.wait_stream(stream)
