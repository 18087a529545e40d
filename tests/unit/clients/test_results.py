"""Leased tensors (clients/_async/results.py and the generated blocking twin): a release
reports leases that had ended before it, and never hides an exception already leaving."""

from __future__ import annotations

import asyncio

import pytest
import torch

from embcache.clients import AsyncLeasedTensors, LeasedTensors
from embcache.errors import LeaseExpired


def test_release_reports_leases_that_ended_early() -> None:
    t = [torch.zeros(2)]
    ok = LeasedTensors(t, [1, 2], lambda ids: 2)
    with ok as tensors:
        assert tensors is t
    assert ok.released
    stale = LeasedTensors(t, [1, 2], lambda ids: 1)  # one lease had expired: views were stale
    with pytest.raises(LeaseExpired) as info, stale:
        pass
    assert info.value.details == {"held": 2, "released": 1}
    stale.release()  # idempotent: the error is reported once

    # while another exception is leaving the block, it is not hidden by LeaseExpired
    with pytest.raises(KeyError), LeasedTensors(t, [1], lambda ids: 0):
        raise KeyError("boom")


def test_the_asyncio_twin_reports_the_same() -> None:
    t = [torch.zeros(2)]

    async def ended(n: int) -> int:
        return n

    async def main() -> None:
        ok = AsyncLeasedTensors(t, [1, 2], lambda ids: ended(2))
        async with ok as tensors:
            assert tensors is t
        assert ok.released
        stale = AsyncLeasedTensors(t, [1, 2], lambda ids: ended(1))
        with pytest.raises(LeaseExpired) as info:
            async with stale:
                pass
        assert info.value.details == {"held": 2, "released": 1}
        await stale.release()  # idempotent
        with pytest.raises(KeyError):
            async with AsyncLeasedTensors(t, [1], lambda ids: ended(0)):
                raise KeyError("boom")

    asyncio.run(main())


def test_a_post_that_declines_falls_back_to_a_counted_release() -> None:
    """``post`` queues copies' releases for the next call; when it declines (a copy not
    surely complete while its lease lived), the block's end releases now and reports a
    lease that had ended."""
    t = [torch.zeros(2)]
    queued: list[list[int]] = []
    released: list[list[int]] = []

    def release(ids: list[int]) -> int:
        released.append(ids)
        return len(ids) - 1  # one had ended

    def post(ids: list[int]) -> bool:
        queued.append(ids)
        return True

    with LeasedTensors(t, [1, 2], release, post=post):
        pass
    assert queued == [[1, 2]] and released == []  # rides with the next call
    with pytest.raises(LeaseExpired), LeasedTensors(t, [3, 4], release, post=lambda ids: False):
        pass
    assert released == [[3, 4]]
    now = LeasedTensors(t, [5], lambda ids: released.append(ids) or 1, post=post)
    now.release(now=True)  # an explicit release(now=True) never rides
    assert released[-1] == [5] and queued == [[1, 2]]
