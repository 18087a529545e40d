"""One client against the others, on the session socket before its hello: connections that
never say hello are closed at the hello deadline, a first message larger than a hello closes
the connection before it is buffered, connections past the cap are refused at once, each
counted by reason, and authenticated clients go on throughout."""

from __future__ import annotations

import contextlib
import re
import select
import socket
import time
from collections.abc import Iterator

import httpx
import psutil
import pytest
import torch
from relkit import daemon as dm
from relkit import figures

from embcache.clients import EmbCacheClient
from embcache.proto.constants import MAX_MESSAGE_BYTES
from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.proto.framing import FRAME_HEADER, frame

FIG: dict[str, object] = {}
TOKEN = "fair-token"
CAP = 24
HELLO_S = 2.0


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dm.Daemon]:
    spec = dm.DaemonSpec(
        tmp_path_factory.mktemp("lane"),
        token=TOKEN,
        env={
            "EMBCACHE_SESSION_HELLO_TIMEOUT_S": str(HELLO_S),
            "EMBCACHE_MAX_SESSION_CONNECTIONS": str(CAP),
        },
    )
    with dm.running(spec) as d:
        yield d


def lane(d: dm.Daemon, over: str) -> socket.socket:
    """A raw connection to the session socket (nothing sent)."""
    if over == "tcp":
        sock = socket.create_connection(
            ("127.0.0.1", int(d.ready["session_socket_tcp_port"])), timeout=10
        )
    else:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(10)
        sock.connect(str(d.ready["session_socket"]))
    return sock


def closed(sock: socket.socket, within: float) -> bool:
    """Whether the daemon closes ``sock`` within ``within`` seconds (whatever it sent first
    is read and skipped)."""
    sock.settimeout(within)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except OSError:
        return True  # reset
    return True


def refusals(d: dm.Daemon) -> dict[tuple[str, str], float]:
    text = httpx.get(d.http + "/metrics", headers=d.headers(), timeout=10).text
    pattern = r'embcache_session_socket_refusals_total\{listener="(\w+)",reason="(\w+)"\} (\S+)'
    return {(m[0], m[1]): float(m[2]) for m in re.findall(pattern, text)}


def a_client_works(d: dm.Daemon, key: str) -> None:
    with EmbCacheClient(d.unix, token=TOKEN, timeout=30) as client:
        client.put(key, torch.ones(16))
        with client.get(key) as (got,):
            assert got is not None and torch.equal(got, torch.ones(16))


@pytest.mark.parametrize("over", ["tcp", "unix"])
def test_connections_without_a_hello_are_closed_at_the_deadline(
    daemon: dm.Daemon, over: str
) -> None:
    before = refusals(daemon).get((over, "hello_timeout"), 0.0)
    with EmbCacheClient(daemon.unix, token=TOKEN, timeout=30) as member:
        member.put("member", torch.ones(4))
        idle = [lane(daemon, over) for _ in range(10)]
        t0 = time.monotonic()
        try:
            assert all(closed(sock, HELLO_S + 10) for sock in idle)
            took = time.monotonic() - t0
        finally:
            for sock in idle:
                sock.close()
        with member.get("member", zero_copy=True) as (got,):  # a call: its session works
            assert got is not None
    assert (
        dm.wait_for(lambda: refusals(daemon).get((over, "hello_timeout"), 0.0) >= before + 10, 10)
        is not None
    )
    FIG[f"10 idle connections ({over}), hello deadline {HELLO_S} s"] = f"closed after {took:.1f} s"


@pytest.mark.parametrize("over", ["tcp", "unix"])
def test_a_large_first_message_is_refused_before_it_is_buffered(
    daemon: dm.Daemon, over: str
) -> None:
    proc = psutil.Process(daemon.pid)
    rss0 = proc.memory_info().rss
    # Past the cap a connection takes the place of the longest waiting one (displaced).
    reasons = [(over, "hello_too_large"), (over, "connections"), (over, "displaced")]
    before = sum(refusals(daemon).get(r, 0.0) for r in reasons)
    socks = []
    try:
        for _ in range(60):  # each would be a whole message buffered before the token check
            sock = lane(daemon, over)
            socks.append(sock)
            sock.sendall(FRAME_HEADER.pack(MAX_MESSAGE_BYTES))
            with contextlib.suppress(OSError):  # closed already
                sock.sendall(b"\0" * (64 << 10))
        assert all(closed(sock, 10) for sock in socks)
        grown = (proc.memory_info().rss - rss0) / (1 << 20)
    finally:
        for sock in socks:
            sock.close()
    counted = sum(refusals(daemon).get(r, 0.0) for r in reasons) - before
    assert counted == 60
    a_client_works(daemon, f"after-large-{over}")
    FIG[f"60 connections sending a 1.125 MiB first frame ({over})"] = (
        f"closed at its length; daemon RSS +{grown:.0f} MiB"
    )


def test_a_wrong_token_is_refused_and_counted(daemon: dm.Daemon) -> None:
    before = refusals(daemon).get(("unix", "unauthenticated"), 0.0)
    sock = lane(daemon, "unix")
    with sock:
        hello = pb.SessionHello(client_name="thief", auth_token="wrong")
        sock.sendall(frame(pb.SessionRequest(hello=hello)))
        (size,) = FRAME_HEADER.unpack(sock.recv(FRAME_HEADER.size, socket.MSG_WAITALL))
        reply = pb.SessionResponse.FromString(sock.recv(size, socket.MSG_WAITALL))
        assert reply.result.error.code == "UNAUTHENTICATED"
        assert closed(sock, 10)
    assert refusals(daemon)[("unix", "unauthenticated")] == before + 1


