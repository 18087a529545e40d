"""What a session's calls wait on, built so that cancelling n waiters costs O(n).

``asyncio.Lock`` and ``asyncio.Event`` take a cancelled waiter out of their queue with
``deque.remove``, O(n) each: tearing down a session with n calls queued on its writer cost
O(n²) on the loop every transport shares (22 s at 60,000 calls). Here every waiter awaits
a future of its own, which cancelling it cancels, and the queue skips cancelled ones when it
gets to them.
"""

from __future__ import annotations

import asyncio
from collections import deque


class FifoLock:
    """Mutual exclusion in arrival order, as ``asyncio.Lock`` (module docstring)."""

    def __init__(self) -> None:
        self._locked = False
        self._waiters: deque[asyncio.Future[None]] = deque()

    async def __aenter__(self) -> None:
        await self.acquire()

    async def __aexit__(self, *exc: object) -> None:
        self.release()

    async def acquire(self) -> None:
        if not self._locked:
            self._locked = True
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # handed the lock as it was cancelled: pass it on
            raise

    def release(self) -> None:
        """Hand the lock to the first waiter still waiting, or unlock."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # it holds the lock now
                return
        self._locked = False


class Gate:
    """Open or shut; :meth:`wait` returns once it is open (module docstring)."""

    def __init__(self) -> None:
        self.is_open = True
        self._waiters: deque[asyncio.Future[None]] = deque()

    def shut(self) -> None:
        self.is_open = False

    def open(self) -> None:
        """Open, and wake every waiter."""
        self.is_open = True
        waiters, self._waiters = self._waiters, deque()
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def wait(self) -> None:
        while not self.is_open:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            await waiter
