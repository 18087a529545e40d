"""The blocking flavour of the client's I/O primitives (``async_io`` is the asyncio one).

The generated ``_sync`` client imports these names where the ``_async`` source imports the
same names from ``async_io``.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from embcache.clients.core import channel

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])

Lock = threading.Lock
sleep = time.sleep

# ``fn(metadata, timeout)``: one attempt of a call, as the client's retry loop runs it.
CallFn = Callable[[Any, float], T]
# ends leases, answers how many ended (what LeasedTensors calls on release)
ReleaseFn = Callable[[list[int]], object]


# ``(channel, stub, put)`` on a blocking ``grpc`` channel (``core.channel.connect``)
connect = functools.partial(channel.connect, aio=False)


def leased_call(fn: F) -> F:
    """``get`` as it is: the leased tensors it returns are the context manager."""
    return fn