def test_connections_past_the_cap_are_refused_and_members_go_on(daemon: dm.Daemon) -> None:
    """Idle connections past the cap: each new one takes the place of the one that waited
    longest for its hello, which is refused at once (QuotaExceeded, closed); a session
    opened before goes on; a new client gets in; once the idle ones pass their deadline, the
    socket takes new sessions again."""
    assert dm.wait_for(lambda: not open_lane_sessions(daemon), 10) is not None
    time.sleep(0.3)  # the tests before have closed their connections
    before = refusals(daemon).get(("unix", "displaced"), 0.0)
    with EmbCacheClient(daemon.unix, token=TOKEN, timeout=30) as member:
        member.put("cap", torch.ones(4))  # its session is open (one connection)
        idle = [lane(daemon, "unix") for _ in range(CAP + 8)]
        try:
            time.sleep(0.3)  # well inside the hello deadline
            answered = [s for s in idle if select.select([s], [], [], 0)[0]]
            for sock in answered:  # refused: QuotaExceeded, then closed
                (size,) = FRAME_HEADER.unpack(sock.recv(FRAME_HEADER.size, socket.MSG_WAITALL))
                refused = pb.SessionResponse.FromString(sock.recv(size, socket.MSG_WAITALL))
                assert refused.result.error.error_type == "QuotaExceeded", refused
                assert closed(sock, 5)
            assert 9 <= len(answered) <= 10, len(answered)  # the member holds one place
            assert set(answered) == set(idle[: len(answered)])  # the first ones, at once
            with member.get("cap", zero_copy=True) as (got,):  # a call: its session works
                assert got is not None
            a_client_works(daemon, "while-full")  # a new client gets in all the same
        finally:
            for sock in idle:
                sock.close()
    counted = refusals(daemon).get(("unix", "displaced"), 0.0) - before
    assert counted >= len(answered)
    a_client_works(daemon, "after-full")
    FIG[f"{CAP + 8} idle connections, cap {CAP}"] = (
        f"the {len(answered)} longest waiting refused at once (QuotaExceeded); members unaffected"
    )


def open_lane_sessions(d: dm.Daemon) -> list[dict[str, object]]:
    reply = httpx.get(d.http + "/v1/sessions", headers=d.headers(), timeout=10)
    return [s for s in reply.json()["sessions"] if s["transport"] == "lane"]


def hello_on(sock: socket.socket, token: str = TOKEN) -> pb.SessionResponse:
    """Send a hello on a raw connection; the daemon's first reply."""
    hello = pb.SessionHello(client_name="late", auth_token=token)
    sock.sendall(frame(pb.SessionRequest(hello=hello)))
    (size,) = FRAME_HEADER.unpack(sock.recv(FRAME_HEADER.size, socket.MSG_WAITALL))
    return pb.SessionResponse.FromString(sock.recv(size, socket.MSG_WAITALL))


@pytest.mark.parametrize("over", ["tcp", "unix"])
def test_connections_without_a_hello_cannot_keep_clients_out(daemon: dm.Daemon, over: str) -> None:
    """The cap full of connections that send no hello (re-opened faster than the deadline
    would keep it full): a new client still gets in, because the connection that waited
    longest for its hello makes room; sessions already open are never closed for it."""
    before = refusals(daemon).get((over, "displaced"), 0.0)
    # The tests before have closed their connections; the daemon has seen them go.
    assert dm.wait_for(lambda: not open_lane_sessions(daemon), 10) is not None
    time.sleep(0.3)
    with EmbCacheClient(daemon.unix, token=TOKEN, timeout=30) as member:
        member.put("displace", torch.ones(4))  # its session is open (one connection)
        idle = [lane(daemon, over) for _ in range(CAP - 1)]  # the cap, with the member
        try:
            time.sleep(0.3)  # accepted, well inside the hello deadline
            assert not any(select.select(idle, [], [], 0)[0])  # all held, none refused
            with lane(daemon, over) as newcomer:
                opened = hello_on(newcomer)
                assert opened.WhichOneof("kind") == "opened", opened
            assert closed(idle[0], 5)  # the longest waiting made room
            assert not any(select.select(idle[1:], [], [], 0)[0])
            with member.get("displace", zero_copy=True) as (got,):  # a call: its session works
                assert got is not None
        finally:
            for sock in idle:
                sock.close()
    counted = refusals(daemon).get((over, "displaced"), 0.0) - before
    assert counted == 1, counted
    FIG[f"cap {CAP} full of connections without a hello ({over}), then a client"] = (
        "the client's session opens; the longest-waiting connection is closed"
    )


def test_sessions_never_give_way(daemon: dm.Daemon) -> None:
    """The cap full of sessions (hellos accepted): a new connection is refused, not a
    session closed for it."""
    assert dm.wait_for(lambda: not open_lane_sessions(daemon), 10) is not None
    time.sleep(0.3)  # the tests before have closed their connections
    members = [lane(daemon, "unix") for _ in range(CAP)]
    try:
        for sock in members:
            assert hello_on(sock).WhichOneof("kind") == "opened"
        with lane(daemon, "unix") as newcomer:
            refused = pb.SessionResponse.FromString(
                newcomer.recv(FRAME_HEADER.unpack(newcomer.recv(4, socket.MSG_WAITALL))[0],
                              socket.MSG_WAITALL)
            )  # fmt: skip
            assert refused.result.error.error_type == "QuotaExceeded", refused
        assert not any(select.select(members, [], [], 0.3)[0])  # every session still open
        assert len(open_lane_sessions(daemon)) == CAP
    finally:
        for sock in members:
            sock.close()


def test_zz_figures() -> None:
    print("\n" + figures.table("the session socket before the hello", FIG))
    figures.save("fair_session_socket", FIG)
