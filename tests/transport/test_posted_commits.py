"""Stash commits posted without waiting for an answer: a put returns once its commit is
written to the session socket, and every read that reaches the daemon after that, from any
process and any transport, sees the entry (``service/transport/session/posted.py``)."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import socket
import threading
import time
from typing import Any

import pytest
import torch

from embcache.clients import EmbCacheClient
from embcache.clients._backends.sync_socket_session import SocketSession
from embcache.errors import MetadataConflict
from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.service.transport.session import posted as posted_mod
from embcache.service.transport.session_socket.connection import SessionConnection
from tests.transport.test_session_socket_puts import HEADER, Raw, calls_of, target

KiB, MiB = 1 << 10, 1 << 20
ROUNDS = 150


def pattern(i: int, numel: int = 16 * KiB) -> torch.Tensor:
    return torch.full((numel,), i % 251, dtype=torch.uint8)


def session_kinds(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The kinds of the calls (with an answer) the blocking clients send from now on."""
    kinds: list[str] = []
    real = SocketSession.call

    def call(self: SocketSession, timeout: float, **request: Any) -> pb.SessionResult:
        kinds.extend(request)
        return real(self, timeout, **request)

    monkeypatch.setattr(SocketSession, "call", call)
    return kinds


def _writer(address: str, conn: Any, rounds: int) -> None:
    """Another process: put a key, then tell the reader its name at once."""
    with EmbCacheClient(address, timeout=10) as client:
        for i in range(rounds):
            assert client.put(f"w{i}", pattern(i)) is True
            conn.send(i)
    conn.send(None)


def slow_writers(monkeypatch: pytest.MonkeyPatch, pause_s: float = 0.004) -> None:
    """After each read from a connection that posts commits, the daemon leaves its socket
    unread for ``pause_s`` (as a busy loop would): what the writer posts meanwhile waits in
    the kernel, where a read from another client must not overtake it."""
    real = SessionConnection.data_received

    def data_received(self: SessionConnection, data: bytes) -> None:
        real(self, data)
        transport = self.transport
        if self._posting and transport is not None and not transport.is_closing():
            transport.pause_reading()
            asyncio.get_running_loop().call_later(pause_s, self._update_reading)

    monkeypatch.setattr(SessionConnection, "data_received", data_received)


def test_a_daemon_with_warm_restart_offers_no_posted_commits(server_factory) -> None:
    """Warm restart promises that a put that returned survives a SIGKILL: its commits stay
    calls, answered after the restart index has the entry."""
    with server_factory(host_pool_bytes=8 * MiB) as server:
        raw = Raw(server)
        try:
            assert raw.opened.stash_puts and not raw.opened.HasField("posted_commits")
        finally:
            raw.close()


@pytest.mark.parametrize("reader", ["session socket", "grpc"])
def test_a_put_is_visible_to_another_process_as_soon_as_it_returns(
    server_factory, monkeypatch, reader: str
) -> None:
    """The writer posts each commit and signals the reader straight away; the reader's get
    (a miss in the read table, so a call) must never miss and never read other bytes, even
    while the daemon has not read the writer's socket yet."""
    slow_writers(monkeypatch, 0.01)
    with server_factory(warm_restart=False, host_pool_bytes=32 * MiB) as server:
        ctx = mp.get_context("spawn")
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(target=_writer, args=(target(server), theirs, ROUNDS))
        proc.start()
        waited = server[1].service.servicer.posted
        kwargs: dict[str, Any] = {"session_socket": False} if reader == "grpc" else {}
        try:
            with EmbCacheClient(target(server), timeout=10, **kwargs) as client:
                while (i := ours.recv()) is not None:
                    if i % 2:
                        assert client.exists([f"w{i}"]) == [True]
                    with client.get(f"w{i}") as (got,):
                        assert got is not None, f"w{i} missed after its put returned"
                        assert torch.equal(got, pattern(i))
        finally:
            proc.join(30)
        assert proc.exitcode == 0
        assert "Session.StashCommit" in calls_of(server)
        assert waited.overdue == 0  # (how often a read waited depends on the timing)


