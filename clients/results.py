"""Get replies turned into tensors, and the leases that keep them valid.

A same-node client maps the host pool once (``shm.PoolMaps``); an entry stored as one run
becomes a zero-copy view of the pool, an entry spread over several runs is gathered into
a new tensor. Views stay valid while their lease lives: ``with client.get(keys) as ts:``
releases the leases on exit, after which the pages may be reused.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator, Sequence

import torch

from embcache.clients.core.replies import check_ended
from embcache.errors import LeaseExpired


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
            check_ended(self._release(self.lease_ids), self.lease_ids)

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
            check_ended(await self._release(self.lease_ids), self.lease_ids)

    async def __aenter__(self) -> list[torch.Tensor | None]:
        return self.tensors

    async def __aexit__(self, exc_type: object, *exc: object) -> None:
        try:
            await self.release()
        except LeaseExpired:
            if exc_type is None:
                raise
