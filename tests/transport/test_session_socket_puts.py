"""Host puts on the session socket (service/transport/session/host_puts.py,
clients/_async/host_puts.py): inline puts and batches, reserved pages the client fills
through a writable mapping, and what each leaves behind when it fails."""

from __future__ import annotations

import asyncio
import socket
import struct
import zlib

import pytest
import torch

from embcache.clients import AsyncEmbCacheClient, EmbCacheClient
from embcache.clients._async import host_puts
from embcache.clients.core.targets import session_socket_path
from embcache.errors import InvalidArgument, MetadataConflict, QuotaExceeded
from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.service.transport.session.host_puts import may_write_segment
from embcache.service.transport.session.registry import PeerCreds

KiB, MiB = 1 << 10, 1 << 20
HEADER = struct.Struct("<I")


def target(server) -> str:  # type: ignore[no-untyped-def]
    return f"unix:{server[1].service.socket_path}"


def no_fill_left(engine) -> bool:  # type: ignore[no-untyped-def]
    """Nothing FILLING and every page free (no READY entries in these checks)."""
    stats = engine.stats()
    return (
        stats.entries_filling == 0
        and stats.reserved_filling_bytes == 0
        and stats.host.free_pages == stats.host.total_pages
    )


def calls_of(server) -> list[str]:  # type: ignore[no-untyped-def]
    return [m for t, m, _ in server[1].service.servicer.metrics.by_transport if t == "lane"]


