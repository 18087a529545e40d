"""The asyncio flavour of the client's I/O primitives (``sync_io`` is the blocking one).

The ``_async`` client imports these names; the ``_sync`` client generated from it imports the
same names from ``sync_io``. grpc.aio objects belong to the event loop that made them, so an
asyncio client is made on the loop that uses it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable, Generator
from typing import TYPE_CHECKING, Any, Generic, ParamSpec, Protocol, TypeVar

from embcache.clients.core import channel

if TYPE_CHECKING:
    import torch

T = TypeVar("T")
P = ParamSpec("P")

Lock = asyncio.Lock
sleep = asyncio.sleep
run_blocking = asyncio.to_thread  # blocking work (a device sync) off the event loop
log = logging.getLogger("embcache.client")

# ``fn(metadata, timeout)``: one attempt of a call, as the client's retry loop runs it.
CallFn = Callable[[Any, float], Awaitable[T]]
# ends leases, answers how many ended (what AsyncLeasedTensors awaits on release)
ReleaseFn = Callable[[list[int]], Awaitable[object]]


# ``(channel, stub, put, get_bytes)`` on a ``grpc.aio`` channel (``core.channel.connect``)
connect = functools.partial(channel.connect, aio=True)


class Pump:
    """A task on the client's loop that runs ``work()`` again after the seconds it returns
    (None: not before the next :meth:`poke`; below 0: never again). Started by the first
    poke; an error in one round is logged and the next round comes a second later. A poke
    wakes the task only when it sleeps without a deadline (``sync_io.Pump`` says why)."""

    def __init__(self, work: Callable[[], Awaitable[float | None]], name: str) -> None:
        self._work = work
        self._name = name
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._stopped = False
        self._pokes = 0  # pokes so far; a round that ends idle runs again if any came
        self._timed = True  # in a round, or asleep until a deadline: pokes need no wake

    def poke(self) -> None:
        """Run a round soon (on the running loop; starts the task the first time)."""
        if self._stopped:
            return
        self._pokes += 1
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name=self._name)
        if not self._timed:
            self._wake.set()

    async def _run(self) -> None:
        while not self._stopped:
            self._wake.clear()
            seen, self._timed = self._pokes, True
            try:
                delay = await self._work()
            except Exception:
                log.warning("%s: a round failed; again in a second", self._name, exc_info=True)
                delay = 1.0
            if delay is not None and delay < 0:
                self._stopped = True
                return
            if delay is None and self._pokes != seen:
                delay = 0.0  # poked during the round: another one
            self._timed = delay is not None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), delay)

    async def stop(self) -> None:
        """Stop for good, after the round in progress (cancelled if it takes over 5 s)."""
        self._stopped = True
        self._wake.set()
        task = self._task
        if task is None or task is asyncio.current_task() or task.done():
            return
        try:
            await asyncio.wait_for(asyncio.shield(task), 5.0)
        except TimeoutError:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


class Leases(Protocol):
    """What :class:`LeasedCall` needs of the leased tensors a ``get`` returns."""

    async def __aenter__(self) -> list[torch.Tensor | None]: ...
    async def __aexit__(self, exc_type: object, *exc: object) -> None: ...


L = TypeVar("L", bound=Leases)


class LeasedCall(Generic[L]):
    """What the asyncio client's ``get`` returns: ``await`` it for the leased tensors, or
    ``async with`` it for their list (the leases end when the block does), as the blocking
    client's ``with client.get(keys) as tensors:``."""

    def __init__(self, run: Callable[[], Awaitable[L]]) -> None:
        self._run = run
        self._leased: L | None = None

    def __await__(self) -> Generator[Any, None, L]:
        return self._run().__await__()

    async def __aenter__(self) -> list[torch.Tensor | None]:
        self._leased = await self._run()
        return await self._leased.__aenter__()

    async def __aexit__(self, exc_type: object, *exc: object) -> None:
        if self._leased is not None:
            await self._leased.__aexit__(exc_type, *exc)


def leased_call(fn: Callable[P, Awaitable[L]]) -> Callable[P, LeasedCall[L]]:
    """``get`` made usable both ways: awaited, or as an async context manager."""

    @functools.wraps(fn)
    def call(*args: P.args, **kwargs: P.kwargs) -> LeasedCall[L]:
        return LeasedCall(lambda: fn(*args, **kwargs))

    return call
