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
