"""The client's table of leases held by views (clients/core/views.py) and the leased tensors
over it: a view's lease ends once its block has ended and its last tensor is gone, is renewed
until then, and a lease known to have ended is reported at the end of its block."""

from __future__ import annotations

import gc
import threading
from types import SimpleNamespace

import pytest
import torch

from embcache.clients import LeasedTensors
from embcache.clients.core.views import BATCH, POLL_S, ViewLeases
from embcache.clients.device.anchors import anchored_view
from embcache.errors import LeaseExpired


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def view(base: torch.Tensor) -> tuple[torch.Tensor, object]:
    return anchored_view(base, 0, base.numel())


def released(views: ViewLeases) -> list[int]:
    return sorted(lease_id for lease_id, _ in views.take_releasable())


def test_a_view_lease_ends_with_its_block_and_its_last_view() -> None:
    clock = Clock()
    views = ViewLeases(clock)
    base = torch.arange(64, dtype=torch.uint8)
    t, anchor = view(base)
    views.track(7, anchor, ttl_s=None, lifetime_s=10.0, taken_at=clock.now)
    calls: list[list[int]] = []

    def release(ids: list[int]) -> int:
        calls.append(ids)
        return len(ids)

    leased = LeasedTensors([t, None], [7, 8], release, views, [anchor])
    del anchor
    part = t[10:20].view(torch.int16)  # a tensor made from the view keeps it alive
    del t
    leased.release()  # the block ends: the copy's lease (8) ends now, the view's waits
    assert calls == [[8]] and released(views) == [] and len(views) == 1
    leased.tensors.clear()
    del leased
    assert released(views) == []  # ``part`` still reads the pages
    del part
    gc.collect()
    assert released(views) == [7] and len(views) == 0 and not views.pending()


def test_a_dropped_result_ends_its_views_leases_without_a_release() -> None:
    views = ViewLeases(Clock())
    t, anchor = view(torch.zeros(16, dtype=torch.uint8))
    views.track(1, anchor, ttl_s=None, lifetime_s=10.0, taken_at=0.0)
    leased = LeasedTensors([t], [1], lambda ids: len(ids), views, [anchor])
    del t, anchor
    assert views.take_releasable() == []
    del leased  # never released (``client.get(k)[0]`` and the like)
    assert views.pending() and released(views) == [1]


def test_explicit_now_ends_every_lease_at_once() -> None:
    views = ViewLeases(Clock())
    t, anchor = view(torch.zeros(16, dtype=torch.uint8))
    views.track(1, anchor, ttl_s=None, lifetime_s=10.0, taken_at=0.0)
    calls: list[list[int]] = []
    leased = LeasedTensors([t], [1], lambda ids: calls.append(ids) or len(ids), views, [anchor])
    leased.release(now=True)
    assert calls == [[1]] and len(views) == 0
    del leased, t, anchor
    assert released(views) == []  # forgotten: its finalizer does not release it again


def test_renewals_are_due_at_half_the_lifetime_and_move_with_each_renewal() -> None:
    clock = Clock()
    views = ViewLeases(clock)
    keep = []
    for lease_id, ttl in ((1, None), (2, 4.0)):
        t, anchor = view(torch.zeros(8, dtype=torch.uint8))
        keep.append((t, anchor))
        views.track(lease_id, anchor, ttl_s=ttl, lifetime_s=ttl or 10.0, taken_at=clock.now)
    assert views.due() == []
    assert views.next_round() == pytest.approx(POLL_S)
    clock.now += 2.0
    assert views.due() == [(4.0, [2])]
    views.renewed([2], clock.now)
    assert views.due() == []
    clock.now += 3.5
    assert sorted(views.due(), key=str) == [(4.0, [2]), (None, [1])]
    views.retry_later([1, 2], 1.0)  # the renewal could not be sent
    assert views.due() == []
    clock.now += 1.0
    assert len(views.due()) == 2
    views.lost([2])  # the daemon said it had ended
    assert views.due() == [(None, [1])]


def test_renewals_come_in_bounded_batches_and_skip_ended_sessions() -> None:
    views = ViewLeases(Clock())
    session = SimpleNamespace(alive=True)
    keep = []
    for lease_id in range(1, BATCH + 11):
        _, anchor = view(torch.zeros(1, dtype=torch.uint8))
        keep.append(anchor)
        views.track(lease_id, anchor, ttl_s=None, lifetime_s=1.0, taken_at=0.0, owner=session)
    assert [len(ids) for _, ids in views.due()] == [BATCH, 10]
    session.alive = False  # its leases ended with it: nothing to renew, the block says so
    assert views.due() == [] and views.end_block([1]) == ([], 1)


def test_the_end_of_a_block_reports_leases_known_to_have_ended() -> None:
    clock = Clock()
    views = ViewLeases(clock)
    session = SimpleNamespace(alive=True)
    kept = []
    for lease_id in (1, 2, 3):
        t, anchor = view(torch.zeros(8, dtype=torch.uint8))
        kept.append((t, anchor))
        views.track(
            lease_id, anchor, ttl_s=None, lifetime_s=10.0, taken_at=clock.now, owner=session
        )
    views.lost([1])  # a renewal failed for it
    assert views.end_block([1]) == ([], 1)
    assert views.end_block([2]) == ([], 0)
    clock.now += 11  # the pump missed the TTL (this process was stopped, say)
    assert views.end_block([2]) == ([], 1)
    clock.now -= 11
    session.alive = False  # its session ended: so did its leases
    assert views.end_block([3]) == ([], 1)
    leased = LeasedTensors([kept[2][0]], [3], lambda ids: len(ids), views, [kept[2][1]])
    with pytest.raises(LeaseExpired) as err:
        leased.release()
    assert err.value.details == {"held": 1, "released": 0}


def test_finalizers_from_other_threads_only_queue() -> None:
    views = ViewLeases(Clock())
    t, anchor = view(torch.zeros(8, dtype=torch.uint8))
    views.track(5, anchor, ttl_s=None, lifetime_s=10.0, taken_at=0.0)
    holder = [t]
    del t, anchor

    def drop() -> None:
        holder.clear()  # the last view goes in another thread

    thread = threading.Thread(target=drop)
    thread.start()
    thread.join()
    assert views.pending() and released(views) == [5]
    assert views.next_round() is None  # nothing held: the pump may sleep
