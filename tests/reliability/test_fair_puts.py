"""One client against the others, on the put side (issue 28, items 6 and 7): puts that
stall after their header (gRPC) or trickle (REST), an in-flight quota that follows the real
client rather than its connection, and zero-byte entries that took no page and were never
evicted. The new settings are given as EMBCACHE_* variables, which a daemon without them
ignores (so these tests fail there on what happens, not on a flag)."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from relkit import daemon as dm
from relkit import figures
from relkit.fairness import OWN_CONNECTION, SESSION_KEY, RawLane, StalledPut, lane_path

from embcache.clients import EmbCacheClient
from embcache.errors import PoolExhausted
from embcache.proto.constants import ERROR_TYPE_KEY
from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.proto.embcache.v1 import services as pb_grpc
from embcache.service.config import Settings
from embcache.service.engine import CacheEngine

FIG: dict[str, object] = {}
MiB = 1 << 20
IDLE_S = 1.0
QUOTA = 4 * MiB
ENV = {
    "EMBCACHE_PUT_IDLE_TIMEOUT_S": str(IDLE_S),
    "EMBCACHE_MAX_INFLIGHT_BYTES_PER_CLIENT": str(QUOTA),
}
DEFAULT_MAX_ENTRIES = 64 * MiB // (256 * 1024) + 1024  # the 64 MiB pool: pages + 1024


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dm.Daemon]:
    with dm.running(dm.DaemonSpec(tmp_path_factory.mktemp("puts"), env=ENV)) as d:
        yield d


def filling(d: dm.Daemon) -> int:
    s = d.stats()
    return int(s["entries_filling"] + s["reserved_filling_bytes"])


def error_type(err: grpc.RpcError | None) -> str | None:
    return None if err is None else dict(err.trailing_metadata() or ()).get(ERROR_TYPE_KEY)


# -- item 6: puts that stall or trickle ---------------------------------------------------
def test_a_grpc_put_that_stalls_after_its_header_is_aborted(daemon: dm.Daemon) -> None:
    stalled = StalledPut(daemon.tcp, "stall/grpc", 3 * MiB)
    try:
        reserved = dm.wait_for(lambda: filling(daemon) > 0, 5)
        assert reserved is not None, (stalled.error, daemon.stats())  # pages reserved
        freed = dm.wait_for(lambda: filling(daemon) == 0, IDLE_S + 5)
    finally:
        stalled.finish()
    assert freed is not None, "a put that sent nothing kept its pages FILLING"
    assert stalled.error is not None and stalled.error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert error_type(stalled.error) == "IdleTimeout"
    assert daemon.stats()["entries_ready"] == 0  # never visible
    FIG["gRPC put stalled after its header"] = f"aborted after {IDLE_S + freed:.1f} s, pages freed"


def test_a_rest_put_that_stops_sending_is_aborted(daemon: dm.Daemon) -> None:
    port = daemon.ready["http_port"]
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        head = (
            "PUT /v1/entries/stall/rest?dtype=uint8&shape=4194304 HTTP/1.1\r\n"
            "Host: 127.0.0.1\r\nContent-Length: 4194304\r\n\r\n"
        )
        sock.sendall(head.encode() + b"\0" * 1000)
        assert dm.wait_for(lambda: filling(daemon) > 0, 5) is not None
        freed = dm.wait_for(lambda: filling(daemon) == 0, IDLE_S + 5)
        answer = sock.recv(4096) if freed is not None else b""
    assert freed is not None, "a REST put that stopped sending kept its pages FILLING"
    assert answer.startswith(b"HTTP/1.1 408") and b"IdleTimeout" in answer, answer[:200]
    FIG["REST PUT that stops sending"] = f"408 IdleTimeout after {IDLE_S + freed:.1f} s"


def test_a_put_that_keeps_sending_is_not_cut(daemon: dm.Daemon) -> None:
    """The timeout is on silence, not on the put's length: a slow but steady put commits."""
    stalled = StalledPut(daemon.tcp, "slow/steady", 2 * MiB, sent=MiB)
    time.sleep(IDLE_S / 2)
    stalled.finish()
    assert stalled.error is None and stalled.reply is not None and stalled.reply.created


# -- item 6: the in-flight quota follows the client -----------------------------------------
def _put(target: str, key: str, nbytes: int, metadata: tuple = ()) -> grpc.RpcError | None:
    with grpc.insecure_channel(target, options=OWN_CONNECTION) as channel:
        stub = pb_grpc.EmbeddingCacheStub(channel)
        head = pb.PutHeader(key=key, dtype="uint8", shape=[nbytes], nbytes=nbytes)
        msgs = [pb.PutRequest(header=head)]
        msgs += [pb.PutRequest(chunk=bytes(min(nbytes - i, MiB))) for i in range(0, nbytes, MiB)]
        try:
            stub.Put(iter(msgs), metadata=metadata, timeout=30)
        except grpc.RpcError as err:
            return err
    return None


