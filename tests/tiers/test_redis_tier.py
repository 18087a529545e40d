"""Three engines share a real 3-master Redis Cluster on 127.0.0.1."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from tier_helpers import Node, fragment, payload, read_entry
from tier_servers import RedisNodes, redis_missing

from embcache.service.shared_tier.base import HEADER_BYTES


def wait_for(cond: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def test_put_on_a_get_on_b_and_c(
    redis_cluster: RedisNodes, make_node: Callable[..., Node], prefix: str
) -> None:
    url = redis_cluster.url(f"prefix={prefix}&chunk=64KiB")
    a, ta = make_node(url, "a")
    b, tb = make_node(url, "b")
    c, _ = make_node(url, "c")
    assert ta.backend().clustered  # type: ignore[union-attr]
    fragment(b)  # B's fetch lands in several page runs
    small, big = payload(3 * 1000 + 2, seed=1), payload(700_000, seed=2)  # big: 11 chunks
    a.put("small", small)
    a.put("big", big)
    assert ta.flush(10)
    assert a.exists(["big"]) == [True] and b.exists(["big", "nope"]) == [True, False]
    want = {"small": small.numpy().tobytes(), "big": big.numpy().tobytes()}
    for engine in (b, c):
        for key, data in want.items():
            assert read_entry(engine, key) == data
    info = b.entry_info("big")
    assert info is not None and len(info.page_runs) > 1  # scattered into fragmented pages
    assert tb.stats()["fetch_hits"] == 2 and tb.stats()["fetch_bytes"] == len(want["big"]) + len(
        want["small"]
    )
    # A second get on B is a local hit: no new fetch.
    assert read_entry(b, "big") == want["big"] and tb.stats()["fetch_keys"] == 2


def test_evicted_locally_still_served(
    redis_cluster: RedisNodes, make_node: Callable[..., Node], prefix: str
) -> None:
    a, ta = make_node(redis_cluster.url(f"prefix={prefix}"), "a")
    t = payload(200_000, seed=3)
    a.put("k", t)
    assert ta.flush(10)
    a.evict(["k"])
    assert read_entry(a, "k") == t.numpy().tobytes()
    assert ta.stats()["fetch_hits"] == 1
    # get_into (the device-tier path) fetches on a miss too.
    a.evict(["k"])
    dest = payload(200_000, seed=0).view(-1).view(__import__("torch").uint8).clone()
    leases = a.device.get_into(["k"], "test", dest, [0])
    assert leases[0] is not None
    a.release([leases[0].lease_id])
    assert dest.numpy().tobytes() == t.numpy().tobytes()


def test_corrupted_value_is_a_miss(
    redis_cluster: RedisNodes, make_node: Callable[..., Node], prefix: str
) -> None:
    url = redis_cluster.url(f"prefix={prefix}")
    a, ta = make_node(url, "a")
    b, tb = make_node(url, "b")
    a.put("k", payload(100_000, seed=4))
    assert ta.flush(10)
    backend = ta.backend()
    assert backend is not None
    client = backend.client()  # type: ignore[attr-defined]
    head = backend.head_key("k")  # type: ignore[attr-defined]
    byte = client.getrange(head, HEADER_BYTES + 77, HEADER_BYTES + 77)
    client.setrange(head, HEADER_BYTES + 77, bytes([byte[0] ^ 0xFF]))
    assert read_entry(b, "k") is None  # never corrupt data
    assert tb.stats()["fetch_corrupt"] == 1 and tb.stats()["fetch_hits"] == 0
    assert b.stats().entries_ready == 0  # nothing half-filled is left behind
    assert b.exists(["k"]) == [False]  # the corrupt value was removed from the store
    # A bad header (not ours at all) is rejected the same way.
    client.set(backend.head_key("x"), b"garbage" * 100)  # type: ignore[attr-defined]
    assert read_entry(b, "x") is None and tb.stats()["fetch_corrupt"] == 2


def test_sync_ack_means_stored(
    redis_cluster: RedisNodes, make_node: Callable[..., Node], prefix: str
) -> None:
    url = redis_cluster.url(f"prefix={prefix}")
    a, _ = make_node(url, "a", ack="sync")
    b, _ = make_node(url, "b")
    t = payload(50_000, seed=5)
    a.put("k", t)  # returns once the shared tier has it: no flush
    assert read_entry(b, "k") == t.numpy().tobytes()


def test_node_killed_mid_run_then_recovers(
    redis_cluster: RedisNodes, make_node: Callable[..., Node], prefix: str
) -> None:
    url = redis_cluster.url(f"prefix={prefix}")
    a, ta = make_node(url, "a")
    b, tb = make_node(url, "b")
    backend = ta.backend()
    assert backend is not None
    client = backend.client()  # type: ignore[attr-defined]
    victim = redis_cluster.ports[0]
    # A key served by the node we kill, so the outage is certain to hit it.
    key = next(
        f"k{i}"
        for i in range(10_000)
        if client.get_node_from_key(backend.head_key(f"k{i}")).port == victim  # type: ignore[attr-defined]
    )
    a.put("before", payload(10_000, seed=6))
    assert ta.flush(10)
    redis_cluster.kill(victim)
    try:
        t0 = time.monotonic()
        a.put(key, payload(60_000, seed=7))  # local put succeeds; write-through fails
        assert read_entry(a, key) is not None and read_entry(a, "before") is not None
        assert read_entry(b, key) is None  # shared tier down: a miss, not an error
        assert wait_for(lambda: not tb.health.ok, 5)
        assert read_entry(b, "nothing") is None
        assert time.monotonic() - t0 < 8
        assert tb.stats()["fetch_skipped_degraded"] >= 1
        assert sum(tb.stats()["errors"].values()) >= 1
        assert tb.health_detail()["state"] == "degraded" and tb.health_detail()["last_error"]
    finally:
        redis_cluster.start_node(victim)
    redis_cluster.wait_cluster_ok(20)
    assert wait_for(lambda: ta.health.ok and tb.health.ok, 15)
    assert ta.stats()["recoveries"] >= 1 or ta.stats()["outages"] == 0
    t = payload(30_000, seed=8)
    a.put("after", t)
    assert ta.flush(10)
    assert read_entry(b, "after") == t.numpy().tobytes()


def test_plain_redis_and_cluster_auto_detection(
    redis_cluster: RedisNodes,
    make_node: Callable[..., Node],
    prefix: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    # One node of a cluster in the URL: auto-detected as a cluster.
    one = f"redis://127.0.0.1:{redis_cluster.ports[1]}?prefix={prefix}"
    _, t1 = make_node(one, "a")
    assert t1.backend().clustered  # type: ignore[union-attr]
    if redis_missing():
        pytest.skip(redis_missing() or "")
    plain = RedisNodes(tmp_path_factory.mktemp("redis-plain"), 1, cluster=False).start()
    try:
        url = f"redis://127.0.0.1:{plain.ports[0]}/0?prefix={prefix}&ttl=60"
        a, ta = make_node(url, "p")
        b, _ = make_node(url, "q")
        assert ta.backend().clustered is False  # type: ignore[union-attr]
        t = payload(80_000, seed=9)
        a.put("k", t)
        assert ta.flush(10)
        assert read_entry(b, "k") == t.numpy().tobytes()
        assert 0 < int(plain.cli(plain.ports[0], "ttl", ta.backend().head_key("k"))) <= 60  # type: ignore[union-attr]
    finally:
        plain.close()
