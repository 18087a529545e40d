"""One client against the others, on leases (issue 28, item 8): a client that leases the
whole pool for an hour, releases and renewals of other clients' leases, and the operator
commands that list the sessions and drop one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import grpc
import pytest
import torch
from relkit import daemon as dm
from relkit import figures
from relkit.fairness import SESSION_KEY, RawLane, lane_path

from embcache.clients import EmbCacheClient
from embcache.errors import LeaseExpired, LeaseLimitExceeded, PoolExhausted
from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.proto.embcache.v1 import services as pb_grpc

FIG: dict[str, object] = {}
MiB = 1 << 20
MAX_LEASES = 100
BIG = [f"big/{i}" for i in range(8)]  # 8 x 8 MiB: the whole 64 MiB pool


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dm.Daemon]:
    # The default leased-bytes cap is half the pool (at least one largest entry: 8 MiB here).
    spec = dm.DaemonSpec(
        tmp_path_factory.mktemp("leases"),
        lease_ttl_s=600,
        extra=("--max-entry-bytes", "8MiB"),
        env={"EMBCACHE_MAX_LEASES_PER_OWNER": str(MAX_LEASES)},
    )
    with dm.running(spec) as d:
        yield d


def leases(d: dm.Daemon) -> int:
    return int(d.stats()["leases_active"])


# -- caps ----------------------------------------------------------------------------------
def test_a_get_past_the_lease_count_cap_is_refused_whole(daemon: dm.Daemon) -> None:
    keys = [f"few/{i}" for i in range(MAX_LEASES + 1)]
    with EmbCacheClient(daemon.unix, timeout=30) as client:
        for key in keys:
            client.put(key, torch.empty(0, dtype=torch.uint8))
        with pytest.raises(LeaseLimitExceeded):  # views: one lease per key
            client.get(keys, zero_copy=True)
        assert leases(daemon) == 0  # nothing leased for that call
        with client.get(keys[:MAX_LEASES], zero_copy=True):  # up to the cap is fine
            assert leases(daemon) == MAX_LEASES
    assert dm.wait_for(lambda: leases(daemon) == 0, 10) is not None
    FIG[f"a Get of {MAX_LEASES + 1} keys, cap {MAX_LEASES}"] = "LeaseLimitExceeded, none leased"


def test_a_client_that_leases_everything_for_an_hour_no_longer_blocks_puts(
    daemon: dm.Daemon,
) -> None:
    with EmbCacheClient(daemon.unix, timeout=30) as hog, EmbCacheClient(daemon.tcp) as other:
        for key in BIG:
            hog.put(key, torch.zeros(8 * MiB // 4))
        held = []
        try:
            with pytest.raises(LeaseLimitExceeded):
                held.append(hog.get(BIG, ttl_s=3600, zero_copy=True))
            assert leases(daemon) == 0
            for key in BIG:  # one by one, as far as the cap lets it
                try:
                    held.append(hog.get([key], ttl_s=3600, zero_copy=True))
                except LeaseLimitExceeded:
                    break
            leased_mib = len(held) * 8
            try:
                other.put("other/new", torch.zeros(8 * MiB // 4))
                outcome = "stored"
            except PoolExhausted:
                outcome = "PoolExhausted"
        finally:
            for got in held:
                got.release()
            del held, got  # the views go: their leases end (the client's pump releases them)
    assert dm.wait_for(lambda: leases(daemon) == 0, 10) is not None
    assert leased_mib <= 32, leased_mib
    assert outcome == "stored", "the hog's leases blocked another client's put"
    FIG["a client leasing the whole pool for 3600 s"] = f"held {leased_mib} of 64 MiB"
    FIG["another client's put meanwhile"] = outcome


# -- release and renew take the caller's own leases only -----------------------------------
def test_release_and_renew_only_take_the_callers_own_leases(daemon: dm.Daemon) -> None:
    with EmbCacheClient(daemon.unix, timeout=30) as owner:
        owner.put("own/k", torch.ones(8))
        held = owner.get(["own/k"], ttl_s=600, zero_copy=True)
        [lease_id] = held.lease_ids
        with RawLane(lane_path(daemon.ready), "thief") as thief:
            stolen = thief.call(release=pb.ReleaseRequest(lease_ids=[lease_id]))
            metadata = ((SESSION_KEY, thief.session_id),)
            with grpc.insecure_channel(daemon.unix) as channel:
                stub = pb_grpc.EmbeddingCacheStub(channel)
                renewed = stub.Renew(pb.RenewRequest(lease_ids=[lease_id]), metadata=metadata)
                anon = stub.Release(pb.ReleaseRequest(lease_ids=[lease_id]))
        rest = daemon.rest("/v1/release", "POST", json={"lease_ids": [str(lease_id)]})
        assert (stolen.release.released, renewed.renewed, anon.released) == (0, 0, 0)
        assert rest["released"] == 0
        assert leases(daemon) == 1
        assert owner.renew([lease_id], ttl_s=600) == 1  # its own: fine
        held.release()  # no LeaseExpired: nobody else ended it
    FIG["another session's / sessionless / REST release of a lease"] = "0 / 0 / 0 released"


def test_rest_release_and_renew_stay_with_the_rest_owner(daemon: dm.Daemon) -> None:
    with EmbCacheClient(daemon.unix, timeout=30) as client:
        client.put("rest/k", torch.ones(8))
        got = daemon.rest("/v1/get", "POST", json={"keys": ["rest/k"], "ttl_s": 600})
        lease_id = int(got["results"][0]["lease_id"])
        assert client.release([lease_id]) == 0  # a session cannot end a REST lease
        assert daemon.rest("/v1/renew", "POST", json={"lease_ids": [lease_id]})["renewed"] == 1
        assert daemon.rest("/v1/release", "POST", json={"lease_ids": [lease_id]})["released"] == 1


# -- the operator commands ------------------------------------------------------------------
def _cli(d: dm.Daemon, *args: str) -> subprocess.CompletedProcess[str]:
    port = str(d.ready["http_port"])
    cmd = [sys.executable, "-m", "embcache.service.cli", *args, "--target", f"127.0.0.1:{port}"]
    env = dm.clean_env() | {"COLUMNS": "200"}  # a table that does not fold
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.parametrize("over", ["lane", "session-socket-tcp", "grpc-stream"])
def test_sessions_are_listed_and_an_operator_drops_one(daemon: dm.Daemon, over: str) -> None:
    target = daemon.unix if over == "lane" else daemon.tcp
    name, stream = f"decoder-{over}", over == "grpc-stream"
    with EmbCacheClient(
        target, timeout=30, client_name=name, retries=0, session_socket=not stream
    ) as client:
        client.put("ops/a", torch.ones(1024))
        client.put("ops/b", torch.ones(2048))
        held = client.get(["ops/a", "ops/b"], ttl_s=600, zero_copy=True)
        listed = _cli(daemon, "sessions", "--json")
        assert listed.returncode == 0, listed.stderr
        [me] = [s for s in json.loads(listed.stdout)["sessions"]
                if s["client_name"] == f"decoder-{over}"]  # fmt: skip
        assert (me["leases"], me["leased_bytes"]) == (2, 3 * 4096)
        assert me["pid"] == os.getpid()
        assert me["transport"] == ("grpc" if stream else "lane")
        if over == "lane":
            assert me["uid"] == os.getuid()  # the kernel's word, not the hello's
        table = _cli(daemon, "sessions")
        assert table.returncode == 0 and f"decoder-{over}" in table.stdout, table.stdout
        dropped = _cli(daemon, "drop-session", me["session_id"])
        assert dropped.returncode == 0, dropped
        assert dropped.stdout.splitlines()[1].split("\t") == [me["session_id"], "2"]  # piped
        assert leases(daemon) == 0
        with pytest.raises(LeaseExpired):
            held.release()
        # A view is a call (a copy may come from the read table): the client opens a new session.
        with client.get(["ops/a"], zero_copy=True) as again:
            assert again[0] is not None
    again_listed = daemon.rest("/v1/sessions")["sessions"]
    assert me["session_id"] not in [s["session_id"] for s in again_listed]
    missing = _cli(daemon, "drop-session", me["session_id"])
    assert missing.returncode != 0 and "404" in missing.stderr + missing.stdout
    FIG[f"embcache drop-session ({over})"] = "leases ended, stream closed, client reconnects"


def test_zz_figures() -> None:
    print("\n" + figures.table("leases and operator commands (issue 28, item 8)", FIG))
    figures.save("fair_leases", FIG)