def test_tcp_connections_of_one_client_share_one_quota(daemon: dm.Daemon) -> None:
    stalled = StalledPut(daemon.tcp, "quota/tcp/a", 3 * MiB)  # its own connection
    try:
        assert dm.wait_for(lambda: filling(daemon) > 0, 5) is not None
        err = _put(daemon.tcp, "quota/tcp/b", 3 * MiB)  # another connection, same client
    finally:
        stalled.finish()
    assert error_type(err) == "QuotaExceeded", "a second connection got a quota of its own"
    FIG["a second TCP connection, one token"] = "shares the quota (QuotaExceeded)"


def test_sessions_of_one_process_share_its_quota_on_the_session_socket(
    daemon: dm.Daemon,
) -> None:
    with RawLane(lane_path(daemon.ready), "a") as a, RawLane(lane_path(daemon.ready), "b") as b:
        stalled = StalledPut(
            daemon.unix, "quota/uds/a", 3 * MiB, metadata=((SESSION_KEY, a.session_id),)
        )
        try:
            assert dm.wait_for(lambda: filling(daemon) > 0, 5) is not None
            same = _put(daemon.unix, "quota/uds/b", 3 * MiB, ((SESSION_KEY, b.session_id),))
            other = _put_from_another_process(daemon, "quota/uds/c", 3 * MiB)
        finally:
            stalled.finish()
    assert error_type(same) == "QuotaExceeded", "a second session got a quota of its own"
    assert other == "ok", other  # another process has its own (SO_PEERCRED)
    FIG["a second session of one process (session socket)"] = "shares the quota"
    FIG["a session of another process"] = "its own quota"


OTHER_PROCESS = textwrap.dedent(
    """
    import sys, grpc
    sys.path.insert(0, sys.argv[4])
    from relkit.fairness import RawLane
    from embcache.proto.embcache.v1 import embcache_pb2 as pb, services as rpc
    lane_path, target, key, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[5])
    with RawLane(lane_path, "other") as lane, grpc.insecure_channel(target) as ch:
        head = pb.PutHeader(key=key, dtype="uint8", shape=[n], nbytes=n)
        chunks = [pb.PutRequest(chunk=bytes(min(n - i, 1 << 20))) for i in range(0, n, 1 << 20)]
        msgs = [pb.PutRequest(header=head), *chunks]
        try:
            rpc.EmbeddingCacheStub(ch).Put(iter(msgs), timeout=30,
                                           metadata=(("x-embcache-session", lane.session_id),))
            print("ok")
        except grpc.RpcError as err:
            print(err.code().name, err.details())
    """
)


def _put_from_another_process(d: dm.Daemon, key: str, nbytes: int) -> str:
    here = str(Path(__file__).resolve().parent)
    args = [str(lane_path(d.ready)), d.unix, key, here, str(nbytes)]
    done = subprocess.run(
        [sys.executable, "-c", OTHER_PROCESS, *args], capture_output=True, text=True, timeout=60
    )
    return (done.stdout.strip() or done.stderr.strip()[-300:]).splitlines()[-1]


# -- item 7: zero-byte entries --------------------------------------------------------------
def test_zero_byte_entries_are_bounded_and_evicted_oldest_first(daemon: dm.Daemon) -> None:
    n = 2 * DEFAULT_MAX_ENTRIES
    keys = [f"zero/{i:05d}" for i in range(n)]
    with EmbCacheClient(daemon.unix, timeout=30) as client:
        for key in keys:
            client.put(key, torch.empty(0, dtype=torch.uint8))
        stats = daemon.stats()
        assert stats["entries_ready"] <= DEFAULT_MAX_ENTRIES, stats["entries_ready"]
        assert client.exists(keys[-10:]) == [True] * 10  # the newest stay
        assert client.exists(keys[:10]) == [False] * 10  # the least recently used went
    assert stats["max_entries"] == DEFAULT_MAX_ENTRIES
    per_entry = stats["metadata_bytes"] / stats["entries_ready"]
    assert 200 < per_entry < 2000, per_entry
    FIG["2x max_entries zero-byte puts"] = (
        f"{stats['entries_ready']} kept (max {DEFAULT_MAX_ENTRIES}), "
        f"~{per_entry:.0f} B of metadata each"
    )


def test_at_the_entry_limit_with_every_entry_leased_a_put_is_refused(tmp_path: Path) -> None:
    s = Settings(host_pool_bytes=4 * MiB, page_bytes=64 * 1024, shm_name=f"rel-{tmp_path.name}",
                 max_entries=8)  # fmt: skip
    with CacheEngine(s) as engine:
        for i in range(8):
            engine.put(f"z{i}", torch.empty(0))
        leases = engine.get([f"z{i}" for i in range(8)], "holder")
        with pytest.raises(PoolExhausted, match="entry"):
            engine.put("z8", torch.empty(0))
        assert engine.exists([f"z{i}" for i in range(9)]) == [True] * 8 + [False]
        engine.release([x.lease_id for x in leases[:1] if x is not None])
        engine.put("z8", torch.empty(0))  # evicts z0, the one unleased entry
        assert engine.exists(["z0", "z8"]) == [False, True]
        stats = engine.stats()
        assert stats.entries_ready == 8 and stats.entries_filling == 0
    FIG["entry limit reached, every entry leased"] = "PoolExhausted, nothing evicted"


def test_zz_figures() -> None:
    print("\n" + figures.table("stalled puts, quotas, entries (issue 28, items 6-7)", FIG))
    figures.save("fair_puts", FIG)
