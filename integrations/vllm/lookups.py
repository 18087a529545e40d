"""The scheduler's daemon calls, off the scheduler loop: lookups, releases, renewals.

vLLM's scheduler runs its hooks inline, so a call that waits on the daemon there stalls
every request, text-only ones included. On the daemon's node most lookups need no call: the
daemon's read table (docs/same_node_reads.md) lists an entry's dtype and shape, read inline
in microseconds with nothing held. Everything else goes to one background thread that makes
every call; the scheduler asks and reads answers that are there, and a lookup not answered
in time is a miss. A circuit breaker turns the plugin into "always miss" while the daemon is unwell:
it opens after ``breaker_failures`` failed calls in a row, or as soon as a call has been
outstanding past its deadline (a daemon that hangs rather than refuses), and lets one
probe through every ``breaker_cooldown_s``; the probe's success closes it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from embcache.clients import EmbCacheClient
from embcache.integrations.vllm.closing import close_in_background

log = logging.getLogger("embcache.integrations.vllm")


@dataclass(frozen=True, slots=True)
class Answer:
    """What the daemon said of one key."""

    found: bool
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    lease_id: int = 0  # 0: nothing held
    error: bool = False  # the call failed (a miss that says nothing of the entry)


class Breaker:
    """Closed (calls go out), open (no calls: every lookup misses), probing (one call)."""

    def __init__(self, failures: int, cooldown_s: float, clock: Callable[[], float]) -> None:
        self._limit = failures
        self._cooldown = cooldown_s
        self._clock = clock
        self._failures = 0
        self._opened_at: float | None = None
        self.trips = 0  # times it opened

    @property
    def is_open(self) -> bool:
        """True while calls are held back."""
        return self._opened_at is not None

    def may_call(self) -> bool:
        """Whether a call may go out now (when open: once per cooldown, as a probe)."""
        if self._opened_at is None:
            return True
        if self._clock() - self._opened_at >= self._cooldown:
            self._opened_at = self._clock()  # the next probe waits a whole cooldown
            return True
        return False

    def succeeded(self) -> None:
        if self._opened_at is not None:
            log.warning("embcache daemon answers again: lookups resume")
        self._failures = 0
        self._opened_at = None

    def failed(self, why: str, *, at_once: bool = False) -> None:
        self._failures += 1
        if self._opened_at is None and (at_once or self._failures >= self._limit):
            self._opened_at = self._clock()
            self.trips += 1
            log.warning(
                "embcache daemon unwell (%s): every lookup is a miss, probing every %.0f s",
                why,
                self._cooldown,
            )


class Lookups:
    """A background thread that makes the scheduler's daemon calls.

    ``ask`` answers at once what the daemon's read table lists (on the daemon's node:
    dtype and shape, no call, no lease) and queues the other keys; the thread pins them (or
    asks ``exists``) in one call per batch and files the answers, which ``answer`` reads.
    ``release`` and ``renew`` are queued the same way. Nothing here blocks for longer than
    the caller's own wait.
    """

    def __init__(
        self,
        connect: Callable[[], EmbCacheClient],
        *,
        pin: bool,
        prefetch: bool = False,
        ttl_s: float,
        deadline_s: float,
        breaker: Breaker,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._connect = connect
        self._pin = pin
        self._prefetch = prefetch
        self._ttl_s = ttl_s
        self._deadline_s = deadline_s
        self.breaker = breaker
        self._clock = clock
        self._client: EmbCacheClient | None = None
        self._cv = threading.Condition()
        self._asked: list[str] = []
        self._asked_set: set[str] = set()
        self._releases: list[int] = []
        self._renewals: list[int] = []
        self._answers: dict[str, Answer] = {}
        self._unwanted: set[str] = set()  # forgotten while asked: dropped on arrival
        self._busy_since: float | None = None  # when the call now outstanding went out
        self._closed = False
        self._thread: threading.Thread | None = None
        self.counts: dict[str, int] = {}

    # -- the scheduler's side ------------------------------------------------------------
    def ask(self, keys: Sequence[str]) -> None:
        """Queue lookups of ``keys`` not asked or answered yet (a miss at once while the
        breaker is open)."""
        self._check_hung()
        with self._cv:
            self._unwanted.difference_update(keys)  # wanted again after all
            fresh = [k for k in keys if k not in self._asked_set and k not in self._answers]
            if not fresh:
                return
            if self.breaker.is_open and not self._probe_due():
                for k in fresh:
                    self._answers[k] = Answer(False, error=True)
                self._count("lookup_errors", len(fresh))
                return
            fresh = self._answer_listed(fresh)
            if not fresh:
                return
            self._asked.extend(fresh)
            self._asked_set.update(fresh)
            self._start()
            self._cv.notify_all()

    def _answer_listed(self, keys: list[str]) -> list[str]:
        """Lock held: answer at once, with no call, the keys the daemon's read table lists
        (on its node, once the client has a session); returns the keys left to ask."""
        client = self._client
        if client is None or self.breaker.is_open:
            return keys  # not connected yet, or the daemon is unwell: the calls decide
        try:
            listed = client.describe_listed(keys)
        except Exception as exc:  # the call path then says what is wrong
            log.debug("embcache table lookup: %s: %s", type(exc).__name__, exc)
            return keys
        if listed is None:
            return keys
        left = []
        for key, entry in zip(keys, listed, strict=True):
            if entry is None:
                left.append(key)
            else:  # nothing held: an eviction before staging is a failed staging
                self._answers[key] = Answer(True, entry.dtype, tuple(entry.shape))
        return left

    def _probe_due(self) -> bool:
        return self._busy_since is None and self.breaker.may_call()

    def answer(self, key: str) -> Answer | None:
        """The answer for ``key`` (None: not answered yet)."""
        with self._cv:
            return self._answers.get(key)

    def wait(self, keys: Sequence[str], budget_s: float) -> None:
        """Wait up to ``budget_s`` for answers to ``keys`` (never while the breaker is open)."""
        if budget_s <= 0 or self.breaker.is_open:
            return
        end = self._clock() + budget_s
        with self._cv:
            while any(k not in self._answers for k in keys) and not self.breaker.is_open:
                left = end - self._clock()
                if left <= 0:
                    return
                self._cv.wait(left)

    def forget(self, key: str) -> Answer | None:
        """Drop the answer for ``key`` (the next ``ask`` looks it up again); the answer of
        a lookup still under way is dropped as it arrives, its lease released."""
        with self._cv:
            if key in self._asked_set:
                self._unwanted.add(key)
            return self._answers.pop(key, None)

    def release(self, lease_ids: Sequence[int]) -> None:
        """End leases, in the background."""
        ids = [i for i in lease_ids if i]
        if not ids:
            return
        with self._cv:
            self._releases.extend(ids)
            self._start()
            self._cv.notify_all()

    def renew(self, lease_ids: Sequence[int]) -> None:
        """Renew leases, in the background."""
        with self._cv:
            self._renewals.extend(i for i in lease_ids if i)
            self._start()
            self._cv.notify_all()

    def take_counts(self) -> dict[str, int]:
        """Errors and breaker trips since the last call."""
        self._check_hung()
        with self._cv:
            taken, self.counts = self.counts, {}
        return taken

    def _check_hung(self) -> None:
        """A call outstanding past its deadline opens the breaker (the daemon hangs)."""
        with self._cv:
            since = self._busy_since
            hung = since is not None and self._clock() - since > self._deadline_s
            if hung and not self.breaker.is_open:
                self.breaker.failed("a call is past its deadline", at_once=True)
                self._count("breaker_trips")
                self._cv.notify_all()

    def close(self, timeout: float = 5.0) -> None:
        """Release what is queued (bounded by ``timeout``), stop the thread, close."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("embcache lookup thread still waits on the daemon at shutdown")
                return  # it closes its client itself when the call returns
        if self._client is not None:
            self._close_client()

    # -- the thread ----------------------------------------------------------------------
    def _start(self) -> None:
        if self._thread is None and not self._closed:
            self._thread = threading.Thread(target=self._run, name="embcache-lookups", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not (self._asked or self._releases or self._renewals or self._closed):
                    self._cv.wait()
                keys, self._asked = self._asked, []
                releases, self._releases = self._releases, []
                renewals, self._renewals = self._renewals, []
                closed = self._closed
                self._busy_since = self._clock()
            try:
                if keys:
                    self._lookup(keys)
                if renewals and not closed:
                    self._call("renew", _renew_call(renewals, self._ttl_s))
                if releases:
                    self._call("release", _release_call(releases))
            finally:
                with self._cv:
                    self._busy_since = None
                    self._asked_set.difference_update(keys)
                    self._cv.notify_all()
            if closed:
                self._close_client()
                return

    def _lookup(self, keys: list[str]) -> None:
        answers: list[Answer]
        if self._pin:
            pins = self._call("lookup", lambda c: c.pin(keys, ttl_s=self._ttl_s))
            if pins is None:
                answers = [Answer(False, error=True)] * len(keys)
            else:
                answers = [
                    Answer(False)
                    if p is None
                    else Answer(True, p.dtype, tuple(p.shape), int(p.lease_id))
                    for p in pins
                ]
        else:
            if self._prefetch:  # exists() does not fetch from the shared tier: warm first
                self._call("prefetch", lambda c: c.prefetch(keys))
            found = self._call("lookup", lambda c: c.exists(keys))
            if found is None:
                answers = [Answer(False, error=True)] * len(keys)
            else:
                answers = [Answer(bool(f)) for f in found]
        with self._cv:
            for key, a in zip(keys, answers, strict=True):
                if self._closed or key in self._unwanted:  # nobody will read it
                    self._unwanted.discard(key)
                    if a.lease_id:
                        self._releases.append(a.lease_id)
                    continue
                self._answers[key] = a
            if any(a.error for a in answers):
                self._count("lookup_errors", len(keys))

    def _call(self, what: str, fn: Callable[[EmbCacheClient], Any]) -> Any:
        """``fn(client)``; any failure (even a bug) is logged and counted, never raised."""
        try:
            if self._client is None:
                self._client = self._connect()
            result = fn(self._client)
        except Exception as exc:  # the scheduler must never see a daemon's failure
            with self._cv:
                was_open = self.breaker.is_open
                self.breaker.failed(f"{what}: {type(exc).__name__}: {exc}")
                if self.breaker.is_open and not was_open:
                    self._count("breaker_trips")
            log.warning("embcache %s failed: %s: %s", what, type(exc).__name__, exc)
            log.debug("embcache %s failure", what, exc_info=True)
            self._close_client()  # the next call connects afresh (a restarted daemon)
            return None
        with self._cv:
            self.breaker.succeeded()
        return result

    def _close_client(self) -> None:
        client, self._client = self._client, None
        close_in_background(client, "lookup")

    def _count(self, name: str, n: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + n


def _renew_call(ids: list[int], ttl_s: float) -> Callable[[EmbCacheClient], Any]:
    return lambda c: c.renew(ids, ttl_s)


def _release_call(ids: list[int]) -> Callable[[EmbCacheClient], Any]:
    return lambda c: c.release(ids)
