# GENERATED from clients/_async/view_holds.py by scripts/unasync.py: do not edit.
# Change the asyncio source, then run `python scripts/unasync.py`.
"""The gets' side of the leases of views: tracking the leases a get took, and queueing the
release of copies' leases to ride with the next call.

The connection's pump renews and releases what is tracked here (``core/views.py``); a get
only records what it took, and wakes the pump where it now has something to do.
"""

from __future__ import annotations

from typing import Any

from embcache.clients._sync.connection import Connection
from embcache.clients.core.views import ViewLeases
from embcache.clients.device.host_replies import Decoded


class ViewHolds:
    """Records the leases of one client's gets in its connection's table of view leases."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn

    def lease_lifetime(self, ttl_s: float | None) -> float:
        """How long a lease taken now lives (what was asked, or the session's default)."""
        session = self._conn.session
        return ttl_s or (session.lease_ttl_s if session is not None else 0.0) or 1.0

    def release_later(self, lease_ids: list[int]) -> bool:
        """Release these with the next call, or from the pump (``ViewLeases.release_later``):
        the pump is woken only for the first of a run of them (it then keeps looking every
        ``LINGER_S`` while more come), so a get does not wake it each time.
        Returns True: queued (the leased tensors' ``post``)."""
        views = self._conn.views
        idle = not views.pending()
        views.release_later(lease_ids)
        if idle:
            self._conn.wake()
        return True

    def hold(
        self, decoded: Decoded, ttl_s: float | None, taken_at: float, device: Any = None
    ) -> tuple[ViewLeases, list[Any]]:
        """Track the leases of ``decoded``'s views (taken by a get sent at ``taken_at``): they
        end once their block has ended and their views are gone. Returns the table and the
        anchors, for the leased tensors to hold until their block ends."""
        session = self._conn.session
        lifetime = self.lease_lifetime(ttl_s)
        views = self._conn.views
        anchors = []
        for lease_id, anchor in zip(decoded.lease_ids, decoded.anchors, strict=True):
            if anchor is not None:
                views.track(
                    lease_id,
                    anchor,
                    ttl_s=ttl_s,
                    lifetime_s=lifetime,
                    taken_at=taken_at,
                    owner=session,
                    device=device,
                )
                anchors.append(anchor)
        if anchors:
            self._conn.wake()
        return views, anchors
