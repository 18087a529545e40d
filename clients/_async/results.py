"""The result of ``get``: tensors, and the leases that keep them valid.

Zero-copy views read the daemon's pages directly, so the pages must not be reused while the
views are read: each hit holds a lease until it is released, after which the daemon may
reuse them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from embcache.clients._backends.async_io import ReleaseFn
from embcache.clients.core.replies import check_ended
from embcache.errors import LeaseExpired


class AsyncLeasedTensors(Sequence[torch.Tensor | None]):
    """Tensors (None for misses) plus their leases: the result of ``client.get``.

    ``with client.get(keys) as tensors:`` (``async with`` on the asyncio client) gives the
    list and releases the leases on exit; ``release()`` does it by hand. Views must not be
    used after the release.

    What the views showed is the entry's bytes only if the leases were still alive
    afterwards (a lease that expired, because the reader was stopped past its TTL, lets the
    daemon reuse the pages). ``release()`` checks that: if any lease had already ended it
    raises ``LeaseExpired``, and the data read through the views must be discarded.
    ``client.renew(leased.lease_ids)`` answering fewer than were held is the same signal
    without releasing (and extends the live ones).
    """

    def __init__(
        self,
        tensors: list[torch.Tensor | None],
        lease_ids: list[int],
        release: ReleaseFn,
    ) -> None:
        self.tensors = tensors
        self.lease_ids = lease_ids
        self.released = not lease_ids
        self._release = release

    def __getitem__(self, index: int) -> torch.Tensor | None:  # type: ignore[override]
        return self.tensors[index]

    def __len__(self) -> int:
        return len(self.tensors)

    def __iter__(self) -> Iterator[torch.Tensor | None]:
        return iter(self.tensors)

    async def release(self) -> None:
        """End the leases (once; later calls do nothing).

        Raises:
            LeaseExpired: a lease had ended before (the views may have shown reused
                memory: read again).
        """
        if not self.released:
            self.released = True
            check_ended(await self._release(self.lease_ids), self.lease_ids)

    async def __aenter__(self) -> list[torch.Tensor | None]:
        return self.tensors

    async def __aexit__(self, exc_type: object, *exc: object) -> None:
        try:
            await self.release()
        except LeaseExpired:
            if exc_type is None:  # do not hide the exception that is already leaving
                raise
