"""A put's body read with an idle timeout (``put_idle_timeout_s``), on every transport.

A put holds its pages FILLING from its header to its last byte. A client that sends the
header and then nothing, or trickles bytes, would hold them for as long as its connection
lives; each wait for the next message is bounded instead, and the put fails with
``IdleTimeout`` (its handle aborts: the pages are freed, nothing becomes visible).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator
from typing import TypeVar

from embcache.errors import IdleTimeout

T = TypeVar("T")


async def idle_limited(messages: AsyncIterable[T], timeout_s: float) -> AsyncIterator[T]:
    """``messages``, failing with IdleTimeout when one takes longer than ``timeout_s``."""
    it = aiter(messages)
    while True:
        try:
            async with asyncio.timeout(timeout_s):
                message = await anext(it)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise IdleTimeout(
                "the put received nothing for put_idle_timeout_s and was aborted",
                put_idle_timeout_s=timeout_s,
            ) from None
        yield message
