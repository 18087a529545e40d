"""Busy polling: the daemon's event loop stays awake for a short window after each call.

A latency-bound call pays for the loop's wake-up (the loop thread asleep in ``epoll_wait``,
its core idle and its caches cold) on top of its own work. While the window is open a task
yields to the loop again and again (``asyncio.sleep(0)``), so the loop polls its sockets
without sleeping and the next call of a burst is picked up at once, on a hot core. Outside
the window the task waits on an event and the loop sleeps as usual: an idle daemon costs no
CPU, a busy one at most the loop's core. (Low-latency data planes such as NCCL proxies and
RDMA transfer engines poll the same way; here it is bounded by the window.)

The polling step holds the GIL but for the loop's ``select(0)``, so polling stops while any
work runs in the loop's worker threads (``asyncio.to_thread``: get_into, large device-put
batches, long copy waits), which need the GIL: the loop's default executor counts them.

The step never sleeps: a variant that slept briefly per step was slower than no polling at
all. What polling gains and costs is in docs/operators.md ("CPU placement").
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any


class BusyPoll:
    """Keeps the running loop polling for ``window_s`` after each :meth:`poke` (0: never)."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._until = 0.0
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._threads = 0  # jobs running in the loop's worker threads
        self._threads_lock = threading.Lock()
        self.spins = 0  # loop iterations spent polling (for tests and curiosity)

    @property
    def enabled(self) -> bool:
        """False for a window of 0 (never polls)."""
        return self.window_s > 0

    @property
    def polling(self) -> bool:
        """True while the window is open."""
        return time.monotonic() < self._until

    @property
    def threads(self) -> int:
        """Jobs running in the loop's worker threads now (polling waits for none)."""
        return self._threads

    def start(self) -> None:
        """Start the polling task on the running loop (a no-op when disabled); the loop's
        default executor becomes one that tells this object when its jobs run."""
        if self.enabled and self._task is None:
            loop = asyncio.get_running_loop()
            loop.set_default_executor(_CountingExecutor(self._thread_count))
            self._wake = asyncio.Event()
            self._task = loop.create_task(self._run(), name="busy-poll")

    def _thread_count(self, delta: int) -> None:
        with self._threads_lock:
            self._threads += delta

    def poke(self) -> None:
        """A call arrived: open (or extend) the window. Call it on the loop's thread."""
        if self._wake is None:
            return
        self._until = time.monotonic() + self.window_s
        if not self._wake.is_set():
            self._wake.set()

    async def _run(self) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            while not self._threads and time.monotonic() < self._until:
                self.spins += 1
                await asyncio.sleep(0)
            self._wake.clear()

    async def stop(self) -> None:
        """Cancel the polling task (the server stops)."""
        task, self._task, self._wake = self._task, None, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


class _CountingExecutor(concurrent.futures.ThreadPoolExecutor):
    """The loop's default executor, reporting each job's start (+1) and end (-1)."""

    def __init__(self, count: Callable[[int], None]) -> None:
        super().__init__(thread_name_prefix="embcache-worker")
        self._count = count

    def submit(
        self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future[Any]:
        self._count(1)
        try:
            future = super().submit(fn, *args, **kwargs)
        except BaseException:
            self._count(-1)
            raise
        future.add_done_callback(lambda _: self._count(-1))
        return future
