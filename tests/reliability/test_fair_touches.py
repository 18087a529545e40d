"""One client against the others, on touches: the hits a session reports from the read table
(posted touches) count each key at most once per window, so repeating them forges neither
the hit counters nor the LRU order; past the session's budget of keys per second a touch is
dropped and counted, and the session goes on."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import httpx
import pytest
import torch
from relkit import daemon as dm
from relkit import figures
from relkit.fairness import RawLane, lane_path

from embcache.clients import EmbCacheClient
from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.proto.framing import frame

FIG: dict[str, object] = {}
BUDGET = 4096  # keys a session may report per second (shortened for the test)
WINDOW_S = 600  # long enough that the whole test is one window, however slow the machine


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dm.Daemon]:
    spec = dm.DaemonSpec(
        tmp_path_factory.mktemp("touch"),
        env={
            "EMBCACHE_MAX_TOUCH_KEYS_PER_S": str(BUDGET),
            "EMBCACHE_TOUCH_WINDOW_S": str(WINDOW_S),
        },
    )
    with dm.running(spec) as d:
        assert d.stats()["read_table"], "the daemon serves no read table"
        yield d


def posted_touches(keys: list[str], times: int) -> bytes:
    touch = pb.SessionRequest(call=pb.SessionCall(call_id=0, touch=pb.TouchRequest(keys=keys)))
    return frame(touch) * times


def hits(d: dm.Daemon) -> int:
    return int(d.stats()["hits"])


def dropped(d: dm.Daemon) -> float:
    text = httpx.get(d.http + "/metrics", timeout=10).text
    found = re.search(r"^embcache_touches_dropped_total (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def test_repeated_touches_count_a_key_once_a_window(daemon: dm.Daemon) -> None:
    with EmbCacheClient(daemon.unix, timeout=30) as client:
        client.put("hot", torch.ones(8))
        client.put("cold", torch.ones(8))
    before = hits(daemon)
    with RawLane(lane_path(daemon.ready), "toucher", timeout=60) as lane:
        t0 = time.monotonic()
        for _ in range(20):  # 20,000 touches of one key, a thousand per write
            lane.sock.sendall(posted_touches(["hot", "hot"], 1000))
        lane.ping()  # every touch before it has been handled
        took = time.monotonic() - t0
        counted = hits(daemon) - before
        assert counted == 1, counted
        # Another session of the same client shares its window: only "cold" is new.
        with RawLane(lane_path(daemon.ready), "other") as other:
            other.sock.sendall(posted_touches(["hot", "cold"], 100))
            other.ping()
        assert hits(daemon) - before == 2
        result = lane.call(get=pb.GetRequest(keys=["hot"]))  # the session goes on
        assert result.get.results[0].found
    FIG["20,000 posted touches of one key"] = f"{counted} hit counted ({took:.2f} s to send)"


def test_touches_past_the_budget_are_dropped_and_counted(daemon: dm.Daemon) -> None:
    keys = [f"absent/{i}" for i in range(4096)]
    before = dropped(daemon)
    with RawLane(lane_path(daemon.ready), "flood", timeout=60) as lane:
        t0 = time.monotonic()
        lane.sock.sendall(posted_touches(keys, 200))  # 819,200 keys
        lane.ping()
        took = time.monotonic() - t0
        admitted_at_most = 1 + int(took) + 1  # a second's worth, then one a second
        gone = dropped(daemon) - before
        assert gone >= 200 - admitted_at_most, (gone, took)
        # A touch sent as a call is answered QuotaExceeded while the budget is spent.
        result = lane.call(touch=pb.TouchRequest(keys=keys))
        refused = result.error.error_type == "QuotaExceeded"
        assert refused or result.touch.touched == 0, result  # (none of them cached)
        result = lane.call(get=pb.GetRequest(keys=["absent/0"]))  # the session goes on
        assert result.WhichOneof("outcome") == "get"
    FIG["200 touches of 4096 keys, budget 4096 keys/s"] = f"{int(gone)} dropped, session alive"


SESSIONS = 8  # sessions one client opens to multiply its touch budget and window


def test_more_sessions_buy_no_more_touches(daemon: dm.Daemon) -> None:
    """A client's sessions share one budget and one window: opening more of them counts a
    key no more often, and lets no more keys through."""
    with EmbCacheClient(daemon.unix, timeout=30) as client:
        client.put("shared-window", torch.ones(8))
    time.sleep(1.1)  # the client's budget is whole again after the tests before
    lanes = [RawLane(lane_path(daemon.ready), f"many-{i}", timeout=60) for i in range(SESSIONS)]
    try:
        before = hits(daemon)
        for lane in lanes:
            lane.sock.sendall(posted_touches(["shared-window"], 10))
            lane.ping()
        assert hits(daemon) - before == 1  # not one per session
        keys = [f"absent/{i}" for i in range(BUDGET)]
        gone_before = dropped(daemon)
        t0 = time.monotonic()
        for lane in lanes:
            lane.sock.sendall(posted_touches(keys, 4))
        for lane in lanes:
            lane.ping()
        took = time.monotonic() - t0
        gone = dropped(daemon) - gone_before
        admitted_at_most = 1 + int(took) + 1  # the client's one budget, not one per session
        assert gone >= 4 * SESSIONS - admitted_at_most, (gone, took)
    finally:
        for lane in lanes:
            lane.close()
    FIG[f"{SESSIONS} sessions of one client, 4 touches of {BUDGET} keys each"] = (
        f"{int(gone)} of {4 * SESSIONS} dropped"
    )


def test_zz_figures() -> None:
    print("\n" + figures.table("touches", FIG))
    figures.save("fair_touches", FIG)
