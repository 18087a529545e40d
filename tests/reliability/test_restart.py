"""Warm restart (issue 31), against real daemons: a daemon started on the segment a previous
one left serves every READY entry it held, with equal bytes; a SIGKILL mid-put loses only
the puts that had not returned; a corrupted page drops its entry (counted); a segment of
another layout is replaced (logged); clients reconnect by themselves and a host view held
across the restart keeps its bytes; ``--warm-restart off`` starts cold as before."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from relkit import daemon as dm
from relkit import figures, payload

from embcache.clients import EmbCacheClient
from embcache.service.host import index_records as rec

KiB, MiB = 1 << 10, 1 << 20
ROW = payload.HIDDEN * 2  # bf16 rows: payload sizes are multiples of this
FIG: dict[str, object] = {}
KILL_ROUNDS = 20


@pytest.fixture
def spec(tmp_path: Path) -> Iterator[dm.DaemonSpec]:
    s = dm.DaemonSpec(tmp_path, pool="32MiB", warm_restart=True, drain_grace_s=1.0)
    yield s
    for suffix in ("", ".index", ".index.tmp", ".reads"):  # whatever the last daemon left
        dm.SHM_DIR.joinpath(s.shm_name + suffix).unlink(missing_ok=True)


def index_file(spec: dm.DaemonSpec) -> Path:
    return dm.SHM_DIR / (spec.shm_name + ".index")


def restart_stats(d: dm.Daemon) -> dict[str, int]:
    return d.stats()["restart"]


def sizes(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [ROW * rng.randint(1, 96) for _ in range(n)]  # 4 KiB .. 384 KiB


def put_all(client: EmbCacheClient, prefix: str, n: int, seed: int = 0) -> list[str]:
    keys = []
    for i, nbytes in enumerate(sizes(n, seed)):
        key = f"{prefix}/{i}"
        client.put(key, payload.make(key, nbytes, seed + i))
        keys.append(key)
    return keys


def check_all(client: EmbCacheClient, keys: list[str]) -> dict[str, str]:
    """What is wrong with each key that is not served with its exact bytes."""
    bad: dict[str, str] = {}
    for key in keys:
        with client.get([key]) as (t,):
            problem = payload.check(key, t)
        del t
        if problem is not None:
            bad[key] = problem
    return bad


def test_sigterm_then_restart_serves_every_ready_entry(spec: dm.DaemonSpec) -> None:
    d = dm.start(spec)
    try:
        with EmbCacheClient(d.unix, timeout=10) as client:
            keys = put_all(client, "k", 40)
            assert client.evict(keys[:5]) == ["evicted"] * 5
            kept = keys[5:]
        assert dm.stop(d) == 0, d.log_tail()
        cold_s = d.started_s
        assert d.spec_shm_path().exists() and index_file(spec).exists()
        d = dm.start(spec)
        r = restart_stats(d)
        assert r["adopted_entries"] == len(kept) and r["dropped_checksum_entries"] == 0, r
        assert d.stats()["entries_ready"] == len(kept)
        with EmbCacheClient(d.unix, timeout=10) as client:
            assert check_all(client, kept) == {}
            assert client.exists(keys[:5]) == [False] * 5  # evicted before: still gone
        assert dm.wait_for(lambda: restart_stats(d)["unverified_entries"] == 0, 10) is not None
        FIG["SIGTERM + restart"] = f"{len(kept)}/{len(kept)} entries served, equal bytes"
        FIG["ready after start (32 MiB pool)"] = f"cold {cold_s:.2f} s, warm {d.started_s:.2f} s"
    finally:
        dm.stop(d)


HAMMER_BUDGET = 24 * MiB  # pool pages per writer: two fit the 64 MiB pool, nothing is evicted
PAGE = 256 * KiB  # the daemon's default page: an entry takes whole pages


def _hammer(target: str, prefix: str, done: list[str], stop: threading.Event) -> None:
    """Put entries until the daemon goes (or ``HAMMER_BUDGET`` is put); record each key
    whose put returned."""
    rng = random.Random(prefix)
    try:
        with EmbCacheClient(target, timeout=5) as client:
            i = total = 0
            while not stop.is_set() and total < HAMMER_BUDGET:
                key = f"{prefix}/{i}"
                nbytes = ROW * rng.randint(1, 128)
                client.put(key, payload.make(key, nbytes, i))
                done.append(key)
                total += -(-nbytes // PAGE) * PAGE
                i += 1
    except Exception:  # the kill: the put in flight fails, as it must
        return


def test_sigkill_during_heavy_puts_loses_only_unreturned_puts(spec: dm.DaemonSpec) -> None:
    rng = random.Random(31)
    served = lost = attempted = 0
    spec.pool = "64MiB"
    d = dm.start(spec)
    try:
        for rnd in range(KILL_ROUNDS):
            prefixes = [f"r{rnd}w{w}" for w in range(2)]
            done: dict[str, list[str]] = {p: [] for p in prefixes}
            stop = threading.Event()
            writers = [
                threading.Thread(target=_hammer, args=(d.unix, p, done[p], stop)) for p in prefixes
            ]
            for t in writers:
                t.start()
            time.sleep(rng.uniform(0.15, 0.5))
            dm.reap(d.proc)  # SIGKILL, by its pid
            stop.set()
            for t in writers:
                t.join(10)
            returned = [k for p in prefixes for k in done[p]]  # returned before the kill
            in_flight = [f"{p}/{len(done[p])}" for p in prefixes]  # whole or absent
            d = dm.start(spec)
            r = restart_stats(d)
            assert r["dropped_checksum_entries"] == 0 and r["dropped_invalid_entries"] == 0, r
            with EmbCacheClient(d.unix, timeout=10) as client:
                tried = returned + in_flight
                present = [k for k, hit in zip(tried, client.exists(tried), strict=True) if hit]
                bad = check_all(client, present)
                assert bad == {}, bad
                missing = set(returned) - set(present)
                assert not missing, sorted(missing)[:5]
                served += len(present)
                attempted += len(returned)
                client.evict(present)  # room for the next round (the pool is small)
            lost += len(missing)
    finally:
        dm.stop(d)
    assert attempted > KILL_ROUNDS  # the puts were heavy enough to be cut mid-way
    FIG[f"SIGKILL mid-put x{KILL_ROUNDS}"] = (
        f"{attempted} returned puts all kept, {served} served with equal bytes, 0 corrupt"
    )


def test_a_corrupted_page_drops_its_entry_and_counts_it(spec: dm.DaemonSpec) -> None:
    d = dm.start(spec)
    try:
        with EmbCacheClient(d.unix, timeout=10) as client:
            keys = put_all(client, "c", 10, seed=5)
        victim = keys[3]
        runs = d.rest(f"/v1/entries/{victim}")["page_runs"]
        offset = runs[0]["byte_offset"] + payload.HEADER + 17
        assert dm.stop(d) == 0, d.log_tail()
        with d.spec_shm_path().open("r+b") as f:  # between the two daemons
            f.seek(offset)
            byte = f.read(1)
            f.seek(offset)
            f.write(bytes([byte[0] ^ 0xFF]))
        d = dm.start(spec)
        with EmbCacheClient(d.unix, timeout=10) as client:
            with client.get([victim]) as (t,):
                assert t is None, "a corrupt entry was served"
            assert check_all(client, [k for k in keys if k != victim]) == {}
        r = restart_stats(d)
        assert r["adopted_entries"] == 10 and r["dropped_checksum_entries"] == 1, r
        assert r["dropped_checksum_bytes"] == sizes(10, 5)[3], r
        metrics = httpx.get(d.http + "/metrics", timeout=10).text
        assert 'embcache_restart_dropped_entries{reason="checksum"} 1.0' in metrics
        FIG["one flipped byte"] = "its entry dropped (counted in stats and metrics), 9/9 served"
    finally:
        dm.stop(d)


def _downgrade_version(spec: dm.DaemonSpec) -> None:
    path = index_file(spec)
    data = path.read_bytes()
    h = rec.Header.unpack(data)
    other = rec.Header(h.version + 1, h.page_bytes, h.num_pages, h.inode, h.generation)
    path.write_bytes(other.pack() + data[rec.HEADER_BYTES :])


@pytest.mark.parametrize("change", ["page size", "pool size", "layout version"])
def test_an_incompatible_layout_is_replaced_and_logged(spec: dm.DaemonSpec, change: str) -> None:
    d = dm.start(spec)
    try:
        with EmbCacheClient(d.unix, timeout=10) as client:
            put_all(client, "l", 8)
        assert dm.stop(d) == 0, d.log_tail()
        inode = d.spec_shm_path().stat().st_ino
        if change == "page size":
            spec.extra = ("--page-bytes", "64KiB")
        elif change == "pool size":
            spec.pool = "16MiB"
        else:
            _downgrade_version(spec)
        spec.extra = (*spec.extra, "--log-level", "info")
        d = dm.start(spec)
        r = restart_stats(d)
        assert r["layout_replaced"] == 1 and r["adopted_entries"] == 0, r
        want = 0 if change == "layout version" else 8  # another version's records: unread
        assert r["dropped_layout_entries"] == want, r
        assert d.stats()["entries_ready"] == 0
        assert d.spec_shm_path().stat().st_ino != inode  # a new segment
        assert "instead of adopting it" in d.log_tail(20000), d.log_tail()
    finally:
        dm.stop(d)
    FIG["other page size / pool size / version"] = "segment replaced, one log line, counted"


VIEW_KEY = "held"


def test_clients_reconnect_and_a_view_held_across_the_restart_keeps_its_bytes(
    spec: dm.DaemonSpec,
) -> None:
    d = dm.start(spec)
    try:
        with EmbCacheClient(d.unix, timeout=10) as client:
            client.put(VIEW_KEY, payload.make(VIEW_KEY, MiB, 1))
            put_all(client, "v", 10)
            with client.get([VIEW_KEY], zero_copy=True) as (view,):
                assert payload.check(VIEW_KEY, view) is None
            assert dm.stop(d) == 0, d.log_tail()  # the view lives on in this process
            d = dm.start(spec)
            # The same client object: it reconnects by itself.
            deadline = time.monotonic() + 10
            while True:
                try:
                    keys = put_all(client, "after", 5, seed=9)
                    break
                except Exception:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
            assert check_all(client, keys) == {}
            stats = d.stats()
            assert stats["quarantined_bytes"] >= MiB, stats  # the old lease's hold survived
            for i in range(48):  # 48 MiB through a 32 MiB pool: every unheld page reused
                key = f"churn/{i}"
                client.put(key, payload.make(key, MiB, 100 + i))
            assert payload.check(VIEW_KEY, view) is None, "the held view shows reused memory"
            del view
    finally:
        dm.stop(d)
    FIG["view held across SIGTERM + restart"] = (
        "bytes intact while 48 MiB churned; client reconnected"
    )


def test_warm_restart_off_keeps_todays_behaviour(spec: dm.DaemonSpec) -> None:
    spec.warm_restart = False
    d = dm.start(spec)
    with EmbCacheClient(d.unix, timeout=10) as client:
        put_all(client, "o", 5)
    assert dm.stop(d) == 0, d.log_tail()
    assert not d.spec_shm_path().exists() and not index_file(spec).exists()
    d = dm.start(spec)
    try:
        assert d.stats()["entries_ready"] == 0 and restart_stats(d)["adopted_entries"] == 0
        inode = d.spec_shm_path().stat().st_ino
        dm.reap(d.proc)  # SIGKILL, by its pid
        d = dm.start(spec)  # a killed daemon's segment is replaced, as before
        assert d.spec_shm_path().stat().st_ino != inode
        assert not index_file(spec).exists()
    finally:
        dm.stop(d)
    FIG["--warm-restart off"] = "SIGTERM removes the segment; every start cold"


def test_zz_figures() -> None:
    print("\n" + figures.table("warm restart", FIG))
    figures.save("restart", FIG)
