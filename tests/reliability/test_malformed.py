"""Malformed input against a live daemon: at least 200 distinct kinds over gRPC (raw bytes
through a generic channel), REST (hand-made and schema-driven) and raw sockets (HTTP/1.1
to the gRPC port, HTTP/2 and TLS to the HTTP port). Each kind must get its status every
time; afterwards the daemon is up and holds nothing beyond the fixture's own lease.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from relkit import daemon as dm
from relkit import figures
from relkit import malformed_grpc as mg
from relkit import malformed_http as mh

from embcache.clients import EmbCacheClient
from embcache.service.config import Settings
from embcache.service.transport.http.app import create_app

EXAMPLES = int(os.environ.get("EMBCACHE_REL_MALFORMED_EXAMPLES", "2"))
SPEC = create_app(None, Settings(), None).openapi()  # type: ignore[arg-type]  # schema only
SCHEMA_KINDS = mh.register_schema_kinds(SPEC)
SEEN: Counter[str] = Counter()
HYPO = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    database=None,
)


class Live:
    def __init__(self, d: dm.Daemon, client: EmbCacheClient) -> None:
        self.d = d
        self.client = client
        opts = [("grpc.max_send_message_length", -1)]
        self.channel = grpc.insecure_channel(d.tcp, options=opts)
        self.http = httpx.Client(base_url=d.http, timeout=10)

    def clean(self) -> None:
        """Nothing reserved, no lease but the fixture's, the daemon alive."""
        assert self.d.alive(), self.d.log_tail()
        stats = self.d.stats()
        assert stats["entries_filling"] == 0 and stats["reserved_filling_bytes"] == 0, stats
        if stats["leases_active"] != 1:  # a lease taken by a refused call: must end at once
            waited = dm.wait_for(lambda: self.d.stats()["leases_active"] == 1, 2.0)
            assert waited is not None, stats


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    with tempfile.TemporaryDirectory(prefix="ecmal-") as tmp:
        extra = ("--max-key-bytes", str(mg.MAX_KEY))
        d = dm.start(dm.DaemonSpec(Path(tmp), pool="16MiB", extra=extra))
        try:
            with EmbCacheClient(d.unix) as client:
                client.put(mg.FIXED, torch.zeros(4, 4, dtype=torch.float16))
                client.put(mg.LEASED, torch.arange(8, dtype=torch.uint8))
                held = client.get([mg.LEASED], ttl_s=3600, zero_copy=True)
                live = Live(d, client)
                yield live
                live.channel.close()
                live.http.close()
                held.release()
                end = d.stats()
            t0 = time.monotonic()
            code = dm.stop(d)
        finally:
            dm.reap(d.proc)
    result = {
        "distinct_kinds": len(SEEN),
        "grpc_kinds": sum(k.startswith("grpc/") for k in SEEN),
        "rest_kinds": sum(k.startswith("rest/") for k in SEEN),
        "raw_socket_kinds": sum(k.startswith("raw/") for k in SEEN),
        "examples_sent": sum(SEEN.values()),
        "leases_left": end["leases_active"],
        "filling_left": end["entries_filling"],
        "daemon_exit_code": code,
        "stop_s": round(time.monotonic() - t0, 2),
        "kinds": sorted(SEEN),
    }
    print("\n" + figures.table("malformed input (CI)", result))
    figures.save("malformed", result)


@pytest.mark.parametrize("name", sorted(mg.KINDS))
def test_grpc_kind(live: Live, name: str) -> None:
    @HYPO
    @given(st.data())
    def run(data: Any) -> None:
        case = mg.KINDS[name](data.draw)
        code = mg.call(live.channel, case)
        SEEN[name] += 1
        assert code == case.expected, (name, code, case.messages[:2])
        live.clean()

    run()


@pytest.mark.parametrize("name", sorted(mh.KINDS))
def test_rest_kind(live: Live, name: str) -> None:
    @HYPO
    @given(st.data())
    def run(data: Any) -> None:
        req = mh.KINDS[name](data.draw)
        reply = live.http.request(
            req.method, req.path, content=req.body, headers=req.headers, params=req.params
        )
        SEEN[name] += 1
        assert reply.status_code in req.expected, (name, req, reply.status_code, reply.text[:300])
        if reply.status_code >= 400 and reply.headers.get("content-type") == "application/json":
            body = reply.json()  # the one error shape
            assert {"error", "code", "message", "details"} <= set(body), body
        live.clean()

    run()


@pytest.mark.parametrize("name", sorted(mh.RAW))
def test_raw_socket_kind(live: Live, name: str) -> None:
    @HYPO
    @given(st.data())
    def run(data: Any) -> None:
        raw = mh.RAW[name](data.draw)
        port = live.d.ready["http_port" if raw.port == "http" else "grpc_port"]
        reply = mh.send_raw(port, raw.data)
        SEEN[name] += 1
        assert mh.raw_ok(reply, raw.expect), (name, raw.data[:80], reply[:200])
        live.clean()

    run()


def test_grpc_call_to_the_http_port(live: Live) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{live.d.ready['http_port']}") as channel:
        code = mg.call(channel, mg.Case("Stats", [b""], grpc.StatusCode.UNAVAILABLE), timeout=5)
    SEEN["raw/http/grpc_call"] += 1
    assert code == grpc.StatusCode.UNAVAILABLE
    live.clean()


@pytest.mark.parametrize("method", ["Exists", "GetBytes"])
def test_call_without_request_message_is_answered(live: Live, method: str) -> None:
    path = mg.SERVICE + method
    SEEN[f"grpc/{method}/no_request_message"] += 1
    t0 = time.monotonic()
    try:
        for _ in live.channel.stream_stream(path)(iter([]), timeout=3):
            pass
        code = grpc.StatusCode.OK
    except grpc.RpcError as err:
        code = err.code()
    live.clean()
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, time.monotonic() - t0)


def test_at_least_200_distinct_kinds() -> None:
    total = len(mg.KINDS) + len(mh.KINDS) + len(mh.RAW) + 1
    assert total >= 200, total
