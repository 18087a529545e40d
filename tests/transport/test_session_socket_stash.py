"""Stashed puts on the session socket (service/transport/session/host_puts.py, the stash
calls): the client writes into pages the daemon holds for its process and commits them
under keys; hostile commits are refused and leave the stash as it was; a client killed
mid-put leaves its pages reclaimed and nothing visible."""

from __future__ import annotations

import mmap
import os
import signal
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import pytest

from embcache.clients import EmbCacheClient
from embcache.clients.core.targets import session_socket_path
from embcache.errors import PermissionDenied
from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.service.transport.session.host_puts import SessionPuts

from .test_session_socket_puts import Raw, calls_of, target

KiB, MiB = 1 << 10, 1 << 20
PAGE = 64 * KiB  # temp_server's pages


def mapping(opened: pb.StashRefillResponse) -> mmap.mmap:
    """The pool's segment mapped for writing, as a same-uid client maps it."""
    path = Path("/dev/shm") / opened.pool.host_shm.segment_name
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, opened.pool.host_shm.size)
    finally:
        os.close(fd)


def runs_for(free: list[tuple[int, int]], nbytes: int) -> list[pb.ByteRun]:
    """Byte runs of ``nbytes`` carved from the front of ``free`` (whole pages taken)."""
    out = []
    while nbytes > 0:
        offset, length = free.pop(0)
        take = min(length, -(-nbytes // PAGE) * PAGE)
        if take < length:
            free.insert(0, (offset + take, length - take))
        out.append(pb.ByteRun(offset=offset, length=min(take, nbytes)))
        nbytes -= take
    return out


def write(mm: mmap.mmap, runs: list[pb.ByteRun], data: bytes) -> None:
    pos = 0
    for run in runs:
        mm[run.offset : run.offset + run.length] = data[pos : pos + run.length]
        pos += run.length


def item(key: str, runs: list[pb.ByteRun], data: bytes, crc: bool = True) -> pb.StashedPut:
    head = pb.PutHeader(key=key, dtype="uint8", shape=[len(data)], nbytes=len(data))
    if crc:
        head.checksum = zlib.crc32(data)
    return pb.StashedPut(header=head, runs=runs)


def free_pages(server) -> int:  # type: ignore[no-untyped-def]
    return server[0].stats().host.free_pages


def test_stashed_puts_are_visible_to_other_clients_once_committed(server_factory) -> None:
    with server_factory(host_pool_bytes=4 * MiB) as server:
        raw = Raw(server)
        try:
            assert raw.opened.stash_puts
            total = free_pages(server)
            got = raw.call(stash_refill=pb.StashRefillRequest(nbytes=MiB, stash_id=77))
            refill = got.stash_refill
            assert refill.page_bytes == PAGE and sum(r.length for r in refill.runs) == MiB
            assert free_pages(server) == total - MiB // PAGE
            free = [(r.offset, r.length) for r in refill.runs]
            mm = mapping(refill)
            a, b = os.urandom(100_000), os.urandom(3 * PAGE)
            ra, rb = runs_for(free, len(a)), runs_for(free, len(b))
            write(mm, ra, a)
            write(mm, rb, b)
            commit = pb.StashCommitRequest(stash_id=77, items=[item("a", ra, a), item("b", rb, b)])
            results = raw.call(stash_commit=commit).stash_commit.results
            assert [r.created for r in results] == [True, True]
            assert [r.nbytes for r in results] == [len(a), len(b)]
            with EmbCacheClient(target(server)) as reader, reader.get(["a", "b"]) as (x, y):
                assert x is not None and x.numpy().tobytes() == a
                assert y is not None and y.numpy().tobytes() == b
            # What is left goes back on the client's word.
            assert raw.call(put_abort=pb.PutAbortRequest(reservation_id=77)).put_abort
            assert free_pages(server) == total - 2 - 3  # a: 2 pages, b: 3
            mm.close()
        finally:
            raw.close()
        assert "Session.StashCommit" in calls_of(server)


@pytest.mark.parametrize(
    "bad",
    ["foreign page", "off a page", "short", "twice", "same key twice", "no stash", "stash id 0"],
)
def test_a_hostile_commit_is_refused_and_the_stash_stays_whole(server_factory, bad) -> None:
    with server_factory(host_pool_bytes=4 * MiB) as server:
        raw = Raw(server)
        try:
            refill = raw.call(stash_refill=pb.StashRefillRequest(nbytes=4 * PAGE, stash_id=5))
            free = [(r.offset, r.length) for r in refill.stash_refill.runs]
            data = bytes(range(256)) * (PAGE // 256)
            runs = runs_for(list(free), PAGE)
            stash_id, items = 5, [item("k", runs, data)]
            if bad == "foreign page":
                other = raw.call(stash_refill=pb.StashRefillRequest(nbytes=PAGE, stash_id=6))
                items = [item("k", list(other.stash_refill.runs), data)]
            elif bad == "off a page":
                items = [item("k", [pb.ByteRun(offset=runs[0].offset + 8, length=PAGE)], data)]
            elif bad == "short":
                items = [item("k", [pb.ByteRun(offset=runs[0].offset, length=PAGE - 1)], data)]
            elif bad == "twice":
                items = [item("k", runs, data), item("j", runs, data)]
            elif bad == "same key twice":
                rest = list(free)
                first, second = runs_for(rest, PAGE), runs_for(rest, PAGE)
                items = [item("k", first, data), item("k", second, data)]
            elif bad == "no stash":
                stash_id = 999
            else:
                stash_id = 0
            result = raw.call(stash_commit=pb.StashCommitRequest(stash_id=stash_id, items=items))
            assert result.WhichOneof("outcome") == "error"
            assert result.error.code in {"INVALID_ARGUMENT", "NOT_FOUND"}, result.error
            assert server[0].exists(["k", "j"]) == [False, False]
            # The stash is whole: all four pages commit.
            mm = mapping(refill.stash_refill)
            whole = runs_for(list(free), 4 * PAGE)
            write(mm, whole, data * 4)
            ok = pb.StashCommitRequest(stash_id=5, items=[item("k", whole, data * 4)])
            assert raw.call(stash_commit=ok).stash_commit.results[0].created
            mm.close()
        finally:
            raw.close()


def test_a_bad_checksum_publishes_nothing_and_its_pages_go_back(server_factory) -> None:
    with server_factory(host_pool_bytes=4 * MiB) as server:
        raw = Raw(server)
        try:
            total = free_pages(server)
            refill = raw.call(stash_refill=pb.StashRefillRequest(nbytes=2 * PAGE, stash_id=9))
            free = [(r.offset, r.length) for r in refill.stash_refill.runs]
            runs = runs_for(free, PAGE)
            mm = mapping(refill.stash_refill)
            write(mm, runs, bytes(PAGE))
            wrong = item("k", runs, b"\x01" * PAGE)  # the checksum of other bytes
            result = raw.call(stash_commit=pb.StashCommitRequest(stash_id=9, items=[wrong]))
            assert result.error.error_type == "ChecksumMismatch", result.error
            assert server[0].exists(["k"]) == [False]
            assert free_pages(server) == total - 1  # the page named went back
            mm.close()
        finally:
            raw.close()


def test_a_writer_killed_mid_put_leaves_its_pages_reclaimed(server_factory, wait_until) -> None:
    with server_factory(host_pool_bytes=4 * MiB) as server:
        total = free_pages(server)
        path = session_socket_path(target(server))
        child = textwrap.dedent(
            f"""
            import mmap, os, socket, struct, time
            from embcache.proto.embcache.v1 import embcache_pb2 as pb
            H = struct.Struct("<I")
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect({path!r})
            def ask(m):
                b = m.SerializeToString(); s.sendall(H.pack(len(b)) + b)
                n = H.unpack(s.recv(4, socket.MSG_WAITALL))[0]
                return pb.SessionResponse.FromString(s.recv(n, socket.MSG_WAITALL))
            ask(pb.SessionRequest(hello=pb.SessionHello(client_name="doomed")))
            req = pb.StashRefillRequest(nbytes={MiB}, stash_id=3)
            got = ask(pb.SessionRequest(call=pb.SessionCall(call_id=1, stash_refill=req)))
            r = got.result.stash_refill
            fd = os.open("/dev/shm/" + r.pool.host_shm.segment_name, os.O_RDWR)
            mm = mmap.mmap(fd, r.pool.host_shm.size)
            run = r.runs[0]
            mm[run.offset : run.offset + 4096] = b"x" * 4096  # half-way through a put
            print("writing", flush=True)
            time.sleep(60)
            """
        )
        proc = subprocess.Popen(
            [sys.executable, "-c", child], stdout=subprocess.PIPE, text=True, cwd=os.getcwd()
        )
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "writing"
            assert free_pages(server) == total - MiB // PAGE  # held while it may write
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            if proc.stdout is not None:
                proc.stdout.close()
        # The daemon's reaper finds the process gone (run here by hand: no reaper in process).
        assert wait_until(lambda: server[0].quarantine.reap() >= 0 and free_pages(server) == total)
        assert server[0].stats().entries_ready == 0


def test_a_stash_is_only_for_a_peer_that_may_write_the_segment(server_factory) -> None:
    with server_factory() as server:
        engine = server[0]
        pool = pb.PoolHandle()
        for writable, writer in [(False, "s"), (True, None)]:  # another uid; no peer known
            puts = SessionPuts(engine, pool, "q", writable=writable, writer=writer)
            with pytest.raises(PermissionDenied):
                puts.stash_refill(pb.StashRefillRequest(nbytes=PAGE, stash_id=1))
            with pytest.raises(PermissionDenied):
                puts.stash_commit(pb.StashCommitRequest(stash_id=1))
        assert engine.stats().host.free_pages == engine.stats().host.total_pages


def test_a_clients_stash_outlives_its_session_and_goes_back_at_close(server_factory) -> None:
    import torch

    with server_factory(host_pool_bytes=8 * MiB) as server:
        engine = server[0]
        with EmbCacheClient(target(server)) as c:
            assert c.put("a", torch.full((3 * PAGE,), 1, dtype=torch.uint8)) is True
            assert c.exists(["a"]) == [True]  # its posted commit is applied
            held = engine.stats().quarantined_bytes
            assert held > 0  # what is left of the stash, held for this process
            c._conn.session.close()  # the session goes (as a dropped connection would)
            assert c.put("b", torch.full((2 * PAGE,), 2, dtype=torch.uint8)) is True
            assert c.exists(["b"]) == [True]  # its posted commit is applied
            # committed into the same stash from a new session: no second refill
            assert calls_of(server).count("Session.StashRefill") == 1
            assert engine.stats().quarantined_bytes == held - 2 * PAGE
            with c.get(["a", "b"]) as (a, b):
                assert a is not None and int(a[0]) == 1 and int(b[-1]) == 2
        assert engine.stats().quarantined_bytes == 0  # given back at close


def test_a_client_filling_the_pool_loses_no_entry_to_its_stash(server_factory) -> None:
    import torch

    # 64 KiB pages; the stash's spare pages (a share of the pool beyond a put's need) come
    # only from free pages, so filling the pool to its last pages evicts nothing.
    with server_factory(host_pool_bytes=16 * MiB) as server:
        engine = server[0]
        pages = free_pages(server)
        # 3 pages each: a stash's last pages too few for the next put go back with the
        # next refill instead of sitting idle
        keys = [f"k{i}" for i in range(pages // 3)]
        with EmbCacheClient(target(server)) as c:
            for i, key in enumerate(keys):
                assert c.put(key, torch.full((3 * PAGE,), i % 251, dtype=torch.uint8)) is True
            assert calls_of(server).count("Session.StashRefill") > 1
            assert c.exists(keys) == [True] * len(keys)
            assert engine.stats().evictions == 0
        assert free_pages(server) == pages % 3  # the stash's leftovers went back at close


def test_a_refill_gives_back_the_stashes_it_names_from_a_bounded_list(server_factory) -> None:
    with server_factory(host_pool_bytes=4 * MiB) as server:
        raw = Raw(server)
        try:
            free0 = free_pages(server)
            first = raw.call(stash_refill=pb.StashRefillRequest(nbytes=2 * PAGE, stash_id=5))
            assert first.WhichOneof("outcome") == "stash_refill"
            assert free_pages(server) == free0 - 2
            # too long a list: refused before anything is given back or taken
            many = pb.StashRefillRequest(nbytes=PAGE, stash_id=6, give_back=range(1, 2000))
            refused = raw.call(stash_refill=many)
            assert refused.error.code == "INVALID_ARGUMENT", refused
            assert free_pages(server) == free0 - 2
            # ids it does not hold are ignored; stash 5 goes back in the same call
            swap = pb.StashRefillRequest(nbytes=PAGE, stash_id=6, give_back=[5, 77, 5])
            assert raw.call(stash_refill=swap).WhichOneof("outcome") == "stash_refill"
            assert free_pages(server) == free0 - 1
        finally:
            raw.close()
