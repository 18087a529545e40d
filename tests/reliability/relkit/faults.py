"""Injected faults, each repeated ``reps`` times; every lease and page must come back.

- sigkill_consumer: a consumer holding 1-100 leases (TTL 600 s) is SIGKILLed; its session
  ends, so its leases come back and the entries stay intact.
- sigstop_consumer: a consumer holding a zero-copy view is stopped past its lease TTL, the
  entry is evicted and the whole pool overwritten, then SIGCONT: the lease comes back within
  15 s, and the reader must not be handed reused memory silently. On the session socket the
  daemon knows the reader's pid: the expired lease's pages are quarantined (the evict is
  refused, the view keeps its bytes) until the reader exits; over TCP it does not, the pages
  are reused, and the reader is told (``LeaseExpired``).
- cancel_put / sigkill_producer: a put cancelled after 3 chunks, or whose process is
  SIGKILLed mid-stream, is never visible and its pages come back.
- deadline_get_bytes / deadline_get: a GetBytes stream outlives its deadline (mid-stream),
  a unary Get gets a deadline too short to answer: the leases come back.
- sigterm_daemon: SIGTERM under load (puts, gets, a stalled put, held leases): exit 0,
  segment and socket gone, every call finishes or fails cleanly.
- sigkill_daemon: SIGKILL, restart on the same shm name and socket: clients get
  UNAVAILABLE; the restart replaces the stale segment and serves misses; views of the dead
  daemon's pool keep their bytes.
- restart_daemon (issue 31): SIGTERM under load (two writers, a reader) with
  ``--warm-restart on``, then ``serve`` again: every put that returned before the SIGTERM
  is served by the new daemon with its bytes; nothing corrupt is ever read.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from embcache.clients import EmbCacheClient
from embcache.clients.core.payload import payload_of
from embcache.errors import EmbCacheError
from embcache.proto.embcache.v1 import embcache_pb2 as pb

from . import daemon as dm
from . import payload
from .worker import DOWN, error_name
from .workers import Worker, finish, spawn

KiB, MiB = 1 << 10, 1 << 20
RECLAIM_LIMIT_S = 15.0
POOL_BYTES = 64 * MiB


@dataclass
class Outcome:
    reclaim_s: float | None  # None: not back within RECLAIM_LIMIT_S
    lost: int = 0
    problems: list[str] = field(default_factory=list)
    notes: dict[str, Any] = field(default_factory=dict)


@dataclass
class FaultRecord:
    kind: str
    outcomes: list[Outcome] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        times = [o.reclaim_s for o in self.outcomes if o.reclaim_s is not None]
        notes: dict[str, Any] = {}
        for o in self.outcomes:
            for k, v in o.notes.items():
                if k.endswith("_s"):  # times: the worst repetition
                    k = k.removesuffix("_s") + "_max_s"
                    notes[k] = v if notes.get(k) is None or v is None else max(notes[k], v)
                elif isinstance(v, int) and not isinstance(notes.get(k, 0), str):
                    notes[k] = notes.get(k, 0) + v  # counts: summed over repetitions
                else:
                    notes[k] = v
        return {
            "injected": len(self.outcomes),
            "reclaim_p50_s": round(statistics.median(times), 3) if times else None,
            "reclaim_max_s": round(max(times), 3) if times else None,
            "not_reclaimed": sum(o.reclaim_s is None for o in self.outcomes),
            "lost": sum(o.lost for o in self.outcomes),
            "problems": sorted({p for o in self.outcomes for p in o.problems}),
            **notes,
        }


class FaultRun:
    def __init__(self, workdir: Path, reps: int, seed: int = 7) -> None:
        self.tmp = workdir
        self.reps = reps
        self.rng = random.Random(seed)
        self.records: dict[str, FaultRecord] = {}
        self.d: dm.Daemon | None = None
        self.client: EmbCacheClient | None = None

    # -- plumbing ------------------------------------------------------------------------
    def record(self, kind: str, outcome: Outcome) -> None:
        self.records.setdefault(kind, FaultRecord(kind)).outcomes.append(outcome)

    def stats(self) -> dict[str, Any]:
        assert self.d is not None
        return self.d.stats()

    def reclaim(self, leases: int = 0, t0: float | None = None) -> float | None:
        """Seconds (from ``t0``) until no lease beyond ``leases`` and nothing filling."""
        t0 = time.monotonic() if t0 is None else t0
        waited = dm.wait_for(lambda: dm.quiescent(self.stats(), leases), RECLAIM_LIMIT_S)
        return None if waited is None else time.monotonic() - t0

    @contextlib.contextmanager
    def holders(self, cfgs: list[dict[str, Any]], name: str) -> Iterator[list[Worker]]:
        """Workers started in parallel (they wait for ``go``); all reaped on exit."""
        ws: list[Worker] = []
        try:
            for i, c in enumerate(cfgs):
                ws.append(spawn({**c, "wait_go": True}, self.tmp, f"{name}-{i}"))
            for w in ws:
                w.expect("ready", 120)
            yield ws
        finally:
            for w in ws:
                dm.reap(w.proc)

    def put(self, key: str, nbytes: int, seed: int = 0) -> None:
        assert self.client is not None
        self.client.put(key, payload.make(key, nbytes, seed))

    # -- the run ---------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        self.d = dm.start(dm.DaemonSpec(self.tmp / "main", lease_ttl_s=3.0))
        try:
            with EmbCacheClient(self.d.unix, timeout=30) as client:
                self.client = client
                for fault in (
                    self.sigkill_consumer,
                    self.sigstop_consumer,
                    self.cancel_put,
                    self.sigkill_producer,
                    self.deadline_get_bytes,
                    self.deadline_get,
                ):
                    fault()
                final = self.stats()
            assert self.d is not None
            self.main_exit = dm.stop(self.d)
        finally:
            if self.d.alive():
                dm.discard(self.d)
        self.sigterm_daemon()
        self.sigkill_daemon()
        self.restart_daemon()
        return self.figures(final)

    def figures(self, final: dict[str, Any]) -> dict[str, Any]:
        kinds = {k: r.summary() for k, r in self.records.items()}
        times = [o.reclaim_s for r in self.records.values() for o in r.outcomes]
        done = [t for t in times if t is not None]
        return {
            "repetitions": self.reps,
            "faults_injected": len(times),
            "reclaim_p50_s": round(statistics.median(done), 3) if done else None,
            "reclaim_max_s": round(max(done), 3) if done else None,
            "not_reclaimed_within_15s": len(times) - len(done),
            "lost": sum(k["lost"] for k in kinds.values()),
            "main_daemon_exit_code": self.main_exit,
            "main_daemon_leases_left": final["leases_active"],
            "main_daemon_filling_left": final["entries_filling"],
            "kinds": kinds,
        }

    # -- consumers -------------------------------------------------------------------------
    def sigkill_consumer(self) -> None:
        keys = [f"lease/{i}" for i in range(100)]
        for key in keys:
            self.put(key, 64 * KiB)
        counts = [1, 100, *(self.rng.randint(2, 99) for _ in range(self.reps))][: self.reps]
        assert self.d is not None
        cfgs = [
            {
                "mode": "holder",
                "target": self.d.unix if i % 2 else self.d.tcp,
                "keys": self.rng.sample(keys, n),
                "ttl_s": 600.0,
            }
            for i, n in enumerate(counts)
        ]
        for batch in _batches(cfgs, 5):
            with self.holders(batch, "kill-consumer") as ws:
                for w in ws:
                    self.record("sigkill_consumer", self._kill_one(w))

    def _kill_one(self, w: Worker) -> Outcome:
        out = Outcome(None, notes={"leases_killed": len(w.cfg["keys"])})
        w.send("go")
        held = w.expect("held", 60)
        if held["leases"] != len(w.cfg["keys"]) or held["mismatches"]:
            out.problems.append(f"holder saw {held}")
        if self.stats()["leases_active"] != held["leases"]:
            out.problems.append("daemon does not count the holder's leases")
        t0 = time.monotonic()
        os.kill(w.pid, signal.SIGKILL)
        dm.reap(w.proc)
        out.reclaim_s = self.reclaim(t0=t0)
        out.lost = self.lost(w.cfg["keys"])
        return out

    def lost(self, keys: list[str]) -> int:
        """Entries that should still be there (no pressure evicted them) but are not intact."""
        assert self.client is not None
        bad = 0
        for key in keys:
            entry = self.client.get_bytes(key)
            bad += entry is None or payload.check_bytes(key, entry.data) is not None
        return bad

    def sigstop_consumer(self) -> None:
        assert self.d is not None and self.client is not None
        keys = [f"stop/{rep}" for rep in range(self.reps)]
        cfgs = [
            {"mode": "holder", "target": self.d.tcp if i % 2 else self.d.unix, "keys": [k]}
            for i, k in enumerate(keys)
        ]
        cfgs = [{**c, "ttl_s": 1.0} for c in cfgs]
        for batch in _batches(cfgs, 5):
            with self.holders(batch, "stop-consumer") as ws:
                for w in ws:
                    self.record("sigstop_consumer", self._stop_one(w))

    def _stop_one(self, w: Worker) -> Outcome:
        assert self.client is not None and self.d is not None
        quarantined = w.cfg["target"] == self.d.unix  # the daemon knows the reader's pid
        (key,) = w.cfg["keys"]
        self.put(key, MiB, seed=3)  # (again: the previous repetition overwrote the pool)
        out = Outcome(None)
        w.send("go")
        held = w.expect("held", 60)
        os.kill(w.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            if held["mismatches"]:
                out.problems.append("holder saw a mismatch before stopping")
            out.reclaim_s = self.reclaim(t0=t0)  # the lease expires while the reader sleeps
            outcome = self.client.evict([key, "stop/none"])[0]
            if outcome != ("leased" if quarantined else "evicted"):  # quarantined: kept
                out.problems.append(f"evict of the expired entry: {outcome}")
            for i in range(POOL_BYTES // MiB):  # overwrite every page of the pool
                self.put(f"stopfill/{i}", MiB, seed=i)
        finally:
            os.kill(w.pid, signal.SIGCONT)
        w.send("read")
        read = w.expect("read", 60)
        w.expect("done", 60)
        dm.reap(w.proc)
        (problem,) = read["problems"] or [None]
        detected = read["read_error"] or read["release_error"]
        freed = dm.wait_for(lambda: self.stats()["quarantined_bytes"] == 0, RECLAIM_LIMIT_S)
        out.notes = {
            "reused_memory_seen": int(problem is not None),
            "stale_detected": int(bool(problem and detected)),
            "stale_silent": int(bool(problem and not detected)),
            "quarantined_intact": int(quarantined and problem is None and detected is not None),
            "quarantine_freed_after_exit_s": freed,
        }
        if problem and not detected:
            out.problems.append(f"silent stale read after SIGCONT ({problem})")
        if quarantined and problem:
            out.problems.append(f"quarantined view read reused memory ({problem})")
        if freed is None:
            out.problems.append("quarantined pages not freed after the reader exited")
        return out

    # -- puts --------------------------------------------------------------------------------
    def cancel_put(self) -> None:
        for rep in range(self.reps):
            self.record("cancel_put", self._cancel_one(f"cancel/{rep}", rep))

    def _cancel_one(self, key: str, seed: int) -> Outcome:
        assert self.client is not None
        data = payload_of(payload.make(key, 16 * MiB, seed))
        sent, release = threading.Event(), threading.Event()

        def messages() -> Iterator[Any]:
            for i, msg in enumerate(data.messages(key)):
                yield msg
                if i == 3:
                    sent.set()
                    release.wait(30)
                    return

        out = Outcome(None)
        future = self.client._conn.put_stream.future(messages(), timeout=60)
        try:
            sent.wait(30)
            if dm.wait_for(lambda: self.stats()["entries_filling"] == 1, 5) is None:
                out.problems.append("the put never showed as filling")
            out.lost += self.visible(key, out)
            t0 = time.monotonic()
            future.cancel()
        finally:
            release.set()
        out.reclaim_s = self.reclaim(t0=t0)
        out.lost += self.visible(key, out)
        return out

    def visible(self, key: str, out: Outcome) -> int:
        assert self.client is not None
        seen = self.client.exists(key) or self.client.get_bytes(key) is not None
        if seen:
            out.problems.append(f"partial entry {key} visible")
        return int(seen)

    def sigkill_producer(self) -> None:
        assert self.d is not None
        cfgs = [
            {
                "mode": "slow_put",
                "target": self.d.tcp if rep % 2 else self.d.unix,
                "key": f"killput/{rep}",
                "nbytes": 16 * MiB,
            }
            for rep in range(self.reps)
        ]
        for batch in _batches(cfgs, 5):
            with self.holders(batch, "kill-producer") as ws:
                for w in ws:
                    self.record("sigkill_producer", self._kill_producer(w))

    def _kill_producer(self, w: Worker) -> Outcome:
        out = Outcome(None)
        w.send("go")
        w.expect("streaming", 60)
        if dm.wait_for(lambda: self.stats()["entries_filling"] == 1, 5) is None:
            out.problems.append("the put never showed as filling")
        out.lost += self.visible(w.cfg["key"], out)
        t0 = time.monotonic()
        os.kill(w.pid, signal.SIGKILL)
        dm.reap(w.proc)
        out.reclaim_s = self.reclaim(t0=t0)
        out.lost += self.visible(w.cfg["key"], out)
        return out

    # -- deadlines ---------------------------------------------------------------------------
    def deadline_get_bytes(self) -> None:
        assert self.client is not None
        key = "deadline/big"
        self.put(key, 16 * MiB)
        for _ in range(self.reps):
            out = Outcome(None)
            got = 0
            code = None
            t0 = time.monotonic()
            try:
                stream = self.client._conn.stub.GetBytes(
                    pb.GetBytesRequest(key=key, chunk_bytes=64 * KiB), timeout=0.3
                )
                for _msg in stream:
                    got += 1
                    time.sleep(0.02)  # a slow reader: the deadline passes mid-stream
            except grpc.RpcError as err:
                code = err.code()
                t0 = time.monotonic()
            if code != grpc.StatusCode.DEADLINE_EXCEEDED or not 1 < got < 257:
                out.problems.append(f"GetBytes ended with {code} after {got} messages")
            out.reclaim_s = self.reclaim(t0=t0)
            out.notes = {"messages_before_deadline": got}
            self.record("deadline_get_bytes", out)

    def deadline_get(self) -> None:
        """A Get of 10,000 hits (leases) with a deadline shorter than the daemon needs: the
        reply is dropped and the leases, owned by nobody listening, must end by their TTL."""
        assert self.client is not None
        keys = [f"lease/{i % 100}" for i in range(10_000)]
        request = pb.GetRequest(keys=keys, ttl_s=1.0)
        for _ in range(self.reps):
            out = Outcome(None)
            code = None
            for timeout in (0.005, 0.002, 0.001, 0.0005):  # until one expires
                try:
                    self.client._conn.stub.Get(request, timeout=timeout)
                except grpc.RpcError as err:
                    code = err.code()
                    break
            t0 = time.monotonic()
            if code != grpc.StatusCode.DEADLINE_EXCEEDED:
                out.problems.append(f"Get ended with {code}, not DEADLINE_EXCEEDED")
            out.notes = {"leases_orphaned": self.stats()["leases_active"]}
            out.reclaim_s = self.reclaim(t0=t0)
            self.record("deadline_get", out)

    # -- the daemon itself -------------------------------------------------------------------
    def sigterm_daemon(self) -> None:
        for rep in range(self.reps):
            tmp = self.tmp / f"term-{rep}"
            spec = dm.DaemonSpec(tmp, lease_ttl_s=3.0, drain_grace_s=2.0)
            target = f"unix:{tmp / spec.socket_name}"  # known before the daemon is up
            tmp.mkdir(parents=True)
            self.record("sigterm_daemon", self._sigterm_one(spec, target, rep))

    def _sigterm_one(self, spec: dm.DaemonSpec, target: str, rep: int) -> Outcome:
        published = spec.workdir / "published.i64"
        np.memmap(published, dtype=np.int64, mode="w+", shape=(1,))[:] = -1
        base = {
            "target": target,
            "prefix": "term",
            "published": str(published),
            "n_producers": 1,
            "seconds": 60,
            "until_down": True,
            "retries": 2,
        }
        cfgs = [
            {**base, "mode": "producer", "index": 0, "seed": rep, "sizes_mib": [0.5, 1, 4]},
            {**base, "mode": "consumer", "seed": 100 + rep, "hold_prob": 0.3},
            {**base, "mode": "slow_put", "key": f"term-slow/{rep}", "nbytes": 16 * MiB},
        ]
        out = Outcome(None)
        workers: list[Worker] = []
        d: dm.Daemon | None = None
        try:  # the workers start while the daemon does (they know its socket path)
            for i, c in enumerate(cfgs):
                workers.append(spawn({**c, "wait_go": True}, spec.workdir, f"term-{i}"))
            d = dm.start(spec)
            for w in workers:
                w.expect("ready", 120)
                w.send("go")
            workers[2].expect("streaming", 60)
            time.sleep(1.5)
            t0 = time.monotonic()
            d.proc.send_signal(signal.SIGTERM)
            try:
                code: int | None = d.proc.wait(spec.drain_grace_s + 20)
                out.reclaim_s = time.monotonic() - t0
            except subprocess.TimeoutExpired:
                code = None
            finish(workers, 30)
        finally:
            for w in workers:
                dm.reap(w.proc)
            if d is not None:
                dm.reap(d.proc)
                if out.reclaim_s is None:  # killed, not drained: remove what it left
                    dm.discard(d)
        out.notes = {"exit_code": code}
        if code != 0:
            out.problems.append(f"exit code {code}: {d.log_tail(800)}")
        if d.shm_path.exists():
            out.problems.append("shared-memory segment left in /dev/shm")
            d.shm_path.unlink(missing_ok=True)
        if d.socket_path.exists():
            out.problems.append("gRPC socket left behind")
        for w in workers:
            errors = {k[6:] for k, v in w.done.items() if k.startswith("error:") and v}
            unclean = errors - DOWN - {"PoolExhausted"}
            if unclean or w.done.get("mismatches") or w.done.get("unexpected"):
                out.problems.append(f"{w.cfg['mode']} ended badly: {w.done}")
            out.lost += int(w.done.get("mismatches", 0))
        return out

    def sigkill_daemon(self) -> None:
        spec = dm.DaemonSpec(self.tmp / "kill", lease_ttl_s=3.0)
        d = dm.start(spec)
        self._restarted: list[dm.Daemon] = [d]
        try:
            with EmbCacheClient(d.unix, timeout=10, retries=1) as client:
                for rep in range(self.reps):
                    d, out = self._sigkill_one(spec, d, client, rep)
                    self.record("sigkill_daemon", out)
            code = dm.stop(d)
            if code != 0 or d.shm_path.exists():
                self.records["sigkill_daemon"].outcomes[-1].problems.append(
                    f"restarted daemon did not stop cleanly (exit {code})"
                )
        finally:
            for started in self._restarted:  # a failed repetition must leak no daemon
                dm.reap(started.proc)
            if not d.alive():
                dm.discard(d)

    def _sigkill_one(
        self, spec: dm.DaemonSpec, d: dm.Daemon, client: EmbCacheClient, rep: int
    ) -> tuple[dm.Daemon, Outcome]:
        out = Outcome(None)
        key = f"killd/{rep}"
        client.put(key, payload.make(key, 4 * MiB, rep))
        leased = client.get([key], zero_copy=True)  # a view of this daemon's pool
        old_inode = d.shm_path.stat().st_ino
        t0 = time.monotonic()
        os.kill(d.pid, signal.SIGKILL)
        d.proc.wait(10)
        dm.reap(d.proc)
        code = _status_of(lambda: client.exists(key))
        if code != "UNAVAILABLE":
            out.problems.append(f"call to a dead daemon: {code}, not UNAVAILABLE")
        stale = d.shm_path.exists()
        d = dm.start(spec)
        self._restarted.append(d)
        stats = d.stats()
        if stats["leases_active"] or stats["host"]["used_pages"] or stats["entries_ready"]:
            out.problems.append(f"restarted daemon is not empty: {stats}")
        out.reclaim_s = time.monotonic() - t0
        if d.shm_path.stat().st_ino == old_inode:
            out.problems.append("the stale segment was reused, not replaced")
        ready_at = time.monotonic()
        recovered = dm.wait_for(lambda: _status_of(lambda: client.exists(key)) == "OK", 30, 0.01)
        out.notes["client_recovery_s"] = (
            None if recovered is None else round(time.monotonic() - ready_at, 3)
        )
        if recovered is None:
            out.problems.append("the client did not reach the restarted daemon within 30 s")
            return d, out
        if client.get([key])[0] is not None:
            out.problems.append("restarted daemon served an entry of the dead one")
        fresh = f"killd-fresh/{rep}"
        client.put(fresh, payload.make(fresh, MiB, rep))
        with client.get([fresh]) as (t,):
            if payload.check(fresh, t):
                out.problems.append("wrong bytes from the restarted daemon")
        if payload.check(key, leased[0]):  # the old view maps the old (unlinked) segment
            out.problems.append("a view of the dead daemon's pool changed")
            out.lost += 1
        try:
            leased.release()
        except EmbCacheError as exc:
            out.notes["old_release_error"] = error_name(exc)
        out.notes["stale_segment_found"] = int(stale)
        return d, out

    # -- warm restart under load -------------------------------------------------------------
    def restart_daemon(self) -> None:
        for rep in range(self.reps):
            spec = dm.DaemonSpec(self.tmp / f"warm-{rep}", warm_restart=True, drain_grace_s=2.0)
            try:
                self.record("restart_daemon", self._restart_one(spec, rep))
            finally:
                for suffix in ("", ".index", ".index.tmp", ".reads"):
                    dm.SHM_DIR.joinpath(spec.shm_name + suffix).unlink(missing_ok=True)

    def _restart_one(self, spec: dm.DaemonSpec, rep: int) -> Outcome:
        out = Outcome(None)
        d = dm.start(spec)
        done: list[tuple[str, int]] = []  # (key, seed) of each put that returned
        bad: list[str] = []
        stop = threading.Event()
        threads = [
            threading.Thread(target=_warm_writer, args=(d.unix, f"warm{rep}w{w}", done, stop))
            for w in range(2)
        ] + [threading.Thread(target=_warm_reader, args=(d.unix, done, bad, stop))]
        try:
            for t in threads:
                t.start()
            time.sleep(1.0 + self.rng.random())
            returned = list(done)  # SIGTERM comes after these returned
            stats = d.stats()
            t0 = time.monotonic()
            code = dm.stop(d)
            stop.set()
            for t in threads:
                t.join(20)
            d = dm.start(spec)
            out.reclaim_s = time.monotonic() - t0
            restart = d.stats()["restart"]
            with EmbCacheClient(d.unix, timeout=10) as client:
                for key, _seed in returned:
                    with client.get([key]) as (t,):
                        problem = payload.check(key, t)
                    del t
                    if problem is not None:
                        out.lost += 1
                        out.problems.append(f"{key}: {problem}")
        finally:
            stop.set()
            dm.reap(d.proc)
        if code != 0:
            out.problems.append(f"exit code {code}: {d.log_tail(800)}")
        if stats["evictions"]:
            out.problems.append(f"the set-up evicted {stats['evictions']} entries: lower the load")
        if restart["dropped_checksum_entries"] or bad:
            out.problems.append(f"corrupt entries: {restart}, read: {bad[:3]}")
        out.notes = {"adopted": restart["adopted_entries"], "returned_puts": len(returned)}
        return out


WARM_BUDGET = 24 * MiB  # pool pages per writer: two fit the 64 MiB pool, nothing is evicted
PAGE = 256 * KiB  # the daemon's default page: an entry takes whole pages


def _warm_writer(target: str, prefix: str, done: list[tuple[str, int]], stop: Any) -> None:
    """Put entries until ``stop`` or the daemon goes; record each one that returned."""
    rng = random.Random(prefix)
    with contextlib.suppress(EmbCacheError), EmbCacheClient(target, timeout=5) as client:
        total = i = 0
        while not stop.is_set() and total < WARM_BUDGET:
            key, nbytes = f"{prefix}/{i}", 2 * KiB * rng.randint(1, 256)
            client.put(key, payload.make(key, nbytes, i))
            done.append((key, i))
            total += -(-nbytes // PAGE) * PAGE
            i += 1


def _warm_reader(target: str, done: list[tuple[str, int]], bad: list[str], stop: Any) -> None:
    """Read back random entries that were put until ``stop`` or the daemon goes."""
    rng = random.Random(1)
    with contextlib.suppress(EmbCacheError), EmbCacheClient(target, timeout=5) as client:
        while not stop.is_set():
            if not done:
                time.sleep(0.01)
                continue
            key, _ = done[rng.randrange(len(done))]
            with client.get([key]) as (t,):
                if t is not None and payload.check(key, t) is not None:
                    bad.append(key)
            del t


def _status_of(call: Callable[[], object]) -> str:
    try:
        call()
    except EmbCacheError as exc:
        status = getattr(exc, "grpc_status", None)
        return status.name if status is not None else error_name(exc)
    return "OK"


def _batches(items: list[Any], size: int) -> Iterator[list[Any]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def run_faults(reps: int, workdir: Path | None = None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="ecfault-", dir=workdir) as tmp:
        return FaultRun(Path(tmp), reps).run()
