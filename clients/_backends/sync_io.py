"""The blocking flavour of the client's I/O primitives (``async_io`` is the asyncio one).

The generated ``_sync`` client imports these names where the ``_async`` source imports the
same names from ``async_io``.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from embcache.clients.core import channel

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])

Lock = threading.Lock
sleep = time.sleep
log = logging.getLogger("embcache.client")


def run_blocking(fn: Callable[..., T], *args: Any) -> T:
    """Blocking work (a device sync): the blocking client just does it."""
    return fn(*args)


# ``fn(metadata, timeout)``: one attempt of a call, as the client's retry loop runs it.
CallFn = Callable[[Any, float], T]
# ends leases, answers how many ended (what LeasedTensors calls on release)
ReleaseFn = Callable[[list[int]], object]


# ``(channel, stub, put, get_bytes)`` on a blocking ``grpc`` channel (``core.channel.connect``)
connect = functools.partial(channel.connect, aio=False)


def leased_call(fn: F) -> F:
    """``get`` as it is: the leased tensors it returns are the context manager."""
    return fn


class Pump:
    """A daemon thread that runs ``work()`` again after the seconds it returns (None: not
    before the next :meth:`poke`; below 0: never again). Started by the first poke; an
    error in one round is logged and the next round comes a second later.

    A poke wakes the thread only when it sleeps without a deadline: while it has a round
    due (views are held, so rounds come every ``POLL_S`` at most) the poke is left to that
    round. Waking it on every get cost the caller about 0.3 ms on a 2-core machine (the
    woken thread takes the GIL and runs its round on the caller's path)."""

    def __init__(self, work: Callable[[], float | None], name: str) -> None:
        self._work = work
        self._name = name
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._stopped = False
        self._pokes = 0  # pokes so far; a round that ends idle runs again if any came
        self._timed = True  # in a round, or asleep until a deadline: pokes need no wake

    def poke(self) -> None:
        """Run a round soon (from any thread; starts the thread the first time)."""
        with self._lock:
            if self._stopped:
                return
            self._pokes += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            wake = not self._timed
        if wake:
            self._wake.set()

    def _run(self) -> None:
        while not self._stopped:
            self._wake.clear()
            with self._lock:
                seen, self._timed = self._pokes, True
            try:
                delay = self._work()
            except Exception:
                log.warning("%s: a round failed; again in a second", self._name, exc_info=True)
                delay = 1.0
            if delay is not None and delay < 0:
                self._stopped = True
                return
            with self._lock:
                if delay is None and self._pokes != seen:
                    delay = 0.0  # poked during the round: another one
                self._timed = delay is not None
            if not self._stopped:
                self._wake.wait(delay)

    def stop(self) -> None:
        """Stop for good, after the round in progress (waits up to 5 s for it)."""
        with self._lock:
            self._stopped = True
            thread = self._thread
        self._wake.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)