# -- a raw session on the socket ---------------------------------------------------------------
class Raw:
    """A session on the session socket spoken by hand (frames of SessionRequest)."""

    def __init__(self, server) -> None:  # type: ignore[no-untyped-def]
        path = session_socket_path(target(server))
        assert path is not None
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(path)
        self.opened = self._ask(pb.SessionRequest(hello=pb.SessionHello(client_name="raw"))).opened
        self._id = 0

    def _ask(self, msg: pb.SessionRequest) -> pb.SessionResponse:
        body = msg.SerializeToString()
        self.sock.sendall(HEADER.pack(len(body)) + body)
        head = self._exactly(HEADER.size)
        return pb.SessionResponse.FromString(self._exactly(HEADER.unpack(head)[0]))

    def _exactly(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            got = self.sock.recv(n - len(data))
            assert got, "the daemon closed the session"
            data += got
        return data

    def call(self, **request: object) -> pb.SessionResult:
        self._id += 1
        call = pb.SessionCall(call_id=self._id, **request)  # type: ignore[arg-type]
        result = self._ask(pb.SessionRequest(call=call)).result
        assert result.call_id == self._id
        return result

    def close(self) -> None:
        self.sock.close()


def header(key: str, data: bytes, dtype: str = "uint8", crc: bool = True) -> pb.PutHeader:
    head = pb.PutHeader(key=key, dtype=dtype, shape=[len(data)], nbytes=len(data))
    if crc:
        head.checksum = zlib.crc32(data)
    return head


# -- the decision ------------------------------------------------------------------------------
def test_only_a_peer_with_the_daemons_uid_may_write_the_segment() -> None:
    assert may_write_segment(PeerCreds(pid=10, uid=1000, gid=1000), 1000)
    assert not may_write_segment(PeerCreds(pid=10, uid=1001, gid=1000), 1000)
    assert not may_write_segment(PeerCreds(pid=10, uid=0, gid=0), 1000)  # not even root
    assert not may_write_segment(None, 1000)  # gRPC: no peer credentials


def test_the_daemon_says_what_it_serves(server_factory) -> None:
    with server_factory() as server:
        raw = Raw(server)
        try:
            assert raw.opened.host_puts and raw.opened.writable_puts  # same uid: this test
        finally:
            raw.close()


def inline_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every peer counts as another user's: no stash, so puts go inline (or streamed)."""
    from embcache.service.transport.session import service as sessions

    monkeypatch.setattr(sessions, "may_write_segment", lambda peer, uid: False)


# -- inline and stashed puts -------------------------------------------------------------------
@pytest.mark.parametrize("path", ["stash", "inline"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("numel", [0, 1, 3000, 64 * KiB // 4])
def test_put_round_trips(server_factory, monkeypatch, wait_until, path, dtype, numel) -> None:
    if path == "inline":
        inline_only(monkeypatch)
    with server_factory() as server, EmbCacheClient(target(server)) as client:
        engine = server[0]
        tensor = (torch.arange(numel, dtype=torch.float32) * 0.37 - 5).to(dtype)
        assert client.put("k", tensor) is True
        assert client.put("k", tensor) is False  # idempotent
        with client.get("k") as (got,):
            assert got is not None and got.dtype == dtype and torch.equal(got, tensor)
        stashed = path == "stash" and numel > 0  # an empty entry has no pages: inline
        kind = "Session.StashCommit" if stashed else "Session.Put"
        assert wait_until(lambda: kind in calls_of(server))  # a posted commit's, once applied
        assert ("grpc", "Put", "OK") not in server[1].service.servicer.metrics.by_transport
        assert engine.stats().entries_filling == 0


def test_put_many_commits_once_into_the_stash(server_factory) -> None:
    with server_factory(host_pool_bytes=4 * MiB) as server, EmbCacheClient(target(server)) as c:
        items = {f"k{i}": torch.full((16 * KiB,), i, dtype=torch.uint8) for i in range(40)}
        assert c.put_many(items) == [True] * 40
        assert c.exists(list(items)) == [True] * 40  # the posted commit is applied
        assert calls_of(server).count("Session.StashCommit") == 1  # all 40 at once
        before = len(calls_of(server))
        assert c.put_many(items) == [False] * 40  # listed in the read table: no call
        assert len(calls_of(server)) == before
        for key, tensor in items.items():
            with c.get(key) as (got,):
                assert got is not None and torch.equal(got, tensor)
        assert "Session.Put" not in calls_of(server) and "Session.PutBatch" not in calls_of(server)


def test_put_many_goes_in_batches_and_checks_every_byte(server_factory, monkeypatch) -> None:
    inline_only(monkeypatch)
    with server_factory(host_pool_bytes=4 * MiB) as server, EmbCacheClient(target(server)) as c:
        items = {f"k{i}": torch.full((16 * KiB,), i, dtype=torch.uint8) for i in range(40)}
        assert c.put_many(items) == [True] * 40
        assert c.put_many(items) == [False] * 40
        for key, tensor in items.items():
            with c.get(key) as (got,):
                assert got is not None and torch.equal(got, tensor)
        # 640 KiB packed into one call of up to 1 MiB; the second round was listed in the
        # read table already: no call.
        assert calls_of(server).count("Session.PutBatch") == 1
        assert "Session.Put" not in calls_of(server)


def test_bad_inline_puts_leave_nothing(server_factory) -> None:
    with server_factory() as server:
        engine = server[0]
        raw = Raw(server)
        try:
            data = bytes(range(256)) * 64
            bad_crc = header("a", data)
            bad_crc.checksum ^= 1
            too_few = header("b", data)
            too_many = header("c", data)
            bad_dtype = header("d", data, dtype="complex64")
            cases = [
                (bad_crc, data, "ChecksumMismatch"),
                (too_few, data[:-1], "InvalidArgument"),
                (too_many, data + b"x", "InvalidArgument"),
                (bad_dtype, data, "InvalidArgument"),
                (header("", data), data, "InvalidArgument"),
            ]
            for head, payload, error in cases:
                result = raw.call(put=pb.SessionPut(header=head, data=payload))
                assert result.error.error_type == error, head
                assert no_fill_left(engine)
            # A batch with one bad item stores none of them.
            good = pb.SessionPut(header=header("g", data), data=data)
            bad = pb.SessionPut(header=bad_crc, data=data)
            result = raw.call(put_batch=pb.SessionPutBatch(items=[good, bad]))
            assert result.error.error_type == "ChecksumMismatch"
            dup = raw.call(put_batch=pb.SessionPutBatch(items=[good, good]))
            assert dup.error.error_type == "InvalidArgument"
            assert no_fill_left(engine) and engine.exists(["g"]) == [False]
            assert engine.stats().entries_ready == 0
        finally:
            raw.close()


@pytest.mark.parametrize("path", ["stash", "inline"])
def test_metadata_conflict_and_quota_apply(server_factory, monkeypatch, path) -> None:
    if path == "inline":
        inline_only(monkeypatch)
    quota = 128 * KiB
    server_of = server_factory(max_inflight_bytes_per_client=quota)
    with server_of as server, EmbCacheClient(target(server)) as client:
        client.put("k", torch.zeros(100, dtype=torch.float32))
        with pytest.raises(MetadataConflict):
            client.put("k", torch.zeros(100, dtype=torch.float16))
        big = [(f"q{i}", torch.zeros(64 * KiB, dtype=torch.uint8)) for i in range(3)]
        with pytest.raises(QuotaExceeded):  # 192 KiB in flight in one batch
            client.put_many(big)
        assert no_fill_left_but(server[0], entries=1)


def no_fill_left_but(engine, entries: int) -> bool:  # type: ignore[no-untyped-def]
    stats = engine.stats()
    return stats.entries_filling == 0 and stats.entries_ready == entries


# -- reserved pages ----------------------------------------------------------------------------
def test_large_put_is_written_into_a_stash(server_factory) -> None:
    with server_factory(host_pool_bytes=8 * MiB) as server, EmbCacheClient(target(server)) as c:
        tensor = torch.randn(3 * MiB // 4)  # 3 MiB: above the inline bound
        assert c.put("big", tensor) is True
        assert c.put("big", tensor) is False
        with c.get("big") as (got,):
            assert got is not None and torch.equal(got, tensor)
        lane = calls_of(server)
        assert "Session.StashCommit" in lane and "Session.Put" not in lane
        assert ("grpc", "Put", "OK") not in server[1].service.servicer.metrics.by_transport
        assert server[0].stats().entries_filling == 0


def test_a_peer_without_write_access_is_refused_and_streams(server_factory, monkeypatch) -> None:
    from embcache.service.transport.session import service as sessions

    # The daemon decides with the peer's uid; here every peer counts as another user's.
    monkeypatch.setattr(sessions, "may_write_segment", lambda peer, uid: False)
    with server_factory(host_pool_bytes=8 * MiB) as server:
        raw = Raw(server)
        try:
            assert raw.opened.host_puts and not raw.opened.stash_puts
            request = pb.StashRefillRequest(nbytes=2 * MiB, stash_id=1)
            refused = raw.call(stash_refill=request)
            assert refused.error.error_type == "PermissionDenied"
            assert no_fill_left(server[0])
        finally:
            raw.close()
        before = calls_of(server).count("Session.StashCommit")
        with EmbCacheClient(target(server)) as client:
            tensor = torch.randn(MiB)  # 4 MiB: streamed over gRPC instead
            assert client.put("x", tensor) is True
            with client.get("x") as (got,):
                assert got is not None and torch.equal(got, tensor)
        assert calls_of(server).count("Session.StashCommit") == before
        assert ("grpc", "Put", "OK") in server[1].service.servicer.metrics.by_transport


# -- fallbacks and the asyncio client ----------------------------------------------------------
def test_without_the_session_socket_puts_stream_over_grpc(server_factory) -> None:
    with server_factory() as server:
        with EmbCacheClient(target(server), session_socket=False) as client:
            tensor = torch.arange(5000, dtype=torch.int32)
            assert client.put("g", tensor) is True  # inline on the gRPC Session stream
            assert client.put_many({"h": tensor, "i": tensor}) == [True, True]
            with client.get(["g", "h", "i"]) as got:
                assert all(t is not None and torch.equal(t, tensor) for t in got)
        assert not calls_of(server)


def test_a_daemon_without_host_puts_gets_streams(server_factory, monkeypatch) -> None:
    from embcache.clients.core import session_calls

    real = session_calls.serves

    def older(session, kind: str) -> bool:  # type: ignore[no-untyped-def]
        return False if kind.startswith(("put", "stash")) else real(session, kind)

    monkeypatch.setattr(host_puts, "serves", older)
    from embcache.clients._sync import host_puts as sync_host_puts

    monkeypatch.setattr(sync_host_puts, "serves", older)
    from embcache.clients._sync import stash_puts

    monkeypatch.setattr(stash_puts, "serves", older)
    with server_factory(host_pool_bytes=4 * MiB) as server, EmbCacheClient(target(server)) as c:
        assert c.put_many({"a": torch.ones(10), "b": torch.ones(300_000)}) == [True, True]
        with c.get(["a", "b"]) as (a, b):
            assert a is not None and torch.equal(a, torch.ones(10))
            assert b is not None and torch.equal(b, torch.ones(300_000))
        assert ("grpc", "Put", "OK") in server[1].service.servicer.metrics.by_transport
        assert not [m for m in calls_of(server) if m.startswith("Session.Put")]


def test_asyncio_client_puts_into_its_stash(server_factory) -> None:
    with server_factory(host_pool_bytes=8 * MiB) as server:

        async def main() -> None:
            async with AsyncEmbCacheClient(target(server)) as client:
                small, big = torch.arange(1000.0), torch.randn(MiB)
                assert await client.put("s", small) is True
                assert await client.put("b", big) is True
                assert await client.put_many({"s": small, "t": small}) == [False, True]
                leased = await client.get(["s", "b", "t"])
                s, b, t = leased
                assert s is not None and torch.equal(s, small)
                assert b is not None and torch.equal(b, big)
                assert t is not None and torch.equal(t, small)
                del s, b, t
                await leased.release()
                del leased  # it holds the views: the session ends once they are gone
                with pytest.raises(InvalidArgument):
                    await client.put("", small)

        asyncio.run(main())
        lane = calls_of(server)
        assert {"Session.StashRefill", "Session.StashCommit"} <= set(lane)
        assert "Session.Put" not in lane and "Session.PutBatch" not in lane


def test_inline_puts_and_releases_are_answered_without_a_task(
    server_factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the session socket a put with its bytes inline, a release and a failing put are
    answered inside the read of their frame (no task), with the same results and errors,
    and a refused put leaves nothing behind."""
    inline_only(monkeypatch)
    from embcache.service.transport.session import calls

    tasked: list[str] = []
    real_run = calls.SessionCalls._run

    async def recording(self: calls.SessionCalls, call: pb.SessionCall) -> None:
        tasked.append(call.WhichOneof("request") or "")
        await real_run(self, call)

    monkeypatch.setattr(calls.SessionCalls, "_run", recording)
    with server_factory(host_pool_bytes=8 << 20) as (engine, thread):
        target = f"unix:{thread.service.socket_path}"
        with EmbCacheClient(target, timeout=10) as client:
            x = torch.randn(16384)  # 64 KiB: inline
            assert client.put("a", x) is True
            assert client.put("a", x) is False  # idempotent, as ever
            with pytest.raises(MetadataConflict):
                client.put("a", torch.randn(8))
            assert client.put_many({"b": torch.ones(4), "c": torch.zeros(3)}) == [True, True]
            session = client._conn.open_session()
            result = session.call(10, release=pb.ReleaseRequest(lease_ids=[12345]))
            assert result.release.released == 0
            # A get call still runs as a task (the miss keeps it off the read table).
            with client.get(["a", "b", "nope"]) as (a, b, nope):
                assert torch.equal(a, x) and torch.equal(b, torch.ones(4)) and nope is None
        assert "put" not in tasked and "put_batch" not in tasked and "release" not in tasked
        assert "get" in tasked
        stats = engine.stats()
        assert stats.entries_filling == 0 and stats.entries_ready == 3
        metrics = thread.service.servicer.metrics.by_transport
        assert ("lane", "Session.Put", "OK") in metrics
        assert ("lane", "Session.Put", "FAILED_PRECONDITION") in metrics  # the conflict
        assert ("lane", "Session.PutBatch", "OK") in metrics
