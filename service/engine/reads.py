"""Reading a leased entry's bytes out of the host pool: as a tensor, or in chunks; and the
window that keeps one session's reported table reads (touches) from counting a key twice."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

import torch

from embcache.errors import InvalidArgument
from embcache.service.host.host_pool import HostPool
from embcache.service.host.leases import Lease

T = TypeVar("T")


def as_tensor(pool: HostPool, lease: Lease) -> torch.Tensor:
    """The entry as a tensor: a zero-copy view of the pool when it is one run, else a copy
    gathered from its runs (the caller checks the lease lived throughout)."""
    entry = lease.entry
    if lease.contiguous:
        off = lease.byte_runs[0][0] if lease.byte_runs else 0
        flat = pool.tensor[off : off + entry.nbytes]
    else:
        flat = torch.empty(entry.nbytes, dtype=torch.uint8)
        pos = 0
        for off, length in lease.byte_runs:
            flat[pos : pos + length].copy_(pool.tensor[off : off + length])
            pos += length
    return flat.view(entry.dtype.torch_dtype).view(entry.shape)


def iter_bytes(
    pool: HostPool,
    lease: Lease,
    offset: int,
    length: int | None,
    chunk_bytes: int,
    require: Callable[[Lease], None],
    copy: Callable[[memoryview], T],
) -> Iterator[T]:
    """The entry's bytes ``[offset, offset+length)`` in chunks of ``chunk_bytes``; each is
    ``copy`` (``bytes``, say) of a view of the pool, made between two ``require(lease)``
    checks, so a chunk that reached the caller was read while the lease lived (no page of
    it was reused). ``copy`` must not keep the view."""
    if length is None:
        length = lease.nbytes - offset
    if offset < 0 or length < 0 or offset + length > lease.nbytes or chunk_bytes <= 0:
        raise InvalidArgument(
            "byte range outside the entry", offset=offset, length=length, nbytes=lease.nbytes
        )
    array = pool.array
    end = offset + length
    base = 0
    for off, run_len in lease.byte_runs:
        lo, hi = max(offset, base), min(end, base + run_len)
        pos = lo
        while pos < hi:
            take = min(chunk_bytes, hi - pos)
            require(lease)
            data = copy(array[off + pos - base : off + pos - base + take].data)
            require(lease)  # still leased after the copy: the bytes are the entry's
            yield data
            pos += take
        base += run_len


class TouchWindow:
    """The keys one session's touches counted as hits in the current window.

    A touch is a client's word that it read keys out of the read table; nothing checks it.
    So a session counts each key at most once per window of ``window_s`` seconds, as a hit
    and as a move to the LRU's recent end: repeating a touch cannot inflate the hit counters
    or keep an entry at the recent end by itself more than once a window. Only keys still
    cached are remembered, and by their hash (a collision only leaves a hit uncounted), so
    what a window holds is bounded by the cache's entries, whatever the client sends.
    ``window_s`` 0: every touch counts. Used under the engine's lock.
    """

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._started = float("-inf")
        self._seen: set[int] = set()

    def fresh(self, keys: Iterable[str], now: float) -> list[str]:
        """Those of ``keys`` (cached ones) not counted yet in this window, each once; they
        count as of now."""
        if self.window_s <= 0:
            return list(keys)
        if now - self._started >= self.window_s:
            self._seen.clear()
            self._started = now
        seen = self._seen
        out = []
        for key in keys:
            h = hash(key)
            if h not in seen:
                seen.add(h)
                out.append(key)
        return out
