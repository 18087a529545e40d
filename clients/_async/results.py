"""The result of ``get``: tensors, and the leases that keep them valid.

Zero-copy views read the daemon's pages directly, so the pages must not be reused while any
view of them is alive: each hit holds a lease, and a view's lease ends only once its block
has ended *and* its last view is gone (``core/views.py``); a copy's ends with the block.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from embcache.clients._backends.async_io import ReleaseFn
from embcache.clients.core.replies import check_ended
from embcache.clients.core.views import ViewLeases
from embcache.errors import LeaseExpired


class AsyncLeasedTensors(Sequence[torch.Tensor | None]):
    """Tensors (None for misses) plus their leases: the result of ``client.get``.

    ``with client.get(keys) as tensors:`` (``async with`` on the asyncio client) gives the
    list and ends the block's hold on the leases on exit; ``release()`` does it by hand. A
    tensor kept after that keeps its bytes for as long as you hold it (or any tensor made
    from it): the lease of a view ends when its last view is gone, and the client renews it
    until then. Writing into a host view changes only your tensor (copy-on-write); the
    views of ``get(..., zero_copy=True)`` are the device pool itself: read them only.

    What the views showed is the entry's bytes only if the leases were alive meanwhile (a
    lease that ended by force, e.g. because this process was stopped past its TTL, may let
    the daemon reuse the pages unless it kept them for this process). ``release()`` checks
    that: if any lease of the block had already ended it raises ``LeaseExpired``, and the
    data read through the views must be discarded. ``client.renew(leased.lease_ids)``
    answering fewer than were held is the same signal without releasing.
    """

    def __init__(
        self,
        tensors: list[torch.Tensor | None],
        lease_ids: list[int],
        release: ReleaseFn,
        views: ViewLeases | None = None,
        anchors: Sequence[Any] = (),
        post: Callable[[list[int]], bool] | None = None,
    ) -> None:
        self.tensors = tensors
        self.lease_ids = lease_ids
        self.released = not lease_ids
        self._release = release
        self._views = views  # the client's table of leases held by views
        self._anchors = tuple(anchors)  # held until the block ends (core/views.py)
        # Given where the tensors are copies: ``post(ids)`` queues their release to ride with
        # the next call instead of waiting for the daemon's count, and says whether it did
        # (it does only when the copies were surely complete while the leases lived, by
        # the client's own estimate of their expiry).
        self._post = post

    def __getitem__(self, index: int) -> torch.Tensor | None:  # type: ignore[override]
        return self.tensors[index]

    def __len__(self) -> int:
        return len(self.tensors)

    def __iter__(self) -> Iterator[torch.Tensor | None]:
        return iter(self.tensors)

    async def release(self, *, now: bool = False) -> None:
        """End the block's hold on the leases (once; later calls do nothing): the leases of
        copies and of views that are gone end now, the others once their last view is gone.

        Args:
            now: end every lease at once, views or not, as a caller that reads none of
                them any more may (a view read afterwards may show reused memory).

        Raises:
            LeaseExpired: a lease had ended before (the views may have shown reused
                memory: read again).
        """
        if self.released:
            return
        self.released = True
        ids, lost = self.lease_ids, 0
        if self._views is not None and now:
            self._views.forget(ids)
        elif self._views is not None:
            ids, lost = self._views.end_block(ids)
        self._anchors = ()  # views that are gone already end their leases now
        if ids and self._post is not None and not now and not lost and self._post(ids):
            return  # copies only (the views' leases end with their last tensor)
        ended = await self._release(ids) if ids else 0
        check_ended(ended, ids, lost)

    async def __aenter__(self) -> list[torch.Tensor | None]:
        return self.tensors

    async def __aexit__(self, exc_type: object, *exc: object) -> None:
        try:
            await self.release()
        except LeaseExpired:
            if exc_type is None:  # do not hide the exception that is already leaving
                raise
