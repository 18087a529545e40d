"""The asyncio flavour of the client's I/O primitives (``sync_io`` is the blocking one).

The ``_async`` client imports these names; the ``_sync`` client generated from it imports the
same names from ``sync_io``. grpc.aio objects belong to the event loop that made them, so an
asyncio client is made on the loop that uses it.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Generator
from typing import TYPE_CHECKING, Any, Generic, ParamSpec, Protocol, TypeVar

from embcache.clients.core import channel

if TYPE_CHECKING:
    import torch

T = TypeVar("T")
P = ParamSpec("P")

Lock = asyncio.Lock
sleep = asyncio.sleep

# ``fn(metadata, timeout)``: one attempt of a call, as the client's retry loop runs it.
CallFn = Callable[[Any, float], Awaitable[T]]
# ends leases, answers how many ended (what AsyncLeasedTensors awaits on release)
ReleaseFn = Callable[[list[int]], Awaitable[object]]


# ``(channel, stub, put)`` on a ``grpc.aio`` channel (``core.channel.connect``)
connect = functools.partial(channel.connect, aio=True)


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
