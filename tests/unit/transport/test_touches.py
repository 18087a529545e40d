"""A session's touches: the budget in keys per second, and each key once a window."""

from __future__ import annotations

from embcache.service.engine import TouchWindow
from embcache.service.transport.session.touches import ClientTouches, SessionTouches


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_window_counts_each_key_once_until_it_rolls_over() -> None:
    window = TouchWindow(1.0)
    assert window.fresh(["a", "b", "a"], 10.0) == ["a", "b"]
    assert window.fresh(["a", "c"], 10.5) == ["c"]
    assert window.fresh(["a", "b"], 11.0) == ["a", "b"]  # a new window
    assert TouchWindow(0).fresh(["a", "a"], 1.0) == ["a", "a"]  # 0: every time


def test_the_budget_drops_whole_touches_and_refills_with_time() -> None:
    clock, seen, drops = Clock(), [], []

    def touch(keys: list[str], window: TouchWindow) -> int:
        seen.append(window.fresh(keys, clock()))
        return len(keys)

    touches = SessionTouches(touch, 10, 1.0, on_drop=lambda: drops.append(1), clock=clock)
    assert touches([f"k{i}" for i in range(8)]) == 8
    assert touches(["x", "y", "z"]) is None  # 3 > the 2 left: dropped whole
    assert touches([]) == 0  # an empty touch costs one
    assert touches(["k0"]) == 1
    assert touches(["k1"]) is None
    assert (touches.dropped, len(drops)) == (2, 2)
    clock.now += 0.5  # five keys' worth back
    assert touches(["a", "b", "c", "d", "e"]) == 5
    clock.now += 10  # never more than one second's worth
    assert touches([f"n{i}" for i in range(11)]) is None
    assert seen[2] == []  # k0 counted once in its window


def test_a_clients_sessions_share_one_handler_until_the_last_ends() -> None:
    made: list[SessionTouches] = []

    def make() -> SessionTouches:
        made.append(SessionTouches(lambda keys, window: len(keys), 10, 1.0))
        return made[-1]

    clients = ClientTouches(make)
    first = clients.open("s1", "uid:1000/pid:7")
    assert clients.open("s2", "uid:1000/pid:7") is first  # one budget, one window
    assert clients.open("s3", "uid:1000/pid:8") is not first  # another process: its own
    clients.close("s1")
    clients.close("s1")  # twice: no effect
    assert clients.open("s4", "uid:1000/pid:7") is first  # s2 still holds it
    clients.close("s2")
    clients.close("s4")
    assert len(clients) == 1  # pid 7's went with its last session
    assert clients.open("s5", "uid:1000/pid:7") is not first and len(made) == 3
