"""Three daemons (own ports, sockets, pool names) share a Redis Cluster tier end to end."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import torch

from embcache.clients import EmbCacheClient


@pytest.fixture
def daemons(redis_cluster, start_daemon, tmp_path: Path) -> list[str]:  # type: ignore[no-untyped-def]
    return [
        start_daemon(
            "--grpc-socket",
            str(tmp_path / f"{name}.sock"),
            "--host-pool-bytes",
            "32MiB",
            "--shared-tier",
            redis_cluster.url(),
            "--shared-tier-ack",
            "sync",
        ).grpc_target
        for name in "abc"
    ]


def test_put_on_a_served_by_b_and_c_and_after_local_eviction(daemons: list[str]) -> None:
    a, b, c = (EmbCacheClient(t) for t in daemons)
    try:
        key = f"img-{uuid.uuid4().hex}"
        t = torch.randn(300, 1024).to(torch.bfloat16)
        assert a.put(key, t)
        for client in (b, c):
            assert client.exists([key]) == [True]
            with client.get([key]) as [got]:
                assert got is not None and torch.equal(got, t)
            del got  # the view is gone: its lease ends (before the client's next call)
        a.evict([key])
        with a.get([key]) as [again]:  # evicted locally, filled back from the shared tier
            assert again is not None and torch.equal(again, t)
        assert b.exists([f"never-{uuid.uuid4().hex}"]) == [False]
        c.evict([key])  # Prefetch brings it back from the shared tier before anyone asks
        assert c.prefetch([key, key, "missing-key"]) == {
            "requested": 2,
            "local": 0,
            "fetched": 1,
            "missing": 1,
            "resident": 0,
        }
        assert c.stats()["entries_ready"] >= 1
    finally:
        for client in (a, b, c):
            client.close()
