"""Get replies turned into tensors, and the leases that keep them valid.

A same-node client maps the host pool once (``shm.PoolMaps``); an entry stored as one run
becomes a zero-copy view of the pool, an entry spread over several runs is gathered into
a new tensor. Views stay valid while their lease lives: ``with client.get(keys) as ts:``
releases the leases on exit, after which the pages may be reused.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from embcache.clients._wire import torch_dtype
from embcache.clients.shm import PoolMaps
from embcache.errors import LeaseExpired
from embcache.proto.embcache.v1 import embcache_pb2 as pb


@dataclass(slots=True)
class Decoded:
    tensors: list[torch.Tensor | None]
    lease_ids: list[int]
    # Indexes of hits whose pool this process cannot map: fetch their bytes instead.
    remote: list[int] = field(default_factory=list)


def decode_get(reply: pb.GetResponse, maps: PoolMaps) -> Decoded:
    pools = {p.pool_id: p for p in reply.pools}
    out = Decoded([], [])
    for index, result in enumerate(reply.results):
        if not result.found:
            out.tensors.append(None)
            continue
        out.lease_ids.append(result.lease_id)
        if result.WhichOneof("location") != "host" or result.host.pool_id not in pools:
            raise ValueError(f"reply for {result.key!r} names no host pool this client knows")
        mapping = maps.get(pools[result.host.pool_id])
        if mapping is None:
            out.tensors.append(None)
            out.remote.append(index)
            continue
        out.tensors.append(_tensor(result, mapping.tensor))
    return out


def _tensor(result: pb.GetResult, pool: torch.Tensor) -> torch.Tensor:
    meta = result.meta
    runs = [(r.offset, r.length) for r in result.host.runs]
    if sum(n for _, n in runs) != meta.nbytes or any(o + n > pool.numel() for o, n in runs):
        raise ValueError(f"reply for {result.key!r} has byte runs outside the pool")
    if len(runs) == 1:
        offset, length = runs[0]
        flat = pool[offset : offset + length]
    else:  # several runs (or none, for an empty tensor): gather into fresh memory
        flat = torch.empty(meta.nbytes, dtype=torch.uint8)
        pos = 0
        for offset, length in runs:
            flat[pos : pos + length].copy_(pool[offset : offset + length])
            pos += length
    return flat.view(torch_dtype(meta.dtype)).view(tuple(meta.shape))


class _Leased(Sequence[torch.Tensor | None]):
    """Tensors (None for misses) plus the leases that keep the views valid."""

    def __init__(self, tensors: list[torch.Tensor | None], lease_ids: list[int]) -> None:
        self.tensors = tensors
        self.lease_ids = lease_ids
        self.released = not lease_ids

    def __getitem__(self, index: int) -> torch.Tensor | None:  # type: ignore[override]
        return self.tensors[index]

    def __len__(self) -> int:
        return len(self.tensors)

    def __iter__(self) -> Iterator[torch.Tensor | None]:
        return iter(self.tensors)


class LeasedTensors(_Leased):
    """Result of ``EmbCacheClient.get``: tensors (None for misses) plus their leases.

    ``with client.get(keys) as tensors:`` gives the list and releases the leases on exit;
    ``release()`` does it by hand. Views must not be used after the release.

    Zero-copy views read the daemon's pages directly, so what they showed is the entry's
    bytes only if the leases were still alive afterwards (a lease that expired — the reader
    was stopped past its TTL — lets the daemon reuse the pages). ``release()`` checks that:
    if any lease had already ended it raises ``LeaseExpired``, and the data read through the
    views must be discarded. ``client.renew(leased.lease_ids)`` answering fewer than were held
    is the same signal without releasing (and extends the live ones).
    """

    def __init__(
        self,
        tensors: list[torch.Tensor | None],
        lease_ids: list[int],
        release: Callable[[list[int]], object],
    ) -> None:
        super().__init__(tensors, lease_ids)
        self._release = release

    def release(self) -> None:
        """End the leases; raises LeaseExpired if any had ended before (stale views)."""
        if not self.released:
            self.released = True
            _check_ended(self._release(self.lease_ids), self.lease_ids)

    def __enter__(self) -> list[torch.Tensor | None]:
        return self.tensors

    def __exit__(self, exc_type: object, *exc: object) -> None:
        try:
            self.release()
        except LeaseExpired:
            if exc_type is None:  # do not hide the exception that is already leaving
                raise


class AsyncLeasedTensors(_Leased):
    """The asyncio twin of :class:`LeasedTensors` (``async with``)."""

    def __init__(
        self,
        tensors: list[torch.Tensor | None],
        lease_ids: list[int],
        release: Callable[[list[int]], Awaitable[object]],
    ) -> None:
        super().__init__(tensors, lease_ids)
        self._release = release

    async def release(self) -> None:
        """End the leases; raises LeaseExpired if any had ended before (stale views)."""
        if not self.released:
            self.released = True
            _check_ended(await self._release(self.lease_ids), self.lease_ids)

    async def __aenter__(self) -> list[torch.Tensor | None]:
        return self.tensors

    async def __aexit__(self, exc_type: object, *exc: object) -> None:
        try:
            await self.release()
        except LeaseExpired:
            if exc_type is None:
                raise


def _check_ended(ended: object, lease_ids: list[int]) -> None:
    """Raise if the daemon ended fewer leases than were held: some had expired already."""
    held = len(set(lease_ids))
    if isinstance(ended, int) and ended < held:
        raise LeaseExpired(
            "a lease ended before it was released (e.g. the reader was stopped past its "
            "TTL): data read through the zero-copy views may be reused memory; read again",
            held=held,
            released=ended,
        )


def copy_into(tensors: Sequence[torch.Tensor | None], out: Sequence[torch.Tensor]) -> list[bool]:
    """``get_into`` on the host: copy each hit into its destination (same dtype and size)."""
    if len(out) != len(tensors):
        raise ValueError(f"get_into needs one destination per key ({len(tensors)}), got {len(out)}")
    found = []
    for i, (src, dst) in enumerate(zip(tensors, out, strict=True)):
        if src is None:
            found.append(False)
            continue
        if dst.dtype != src.dtype or dst.numel() != src.numel():
            raise ValueError(
                f"out[{i}] is {dst.dtype} x {dst.numel()}, the entry is {src.dtype} x {src.numel()}"
            )
        dst.copy_(src.view(dst.shape))
        found.append(True)
    return found