def test_a_posted_put_makes_no_call_and_stays_idempotent(server_factory, monkeypatch) -> None:
    with server_factory(warm_restart=False, host_pool_bytes=8 * MiB) as server:
        kinds = session_kinds(monkeypatch)
        with EmbCacheClient(target(server), timeout=10) as client:
            assert client.put("a", pattern(1)) is True
            assert kinds == ["stash_refill"]  # the commit went posted
            # At once again: the table may not list it yet, so this one asks (and learns).
            assert client.put("a", pattern(1)) is False
            with pytest.raises(MetadataConflict):
                client.put("a", torch.zeros(8, dtype=torch.float32))
            assert client.put_many({"b": pattern(2), "c": pattern(3)}) == [True, True]
            assert client.put_many({"b": pattern(2), "d": pattern(4)}) == [False, True]
            for key, i in (("a", 1), ("b", 2), ("c", 3), ("d", 4)):
                with client.get(key) as (got,):
                    assert got is not None and torch.equal(got, pattern(i))
        stats = server[0].stats()
        assert stats.entries_ready == 4 and stats.entries_filling == 0


def test_puts_outside_the_bounds_commit_with_a_call(server_factory, monkeypatch) -> None:
    """A put the daemon could refuse for the request itself is never posted: its error
    comes back from the commit's call."""
    with server_factory(warm_restart=False, host_pool_bytes=8 * MiB, max_key_bytes=16) as server:
        kinds = session_kinds(monkeypatch)
        with EmbCacheClient(target(server), timeout=10) as client:
            with pytest.raises(Exception, match="too long"):
                client.put("k" * 17, pattern(1))
            assert "stash_commit" in kinds or "put" in kinds
            assert client.exists(["k" * 16]) == [False]
        assert server[0].stats().entries_ready == 0


def test_a_posted_commit_that_fails_is_answered_and_logged(server_factory, caplog) -> None:
    """A posted commit naming pages its stash does not hold is refused: nothing is stored,
    and the client is told with a result of call id 0."""
    with server_factory(warm_restart=False, host_pool_bytes=8 * MiB) as server:
        raw = Raw(server)
        try:
            assert raw.opened.HasField("posted_commits")
            refill = raw.call(stash_refill=pb.StashRefillRequest(nbytes=64 * KiB, stash_id=7))
            assert refill.WhichOneof("outcome") == "stash_refill"
            bad = pb.StashedPut(
                header=pb.PutHeader(key="x", dtype="uint8", shape=[4], nbytes=4),
                runs=[pb.ByteRun(offset=refill.stash_refill.runs[0].offset + 64 * KiB, length=4)],
            )
            call = pb.SessionCall(call_id=0, stash_commit=pb.StashCommitRequest(
                stash_id=7, items=[bad]))  # fmt: skip
            body = pb.SessionRequest(call=call).SerializeToString()
            raw.sock.sendall(HEADER.pack(len(body)) + body)
            head = raw._exactly(HEADER.size)
            answer = pb.SessionResponse.FromString(raw._exactly(HEADER.unpack(head)[0]))
            assert answer.result.call_id == 0 and answer.result.error.code == "INVALID_ARGUMENT"
        finally:
            raw.close()
        assert not server[0].exists(["x"])[0]
    from embcache.clients.core.session_calls import note_posted_failure

    with caplog.at_level(logging.WARNING, logger="embcache.client"):
        note_posted_failure(answer.result)
    assert "refused" in caplog.text


