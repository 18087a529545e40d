"""One client against the others, without a session: gRPC calls that name no session take
leases for their client (the token, else the peer address without its port; on the Unix
socket one shared client), not for their connection, so more channels buy no more lease
caps; operators list those leases and end them like a session's."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import grpc
import pytest
import torch
from relkit import daemon as dm
from relkit import figures
from relkit.fairness import OWN_CONNECTION

from embcache.clients import EmbCacheClient
from embcache.proto.constants import ERROR_TYPE_KEY
from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.proto.embcache.v1 import services as pb_grpc

FIG: dict[str, object] = {}
MiB = 1 << 20
BIG = [f"big/{i}" for i in range(8)]  # 8 x 8 MiB: the whole 64 MiB pool


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dm.Daemon]:
    # The default leased-bytes cap is half the pool: 32 MiB, four of the entries.
    spec = dm.DaemonSpec(
        tmp_path_factory.mktemp("anon"), lease_ttl_s=600, extra=("--max-entry-bytes", "8MiB")
    )
    with dm.running(spec) as d:
        yield d


@pytest.fixture(autouse=True)
def big(daemon: dm.Daemon) -> None:
    """The eight entries, put again where another test's put evicted one."""
    with EmbCacheClient(daemon.unix, timeout=30) as client:
        for key in BIG:
            client.put(key, torch.zeros(8 * MiB // 4))


def leases(d: dm.Daemon) -> int:
    return int(d.stats()["leases_active"])


def error_type(err: grpc.RpcError) -> str:
    trailing = err.trailing_metadata() or ()  # type: ignore[attr-defined]
    return dict(trailing).get(ERROR_TYPE_KEY, "")


def lease_keys(target: str, keys: list[str]) -> str:
    """A Get of ``keys`` for an hour on a channel of its own connection, without a session:
    "ok" or the error type."""
    with grpc.insecure_channel(target, options=OWN_CONNECTION) as channel:
        stub = pb_grpc.EmbeddingCacheStub(channel)
        try:
            stub.Get(pb.GetRequest(keys=keys, ttl_s=3600), timeout=30)
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
            return error_type(err)
    return "ok"


def _cli(d: dm.Daemon, *args: str) -> subprocess.CompletedProcess[str]:
    port = str(d.ready["http_port"])
    cmd = [sys.executable, "-m", "embcache.service.cli", *args, "--target", f"127.0.0.1:{port}"]
    env = dm.clean_env() | {"COLUMNS": "200"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.parametrize("over", ["tcp", "unix"])
def test_more_channels_buy_no_more_lease_caps(daemon: dm.Daemon, over: str) -> None:
    """Two connections of one client without a session: the second is refused once the
    first holds the client's share, and another client's put is stored."""
    target = daemon.tcp if over == "tcp" else daemon.unix
    first = lease_keys(target, BIG[:4])  # 32 MiB: the whole cap
    second = lease_keys(target, BIG[4:])  # a second connection, the same client
    third = lease_keys(target, BIG[4:5])
    assert first == "ok"
    assert (second, third) == ("LeaseLimitExceeded", "LeaseLimitExceeded")
    assert leases(daemon) == 4
    with EmbCacheClient(daemon.tcp, timeout=30) as other:
        other.put(f"other/{over}", torch.zeros(8 * MiB // 4))  # room is left for others
        other.evict([f"other/{over}"])
    owner = "anon:tcp:127.0.0.1" if over == "tcp" else "anon:unix"
    listed = {s["session_id"]: s for s in daemon.rest("/v1/sessions")["sessions"]}
    assert owner in listed, listed
    row = listed[owner]
    assert (row["leases"], row["leased_bytes"], row["anonymous"]) == (4, 32 * MiB, True)
    dropped = daemon.rest(f"/v1/sessions/{owner}", "DELETE")
    assert dropped["leases_ended"] == 4
    assert leases(daemon) == 0
    FIG[f"2 connections without a session ({over})"] = f"{second} for the 2nd; 32 of 64 MiB"


def test_a_dropped_client_without_a_session_frees_its_pages(daemon: dm.Daemon) -> None:
    """Its leases end by force, and with no process the daemon knows holding views, nothing
    is quarantined: every page is free to evict and to reuse at once."""
    assert lease_keys(daemon.tcp, BIG[:4]) == "ok"
    assert daemon.rest("/v1/sessions/anon:tcp:127.0.0.1", "DELETE")["leases_ended"] == 4
    assert leases(daemon) == 0 and int(daemon.stats().get("quarantined_bytes", 0)) == 0
    evicted = daemon.rest("/v1/evict", "POST", json={"keys": BIG})
    assert sorted(evicted["evicted"]) == sorted(BIG) and not evicted["leased"], evicted
    with EmbCacheClient(daemon.unix, timeout=30) as client:  # the whole pool, again
        for key in BIG:
            client.put(f"reuse/{key}", torch.zeros(8 * MiB // 4))
        client.evict([f"reuse/{key}" for key in BIG])


def test_the_cli_lists_and_drops_a_client_without_a_session(daemon: dm.Daemon) -> None:
    assert lease_keys(daemon.tcp, BIG[:2]) == "ok"
    listed = _cli(daemon, "sessions", "--json")
    assert listed.returncode == 0, listed.stderr
    rows = [s for s in json.loads(listed.stdout)["sessions"] if s["anonymous"]]
    assert [(s["session_id"], s["leases"]) for s in rows] == [("anon:tcp:127.0.0.1", 2)]
    table = _cli(daemon, "sessions")
    assert table.returncode == 0 and "anon:tcp:127.0.0.1" in table.stdout, table.stdout
    dropped = _cli(daemon, "drop-session", "anon:tcp:127.0.0.1")
    # piped: a header-led TSV record (the session, the leases it held)
    assert dropped.returncode == 0 and "anon:tcp:127.0.0.1\t2" in dropped.stdout, dropped
    assert leases(daemon) == 0
    missing = _cli(daemon, "drop-session", "anon:tcp:127.0.0.1")  # nothing held any more
    assert missing.returncode != 0 and "404" in missing.stderr + missing.stdout
    FIG["embcache sessions / drop-session anon:<client>"] = "listed with its leases; ended"


def test_rest_leases_are_listed_and_ended_too(daemon: dm.Daemon) -> None:
    got = daemon.rest("/v1/get", "POST", json={"keys": BIG[:1], "ttl_s": 600})
    assert got["results"][0]["found"]
    listed = {s["session_id"]: s for s in daemon.rest("/v1/sessions")["sessions"]}
    assert listed["rest:127.0.0.1"]["leases"] == 1
    assert listed["rest:127.0.0.1"]["transport"] == "rest"
    assert daemon.rest("/v1/sessions/rest:127.0.0.1", "DELETE")["leases_ended"] == 1
    assert leases(daemon) == 0


def test_zz_figures() -> None:
    print("\n" + figures.table("callers without a session", FIG))
    figures.save("fair_anonymous", FIG)
