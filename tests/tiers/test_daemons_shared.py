"""Three daemons (own ports, sockets, pool names) share a Redis Cluster tier end to end."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from embcache.clients import EmbCacheClient


@pytest.fixture
def daemons(redis_cluster, tmp_path: Path) -> Iterator[list[str]]:  # type: ignore[no-untyped-def]
    procs: list[subprocess.Popen[str]] = []
    targets: list[str] = []
    try:
        for name in "abc":
            cmd = [
                sys.executable,
                "-m",
                "embcache.service.cli",
                "serve",
                "--grpc-port",
                "0",
                "--http-port",
                "0",
                "--grpc-socket",
                str(tmp_path / f"{name}.sock"),
                "--shm-name",
                f"embcache-tier-{name}-{uuid.uuid4().hex[:8]}",
                "--host-pool-bytes",
                "32MiB",
                "--shared-tier",
                redis_cluster.url(),
                "--log-level",
                "warning",
            ]
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
            procs.append(proc)
            assert proc.stdout is not None
            ready = json.loads(proc.stdout.readline())
            targets.append(f"127.0.0.1:{ready['grpc_port']}")
        yield targets
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                assert proc.wait(timeout=30) == 0
            finally:
                if proc.poll() is None:
                    proc.kill()
                if proc.stdout is not None:
                    proc.stdout.close()


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
