"""The one get-to-device flow of every transport (gRPC, the session socket, REST).

A device get takes the engine's lock only to pin, place and lease (queuing the copies is
cheap), then waits for the copies without blocking the event loop: polled between the loop's
other callbacks when they are expected to be short, in a worker thread otherwise. The reply
is rendered while the copies run (it says where the bytes will be), and leaves once they are
complete, or at once with an interprocess event for a client that waits on the GPU. After the
reply is on its way, the pool's housekeeping (free reserve, page-table updates) runs from a
loop callback, off the call's critical path. A call that fails or is cancelled gives back
the leases it took.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from embcache.errors import UnknownSession
from embcache.service.device.pending_get import DeviceLease, PendingGet
from embcache.service.engine import CacheEngine
from embcache.service.engine.device_into import PendingInto
from embcache.service.engine.device_puts import PendingPut

log = logging.getLogger("embcache.transport")

R = TypeVar("R")
T = TypeVar("T")

# Copies expected to take longer than this are waited for in a worker thread; shorter ones
# are polled on the loop, which answers sooner than a thread hand-off (docs/grpc.md).
SPIN_S = 0.01
SPIN_RATE = 20e9  # bytes/s assumed for that estimate (below a host->device copy's rate)


async def get_to_device(
    engine: CacheEngine,
    keys: Sequence[str],
    owner: str,
    device: int,
    *,
    ttl_s: float | None,
    render: Callable[[list[DeviceLease | None]], R],
    housekeeping: Housekeeping,
    ready_event: bool = False,
    alive: Callable[[str], bool] | None = None,
) -> tuple[R, bytes | None]:
    """Lease ``keys`` in device pool ``device`` and return ``render(results)`` once the
    copies are complete, or at once with the handle of an event that fires then
    (``ready_event``, on a GPU). ``alive(owner)`` False after the wait (the session ended
    meanwhile) fails the call with UnknownSession, so no lease outlives its session."""
    if engine.fetches_misses:  # the shared tier may wait on the network
        await asyncio.to_thread(engine.fill_misses, list(keys))
    pending = engine.device.start_get(
        keys, owner, ttl_s=ttl_s, device=device, fill_misses=False, defer_tables=True
    )
    try:
        reply = render(pending.results)  # built while the bytes are copied
        event = engine.device.ready_event(pending, device) if ready_event else None
        if event is not None:
            observe_later(pending)
        else:
            await wait_copies(pending)
        if alive is not None and not alive(owner):
            raise UnknownSession("session ended during the call", session=owner)
        return reply, event
    except BaseException:
        engine.release(d.lease.lease_id for d in pending.results if d is not None)
        raise
    finally:
        housekeeping.later(device)


class Housekeeping:
    """Runs each pool's housekeeping once the reply is on its way (a loop callback runs
    after the current task's step, in which the reply is sent), with one call pending per
    pool however many gets finished meanwhile."""

    def __init__(self, engine: CacheEngine) -> None:
        self._engine = engine
        self._waiting: set[int] = set()  # pools with a call scheduled

    def later(self, device: int) -> None:
        """Schedule pool ``device``'s housekeeping on the running loop (once while pending)."""
        if device in self._waiting:
            return
        self._waiting.add(device)
        asyncio.get_running_loop().call_soon(self._run, device)

    def _run(self, device: int) -> None:
        self._waiting.discard(device)
        try:
            self._engine.device.housekeeping(device)
        except Exception:  # a closed engine, a pool out of service: the next get says so
            log.debug("device housekeeping of pool %d failed", device, exc_info=True)


async def wait_copies(pending: PendingGet | PendingPut | PendingInto) -> None:
    """Wait for a get's (a put's, a get-into's) copies without blocking the loop
    (:func:`poll_until`); copies expected to take longer than ``SPIN_S`` go straight to a
    worker thread."""
    spin = SPIN_S if pending.loaded_bytes / SPIN_RATE < SPIN_S else 0.0
    await poll_until(pending.done, pending.wait, spin)


async def poll_until(
    done: Callable[[], bool], wait: Callable[[], object], spin_s: float | None = None
) -> None:
    """Until ``done()``: polled between the loop's other callbacks for up to ``spin_s``
    (default ``SPIN_S``), then ``wait()`` in a worker thread."""
    if done():
        return
    give_up = time.perf_counter() + (SPIN_S if spin_s is None else spin_s)
    while time.perf_counter() < give_up:
        await asyncio.sleep(0)
        if done():
            return
    await asyncio.to_thread(wait)


def observe_later(pending: PendingGet, period_s: float = 0.001, limit_s: float = 10.0) -> None:
    """Poll a get's copies from loop timers until they are done, so its copy time reaches
    the metrics even though nobody waits for it (a reply sent with a ready event)."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + limit_s

    def poll() -> None:
        try:
            done = pending.done()
        except RuntimeError as exc:  # a device error: the pool's next call takes it out
            log.warning("a device get's copy failed after its reply: %s", exc)
            return
        if not done and loop.time() < give_up:
            loop.call_later(period_s, poll)

    loop.call_later(period_s, poll)


async def in_thread(fn: Callable[[], T], undo: Callable[[T], object] | None = None) -> T:
    """``fn()`` in a worker thread. If the call is cancelled meanwhile, ``undo(result)`` runs
    when the thread finishes (e.g. to give back leases nobody will receive)."""
    task = asyncio.ensure_future(asyncio.to_thread(fn))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        if undo is not None:

            def done(t: asyncio.Future[T]) -> None:
                if not t.cancelled() and t.exception() is None:
                    undo(t.result())

            task.add_done_callback(done)
        raise
