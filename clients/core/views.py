"""Leases that keep zero-copy views valid for as long as the caller holds them.

A view returned by ``get`` (a private mapping of the daemon's host pages, or with
``zero_copy=True`` a view of its device pool) reads pages the daemon would reuse once the
lease ended. So such a lease ends only when its block has ended (``release()``, the end of
``with``) *and* the last tensor over its bytes is gone, as PyTorch's CUDA IPC reference
counts work: each view is built on an anchor that every tensor derived from it keeps alive
(``device/shm.py``, ``device/anchors.py``), the leased tensors hold the anchors until their
block ends, and ``weakref.finalize`` on an anchor tells this table when the last holder
went. Until then the client renews the lease before its TTL; afterwards it releases it,
batched, before its next call or from its pump (one background task or thread per client,
started with the first view; ``_async/connection.py``).

A release that finds no live session is not sent without one: the leases ended with their
session, and those the daemon still holds for this process's views (its quarantine, after a
forced end) may be ended only by this process, which a call without a session does not
prove. Such ids wait here (:meth:`ViewLeases.keep_unsent`) and go out on the client's next
session, which the connection opens for them if nothing else does.

Finalizers run wherever the last reference is dropped, in any thread and inside the garbage
collector, so they only append a lease id to a deque; everything else happens in ordinary
calls, under this table's lock (never taken by a finalizer).
"""

from __future__ import annotations

import collections
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

POLL_S = 0.1  # how often the pump looks for views that are gone while any lease is held
MIN_RENEW_S = 0.01  # the shortest wait between renewals of one lease
BATCH = 4096  # lease ids per Renew or Release call (8 bytes each: far below a message)


@dataclass(slots=True)
class _Held:
    ttl_s: float | None  # what the get asked for (None: the daemon's default)
    lifetime_s: float  # the lease's lifetime (the asked one, or the session's default)
    expires: float  # this client's estimate, from before the call: the daemon's is later
    device: Any  # torch.device of a device-pool view (its work must finish first), or None
    owner: Any  # the session that took it (``alive`` False: it ended, so did the lease)
    finalizer: weakref.finalize[Any, Any]
    lost: bool = False  # a renewal found the lease ended (by force)
    next_try: float = 0.0  # a renewal failed: not again before this

    def renew_at(self) -> float:
        """When to renew: half the lifetime left, or later after a failed try."""
        return max(self.expires - self.lifetime_s / 2, self.next_try)


