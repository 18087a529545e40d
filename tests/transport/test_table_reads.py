"""Same-node gets served from the read table (docs/same_node_reads.md): copies with no call,
hits counted and entries kept warm through a posted touch, misses and evictions asked of
the daemon, entries that change under a reader never returned mixed, a daemon without a
table, a draining one, one that died, and hostile touches."""

from __future__ import annotations

import asyncio
import os
import signal
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

from embcache.clients import AsyncEmbCacheClient, EmbCacheClient, RpcFailed
from embcache.clients.device import read_table as client_table
from embcache.clients.device.shm import mapped_segment
from embcache.errors import Draining
from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.service.daemon_process import DaemonProcess

KiB, MiB = 1 << 10, 1 << 20
pytestmark = pytest.mark.skipif(not client_table.ORDERED_STORES, reason="x86-64 only")


def unix_target(thread) -> str:  # type: ignore[no-untyped-def]
    return f"unix:{thread.service.socket_path}"


def gets(thread) -> int:  # type: ignore[no-untyped-def]
    """Session gets the daemon has answered."""
    return sum(m == "Session.Get" for _, m, _ in thread.service.servicer.metrics.by_transport)


def wait_for(predicate, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_a_hit_is_a_copy_read_without_a_call_and_counted(server_factory) -> None:
    # Window 0: every read counts (by default a session counts a key once a second).
    with server_factory(host_pool_bytes=8 * MiB, touch_window_s=0) as (engine, thread):
        x = torch.randn(128, 256, dtype=torch.float16)  # 64 KiB
        with EmbCacheClient(unix_target(thread), timeout=10, copy_gets_up_to=256 * KiB) as c:
            c.put("a", x)
            assert c.exists(["a"]) == [True]  # the posted commit is applied (and listed)
            wait_for(lambda: engine.stats().read_table["entries"] == 1)
            before = gets(thread)
            for _ in range(3):
                with c.get("a") as (g,):
                    assert g is not None and torch.equal(g, x)
                    assert mapped_segment(g) is None  # the client's own memory
                    g.fill_(0)  # a copy: the cache is untouched
            assert gets(thread) == before  # no Get reached the daemon
            wait_for(lambda: engine.stats().read_table["reads"] == 3)
            assert engine.stats().hits == 3 and engine.stats().leases_active == 0
            with c.get(["a", "missing"]) as (g, miss):  # a miss: the daemon answers
                assert miss is None and g is not None and torch.equal(g, x)
            wait_for(lambda: gets(thread) == before + 1)
            assert c.stats()["read_table"]["entries"] == 1


def test_views_and_large_entries_still_go_to_the_daemon(server_factory) -> None:
    with server_factory(host_pool_bytes=8 * MiB) as (_, thread):
        big = torch.arange(128 * KiB, dtype=torch.float32)  # 512 KiB
        with EmbCacheClient(unix_target(thread), timeout=10) as views:
            views.put("small", torch.ones(4))
            views.put("big", big)
            with views.get("small", zero_copy=True) as (v,):  # views asked for
                assert v is not None and mapped_segment(v) is not None  # a view, as ever
            wait_for(lambda: gets(thread) == 1)
        with EmbCacheClient(unix_target(thread), timeout=10, copy_gets_up_to=256 * KiB) as c:
            with c.get("big") as (b,):
                assert b is not None and torch.equal(b, big)
            wait_for(lambda: gets(thread) == 2)


def test_a_touched_entry_is_kept_over_an_untouched_one(server_factory) -> None:
    """Table hits move entries to the LRU's recent end, as a get's would."""
    with server_factory(host_pool_bytes=4 * 64 * KiB) as (engine, thread):  # four pages
        c = EmbCacheClient(unix_target(thread), timeout=10, copy_gets_up_to=256 * KiB)
        with c:
            for key in "abcd":
                c.put(key, torch.full((16 * KiB,), float(ord(key))))  # a page each
            assert c.exists(list("abcd")) == [True] * 4  # the posted commits are applied
            with c.get("a") as (g,):  # the oldest, now the most recent
                assert g is not None
            wait_for(lambda: engine.stats().read_table["reads"] == 1)
            c.put("e", torch.ones(16 * KiB))  # evicts the least recently used: b
            assert c.exists(["e"]) == [True]  # its posted commit is applied
            keys = {e.key for e in engine.host_store.snapshot("ready")}
            assert "a" in keys and "b" not in keys


def test_evicted_and_replaced_entries_read_as_they_are_now(server_factory) -> None:
    with server_factory(host_pool_bytes=8 * MiB) as (_, thread):
        c = EmbCacheClient(unix_target(thread), timeout=10, copy_gets_up_to=256 * KiB)
        with c:
            c.put("k", torch.full((1000,), 1.0))
            with c.get("k") as (g,):
                assert g is not None and torch.equal(g, torch.full((1000,), 1.0))
            c.evict(["k"])
            with c.get("k") as (g,):
                assert g is None
            c.put("k", torch.full((10, 10), 2, dtype=torch.int32))
            with c.get("k") as (g,):
                assert g is not None and torch.equal(g, torch.full((10, 10), 2, dtype=torch.int32))


def test_entries_changing_under_a_reader_are_never_returned_mixed(server_factory) -> None:
    """A writer evicts and puts again, with new values, the keys a reader reads in a loop:
    every copy the reader gets is one whole version of its entry (bounded in count)."""
    with server_factory(host_pool_bytes=8 * MiB, page_bytes=16 * KiB) as (engine, thread):
        keys = [f"k{i}" for i in range(4)]
        n = 8 * KiB  # float32: 32 KiB, two pages
        writer = EmbCacheClient(unix_target(thread), timeout=10)
        reader = EmbCacheClient(unix_target(thread), timeout=10, copy_gets_up_to=256 * KiB)
        with writer, reader:
            for key in keys:
                writer.put(key, torch.full((n,), 0.0))
            stop = threading.Event()

            def churn() -> None:
                version = 0
                while not stop.is_set() and version < 400:
                    version += 1
                    key = keys[version % len(keys)]
                    engine.evict([key])
                    writer.put(key, torch.full((n,), float(version)))

            t = threading.Thread(target=churn)
            t.start()
            seen = 0
            try:
                for _ in range(1500):
                    with reader.get(keys[seen % len(keys)]) as (g,):
                        if g is not None:
                            assert g.shape == (n,)
                            assert torch.all(g == g[0]), "a copy mixed two versions"
                    seen += 1
            finally:
                stop.set()
                t.join(timeout=30)
            assert engine.stats().read_table["reads"] > 0


def test_a_daemon_without_a_table_answers_every_get(server_factory) -> None:
    with server_factory(host_pool_bytes=8 * MiB, read_table=False) as (engine, thread):
        assert engine.read_table is None
        with EmbCacheClient(unix_target(thread), timeout=10, copy_gets_up_to=256 * KiB) as c:
            c.put("a", torch.ones(8))
            assert c._conn.open_session().read_table is None
            with c.get("a") as (g,):
                assert g is not None and torch.equal(g, torch.ones(8))
            wait_for(lambda: gets(thread) == 1)
            assert "reads" not in c.stats()["read_table"] or not c.stats()["read_table"]["reads"]


def test_a_draining_daemon_refuses_gets_the_table_would_have_served(server_factory) -> None:
    with server_factory(host_pool_bytes=8 * MiB) as (engine, thread):
        c = EmbCacheClient(unix_target(thread), timeout=10, copy_gets_up_to=256 * KiB)
        with c:
            c.put("a", torch.ones(8))
            with c.get("a") as (g,):
                assert g is not None
            engine.begin_drain()
            with pytest.raises(Draining):
                c.get("a")


def test_a_killed_daemon_is_reported_not_served_from_its_table(shm_name: str) -> None:
    with tempfile.TemporaryDirectory(prefix="ecr-") as d:
        sock = str(Path(d) / "s.sock")
        flags = ["--grpc-socket", sock, "--host-pool-bytes", str(8 * MiB), "--shm-name", shm_name]
        daemon = DaemonProcess(flags)
        try:
            c = EmbCacheClient(daemon.unix_target, timeout=2, retries=0, copy_gets_up_to=1 * MiB)
            c.put("a", torch.ones(8))
            with c.get("a") as (g,):
                assert g is not None
            os.kill(daemon.proc.pid, signal.SIGKILL)
            daemon.proc.wait(timeout=30)
            with pytest.raises(RpcFailed), c.get("a"):
                pass
            c.close()
        finally:
            daemon.stop()
            for suffix in ("", ".reads"):  # what a killed daemon leaves
                Path("/dev/shm", shm_name + suffix).unlink(missing_ok=True)


def test_the_async_client_reads_the_table_too(server_factory) -> None:
    with server_factory(host_pool_bytes=8 * MiB) as (engine, thread):

        async def run() -> None:
            async with AsyncEmbCacheClient(
                unix_target(thread), timeout=10, copy_gets_up_to=256 * KiB
            ) as c:
                await c.put("a", torch.arange(100))
                assert await c.exists(["a"]) == [True]  # the posted commit is applied
                wait_for(lambda: engine.stats().read_table["entries"] == 1)
                before = gets(thread)
                async with c.get("a") as (g,):
                    assert g is not None and torch.equal(g, torch.arange(100))
                assert gets(thread) == before

        asyncio.run(run())
        wait_for(lambda: engine.stats().read_table["reads"] == 1)


def test_touches_are_counted_only_for_cached_keys_and_bounded(server_factory) -> None:
    """A hostile client posting touches cannot count hits for keys that are not cached, nor a
    key twice in one window, and an oversized touch is refused without ending its session."""
    with server_factory(host_pool_bytes=8 * MiB, touch_window_s=600) as (engine, thread):
        c = EmbCacheClient(unix_target(thread), timeout=10)
        with c:
            c.put("a", torch.ones(8))
            session = c._conn.open_session()
            session.post(now=True, touch=pb.TouchRequest(keys=["a", "nope", "nope"]))
            wait_for(lambda: engine.stats().read_table["reads"] == 1)
            assert engine.stats().hits == 1
            result = session.call(10, touch=pb.TouchRequest(keys=["a", "nope"]))
            assert result.touch.touched == 1  # still cached; not a hit again this window
            assert engine.stats().hits == 1
            result = session.call(10, touch=pb.TouchRequest(keys=["x"] * 5000))
            assert result.WhichOneof("outcome") == "error"
            assert result.error.code == "INVALID_ARGUMENT"
            session.post(now=True, touch=pb.TouchRequest(keys=["y"] * 5000))  # logged only
            # The session goes on. The miss makes the get a call, whose hit on "a" counts
            # whatever the touch window (a read from the table would be inside it).
            with c.get(["a", "nope"]) as (g, miss):
                assert g is not None and miss is None
            assert engine.stats().hits == 2  # the touch, and the get


def test_a_get_with_a_bad_lifetime_is_refused_as_before(server_factory) -> None:
    """A lease lifetime is the daemon's to check: a get that names one is a call."""
    from embcache.errors import InvalidArgument

    with server_factory(host_pool_bytes=8 * MiB) as (_, thread):
        c = EmbCacheClient(unix_target(thread), timeout=10, copy_gets_up_to=256 * KiB)
        with c:
            c.put("a", torch.ones(8))
            with pytest.raises(InvalidArgument):
                c.get("a", ttl_s=-1.0)
            with c.get("a", ttl_s=5.0) as (g,):
                assert g is not None and torch.equal(g, torch.ones(8))
            wait_for(lambda: gets(thread) >= 1)
