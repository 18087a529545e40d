"""Busy polling of the daemon's loop after calls (``service/transport/busy_poll.py``)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from embcache.clients import EmbCacheClient
from embcache.service.transport.grpc.busy_poll import BusyPoll


def test_polls_only_inside_the_window() -> None:
    async def main() -> None:
        busy = BusyPoll(0.05)
        busy.start()
        await asyncio.sleep(0.05)
        assert busy.spins == 0 and not busy.polling  # idle: the task waits, nothing spins
        busy.poke()
        assert busy.polling
        await asyncio.sleep(0.01)  # the loop keeps running other work while polling
        assert busy.spins > 0
        await asyncio.sleep(0.1)
        assert not busy.polling
        spun = busy.spins
        await asyncio.sleep(0.05)
        assert busy.spins == spun  # the window closed: the loop sleeps again
        busy.poke()  # a later call opens it again
        await asyncio.sleep(0.01)
        assert busy.spins > spun
        await busy.stop()
        busy.poke()  # harmless once stopped

    asyncio.run(main())


def test_a_zero_window_never_polls() -> None:
    async def main() -> None:
        busy = BusyPoll(0.0)
        busy.start()
        busy.poke()
        assert not busy.enabled and not busy.polling
        await asyncio.sleep(0.02)
        assert busy.spins == 0
        await busy.stop()

    asyncio.run(main())


def test_window_extends_with_each_poke() -> None:
    async def main() -> None:
        busy = BusyPoll(0.04)
        busy.start()
        busy.poke()
        end = time.monotonic() + 0.1
        while time.monotonic() < end:  # calls keep coming: the window never closes
            busy.poke()
            await asyncio.sleep(0.01)
            assert busy.polling
        await asyncio.sleep(0.08)
        assert not busy.polling
        await busy.stop()

    asyncio.run(main())


def test_polling_pauses_while_worker_threads_run() -> None:
    """Worker threads need the GIL that a polling loop holds: no polling while one runs."""

    async def main() -> None:
        busy = BusyPoll(1.0)
        busy.start()
        release = threading.Event()
        job = asyncio.ensure_future(asyncio.to_thread(release.wait, 5.0))
        await asyncio.sleep(0.01)
        assert busy.threads == 1
        busy.poke()  # a call arrives while the job runs
        await asyncio.sleep(0.02)
        spun = busy.spins
        await asyncio.sleep(0.05)
        assert busy.spins == spun  # paused although the window is open
        release.set()
        assert await job
        assert busy.threads == 0
        busy.poke()
        await asyncio.sleep(0.01)
        assert busy.spins > spun  # the next call polls again
        await busy.stop()

    asyncio.run(main())


def test_failed_submissions_are_not_counted() -> None:
    async def main() -> None:
        busy = BusyPoll(1.0)
        busy.start()
        loop = asyncio.get_running_loop()
        await asyncio.to_thread(int, "1")
        assert busy.threads == 0
        with pytest.raises(ValueError):
            await asyncio.to_thread(int, "x")  # a job that raises ends too
        assert busy.threads == 0
        await loop.shutdown_default_executor()
        with pytest.raises(RuntimeError):
            await asyncio.to_thread(int, "1")  # refused after shutdown: never started
        assert busy.threads == 0
        await busy.stop()

    asyncio.run(main())


@pytest.mark.parametrize("session_calls", [True, False])
def test_server_calls_open_the_window(counting_server, session_calls: bool) -> None:  # type: ignore[no-untyped-def]
    _, thread = counting_server
    busy = thread.service.servicer.busy
    assert busy.enabled  # on by default
    with EmbCacheClient(f"unix:{thread.service.socket_path}", timeout=10) as client:
        client.put("k", torch.arange(10))
        time.sleep(busy.window_s * 2 + 0.05)
        before = busy.spins
        session = client._conn.open_session()
        session.serves_calls = session_calls  # False: the unary Get and Release RPCs
        with client.get(["k"]) as (got,):
            assert torch.equal(got, torch.arange(10))
        deadline = time.monotonic() + 5
        while busy.spins == before and time.monotonic() < deadline:
            time.sleep(0.001)
        assert busy.spins > before