class ViewLeases:
    """The leases of one client whose tensors are views (module docstring)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._held: dict[int, _Held] = {}
        self._gone: collections.deque[int] = collections.deque()  # finalizers append here
        self._ready: list[tuple[int, Any]] = []  # (lease id, device): views and block gone
        self._unsent: list[int] = []  # releases that found no live session (module docstring)

    def __len__(self) -> int:
        return len(self._held)

    def track(
        self,
        lease_id: int,
        anchor: Any,
        *,
        ttl_s: float | None,
        lifetime_s: float,
        taken_at: float,
        owner: Any = None,
        device: Any = None,
    ) -> None:
        """Hold ``lease_id`` until ``anchor`` is gone (its block holds it until it ends).
        ``taken_at``: the clock before the get was sent; ``owner``: the session."""
        finalizer = weakref.finalize(anchor, self._gone.append, lease_id)
        finalizer.atexit = False  # at exit the session ends anyway
        with self._lock:
            expires = taken_at + lifetime_s
            self._held[lease_id] = _Held(ttl_s, lifetime_s, expires, device, owner, finalizer)

    def pending(self) -> bool:
        """A hint, without the lock: there may be leases to release now."""
        return bool(self._gone) or bool(self._ready)

    def keep_unsent(self, lease_ids: Sequence[int]) -> None:
        """Releases that found no live session: for the next session (module docstring)."""
        with self._lock:
            self._unsent.extend(lease_ids)

    def take_unsent(self) -> list[int]:
        """The releases waiting for a session (they are the caller's to send now)."""
        with self._lock:
            out, self._unsent = self._unsent, []
        return out

    @property
    def unsent(self) -> bool:
        """A hint, without the lock: releases wait for a session."""
        return bool(self._unsent)

    def end_block(self, lease_ids: Sequence[int]) -> tuple[list[int], int]:
        """The block of ``lease_ids`` ends (it still holds the anchors: it lets go of them
        next). Returns the ids to release now (those of copies, not held here) and how many
        of the views' leases had ended already (a renewal said so, their session ended, or
        their TTL passed unrenewed): the caller raises ``LeaseExpired`` for those. The
        views' leases are released once their anchors are gone."""
        now_ids: list[int] = []
        lost = 0
        with self._lock:
            self._collect()
            now = self._clock()
            for lease_id in lease_ids:
                held = self._held.get(lease_id)
                if held is None:
                    now_ids.append(lease_id)
                elif held.lost or held.expires <= now or not getattr(held.owner, "alive", True):
                    lost += 1
        return now_ids, lost

    def forget(self, lease_ids: Sequence[int]) -> None:
        """Stop tracking these (the caller ends them now: the views are no longer read)."""
        with self._lock:
            for lease_id in lease_ids:
                held = self._held.pop(lease_id, None)
                if held is not None:
                    held.finalizer.detach()

    def release_later(self, lease_ids: Sequence[int]) -> None:
        """Queue leases nothing reads any more (copies made while they surely lived) to be
        released with the next call or by the pump, like those of views that are gone."""
        with self._lock:
            self._ready.extend((lease_id, None) for lease_id in lease_ids)

    def take_releasable(self, *, devices: bool = True) -> list[tuple[int, Any]]:
        """The leases to release now, as ``(id, device)``: their anchors are gone.
        ``devices=False`` leaves those of device views (whose device work must be waited
        for first) for a later call."""
        with self._lock:
            self._collect()
            if devices:
                out, self._ready = self._ready, []
            else:
                out = [r for r in self._ready if r[1] is None]
                self._ready = [r for r in self._ready if r[1] is not None]
        return out

    def due(self) -> list[tuple[float | None, list[int]]]:
        """The live leases to renew now (half their lifetime left), as ``(requested TTL,
        ids)`` batches of at most ``BATCH``. Those whose session ended are marked lost (the
        daemon ended them with it) instead."""
        by_ttl: dict[float | None, list[int]] = {}
        with self._lock:
            now = self._clock()
            for lease_id, held in self._held.items():
                if not held.lost and not getattr(held.owner, "alive", True):
                    held.lost = True
                if not held.lost and held.renew_at() <= now:
                    by_ttl.setdefault(held.ttl_s, []).append(lease_id)
        return [
            (t, ids[i : i + BATCH]) for t, ids in by_ttl.items() for i in range(0, len(ids), BATCH)
        ]

    def renewed(self, lease_ids: Sequence[int], since: float) -> None:
        """These were renewed by a call sent at ``since``."""
        with self._lock:
            for lease_id in lease_ids:
                if (held := self._held.get(lease_id)) is not None:
                    held.expires = since + held.lifetime_s

    def retry_later(self, lease_ids: Sequence[int], delay_s: float) -> None:
        """A renewal of these could not be sent: try again in ``delay_s``."""
        with self._lock:
            at = self._clock() + delay_s
            for lease_id in lease_ids:
                if (held := self._held.get(lease_id)) is not None:
                    held.next_try = at

    def lost(self, lease_ids: Sequence[int]) -> None:
        """A renewal found these ended (by force): stop renewing them; their block's end
        reports it. They are still released once their views are gone (that ends the
        daemon's quarantine of their pages)."""
        with self._lock:
            for lease_id in lease_ids:
                if (held := self._held.get(lease_id)) is not None:
                    held.lost = True

    def next_round(self) -> float | None:
        """Seconds until the pump has something to do (None: nothing is held)."""
        with self._lock:
            if not self._held and not self._ready and not self._gone:
                return None
            now = self._clock()
            due = [h.renew_at() for h in self._held.values() if not h.lost]
        wait = POLL_S if not due else min(POLL_S, min(due) - now)
        return max(wait, MIN_RENEW_S)

    def _collect(self) -> None:
        """Lock held: the leases whose anchors the finalizers saw go are ready to release."""
        while self._gone:
            lease_id = self._gone.popleft()
            held = self._held.pop(lease_id, None)
            if held is not None:  # (None: forgotten meanwhile)
                self._ready.append((lease_id, held.device))
