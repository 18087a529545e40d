"""The session's waiters: FIFO hand-off, and cancelled waiters that leave in O(1)."""

from __future__ import annotations

import asyncio

from embcache.service.transport.session.waiters import FifoLock, Gate


def test_fifo_lock_hands_over_in_order_and_past_cancelled_waiters() -> None:
    async def run() -> list[int]:
        lock, order = FifoLock(), []

        async def take(i: int) -> None:
            async with lock:
                order.append(i)
                await asyncio.sleep(0)

        await lock.acquire()
        tasks = [asyncio.ensure_future(take(i)) for i in range(5)]
        await asyncio.sleep(0)
        tasks[1].cancel()
        tasks[3].cancel()
        lock.release()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert not lock._locked  # free again once every waiter is done
        return order

    assert asyncio.run(run()) == [0, 2, 4]


def test_a_waiter_cancelled_as_it_is_handed_the_lock_passes_it_on() -> None:
    async def run() -> bool:
        lock = FifoLock()
        await lock.acquire()
        first = asyncio.ensure_future(lock.acquire())
        second = asyncio.ensure_future(lock.acquire())
        await asyncio.sleep(0)
        lock.release()  # handed to first...
        first.cancel()  # ...which is cancelled before it runs
        await asyncio.gather(first, return_exceptions=True)
        await asyncio.wait_for(second, 1)  # second got it
        return second.done() and not second.cancelled()

    assert asyncio.run(run())


def test_gate_wakes_its_waiters_when_it_opens() -> None:
    async def run() -> int:
        gate, woke = Gate(), []
        gate.shut()

        async def wait(i: int) -> None:
            await gate.wait()
            woke.append(i)

        tasks = [asyncio.ensure_future(wait(i)) for i in range(4)]
        await asyncio.sleep(0)
        tasks[0].cancel()
        assert woke == []
        gate.open()
        await asyncio.gather(*tasks, return_exceptions=True)
        return len(woke)

    assert asyncio.run(run()) == 3