def test_a_read_waits_for_a_commit_still_in_the_socket(server_factory) -> None:
    """The daemon has not read the writer's socket yet (its reading paused, as a busy loop
    would leave it): a read of the key from another session waits until the commit in
    the kernel's queue is handled, then finds it; a true miss is answered."""
    with server_factory(warm_restart=False, host_pool_bytes=8 * MiB) as server:
        thread = server[1]
        posted = thread.service.servicer.posted
        with EmbCacheClient(target(server), timeout=10) as writer:
            writer.put("first", pattern(0))  # the writer's connection now posts commits
            with EmbCacheClient(target(server), timeout=10, session_socket=False) as reader:
                assert reader.exists(["first"]) == [True]
                (conn,) = [c for c in thread.service.session_socket._conns if c._posting]
                thread.loop.call_soon_threadsafe(conn.transport.pause_reading)
                time.sleep(0.05)
                writer.put("second", pattern(1))  # posted: it waits in the kernel
                before = posted.waits
                threading.Timer(
                    0.2, thread.loop.call_soon_threadsafe, (conn._update_reading,)
                ).start()
                started = time.monotonic()
                assert reader.exists(["second"]) == [True]
                assert time.monotonic() - started >= 0.1  # it waited for the read
                assert posted.waits == before + 1
                assert reader.exists(["never"]) == [False]  # a true miss: answered
        assert posted.overdue == 0


def test_a_held_back_writer_bounds_the_wait(monkeypatch) -> None:
    """A writer whose bytes are never handled delays a read by the bound only."""
    import asyncio

    class Stuck:
        def written(self) -> int:
            return 10

        def handled_through(self, mark: int) -> bool:
            return False

    commits = posted_mod.PostedCommits(lambda keys: False, wait_s=0.05)
    commits.add(Stuck())
    asyncio.run(commits.settle(["k"]))
    assert commits.waits == 1 and commits.overdue == 1
    started = time.monotonic()
    asyncio.run(commits.settle(["k"]))  # stalled still: not waited for again
    assert commits.waits == 1 and time.monotonic() - started < 0.05
    held = posted_mod.PostedCommits(lambda keys: True, wait_s=0.05)
    held.add(Stuck())
    asyncio.run(held.settle(["k"]))  # every key held: no wait at all
    assert held.waits == 0


def test_unread_bytes_counts_what_the_kernel_queued() -> None:
    from embcache.service.transport.sockets import unread_bytes

    a, b = socket.socketpair()
    try:
        assert unread_bytes(b) == 0
        a.sendall(b"x" * 100)
        assert unread_bytes(b) == 100
        b.recv(40)
        assert unread_bytes(b) == 60
    finally:
        a.close()
        b.close()
    assert unread_bytes(None) == 0


def _put_and_die(address: str, n: int) -> None:
    """Another process: put ``n`` keys, then exit at once, closing nothing."""
    client = EmbCacheClient(address, timeout=10)
    for i in range(n):
        assert client.put(f"d{i}", pattern(i)) is True
    os._exit(0)


def test_puts_that_returned_outlive_a_writer_that_exits_at_once(server_factory) -> None:
    """The writer's process is gone before the daemon may have read its posted commits:
    every put that returned is stored all the same, and its stash goes back."""
    with server_factory(warm_restart=False, host_pool_bytes=32 * MiB) as server:
        engine = server[0]
        ctx = mp.get_context("spawn")
        proc = ctx.Process(target=_put_and_die, args=(target(server), 20))
        proc.start()
        proc.join(30)
        assert proc.exitcode == 0
        with EmbCacheClient(target(server), timeout=10) as reader:
            assert reader.exists([f"d{i}" for i in range(20)]) == [True] * 20
            for i in (0, 19):
                with reader.get(f"d{i}") as (got,):
                    assert got is not None and torch.equal(got, pattern(i))
        assert engine.stats().quarantined_bytes > 0  # the rest of its stash, held
        engine.quarantine.reap()  # the daemon's reaper, once a second
        assert engine.stats().quarantined_bytes == 0
        assert engine.stats().entries_ready == 20
