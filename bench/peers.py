"""embcache next to the stores users compare it with, measured in one run.

    python3 bench/peers.py [--out-dir bench/results] [--quick] [--client-cpus 0]
                           [--daemon-cpus 1] [--no-netns]

Every server is started here, bound to 127.0.0.1 or to Unix sockets in a temp folder: an
embcache daemon, Redis 7 (redis-py with hiredis, over its Unix socket and over TCP), a
Mooncake Store (master and storage node), and the way vLLM's ``ECExampleConnector`` moves
encoder outputs (one safetensors file per item on /dev/shm, ``save_file`` / ``load_file``;
vLLM itself is not imported). Mooncake's transfer engine listens on every interface, so the
benchmark re-runs itself in a loopback-only network namespace (``unshare -n``, as
bench/shared_tier.py and tests/tiers/ do); where that cannot be made, Mooncake is skipped and
the table says why.

A producer process puts and a consumer process gets, and the consumer checks every byte
(outside the timed calls): 64 KiB and 4 MiB payloads, one key per call and batches of 16.
The floor is an in-process numpy copy of the same bytes. A get of embcache's zero-copy views
is timed up to the end of its release (the views are only valid until then); every other get
ends when the bytes are in the consumer. Each target is a ratio of two numbers of
this run. With CUDA, the GPU part: safetensors loaded straight to the GPU, the torch CUDA-IPC
handoff (reduce in the producer, rebuild and clone in the consumer) and one contiguous pinned
copy-engine transfer, next to embcache's device gets and puts (timed until the tensors are
usable on the GPU, release not included, as bench/grpc_e2e.py does).

Prints the environment, the table and the targets; writes ``peers_<gpu or cpu>.json``.
"""

from __future__ import annotations

import abc
import argparse
import contextlib
import functools
import multiprocessing as mp
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests" / "tiers"))

from _common import environment, git_commit, print_environment, save_json, table  # noqa: E402
from grpc_e2e import copy_engine_gbs, fragment_device_pool, percentiles  # noqa: E402
from tier_servers import (  # noqa: E402
    LOOPBACK,
    MooncakeMaster,
    RedisNodes,
    mooncake_master_binary,
    redis_missing,
    start_storage_node,
)
from tier_servers import stop as stop_server  # noqa: E402

from embcache.service.config import parse_cpu_list  # noqa: E402
from embcache.service.daemon_process import DaemonProcess  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
SMALL, LARGE = 64 * KiB, 4 * MiB
BATCH = 16
ROUND_BYTES = 64 * MiB  # what the producer puts before the consumer reads it back
SPREAD = MiB  # payload offsets vary over this many bytes
CONSUMERS = 4  # concurrent get_bytes consumers
# Calls timed per (payload, keys per call); --quick divides them by 5.
CALLS = {(SMALL, 1): 400, (LARGE, 1): 80, (SMALL, BATCH): 120, (LARGE, BATCH): 20}
WARMUP = 5
# What each store calls its operations: (system, "put" | "get", keys per call) -> name.
OP_NAMES = {
    "embcache": {("put", 1): "put", ("put", BATCH): "put_many", ("get", 1): "get",
                 ("get", BATCH): "get"},
    "embcache bytes": {("put", 1): "put", ("put", BATCH): "put_many",
                       ("get", 1): "get_bytes", ("get", BATCH): "16 x get_bytes"},
    "redis": {("put", 1): "SET", ("put", BATCH): "MSET", ("get", 1): "GET",
              ("get", BATCH): "MGET"},
    "safetensors": {("put", 1): "save_file", ("put", BATCH): "16 x save_file",
                    ("get", 1): "load_file", ("get", BATCH): "16 x load_file"},
    "mooncake": {("put", 1): "put", ("put", BATCH): "put_batch", ("get", 1): "get",
                 ("get", BATCH): "get_batch"},
}  # fmt: skip


@functools.cache
def _base() -> np.ndarray:
    return np.random.default_rng(30).integers(0, 256, LARGE + SPREAD, dtype=np.uint8)


def payload(ident: int, size: int) -> np.ndarray:
    """The bytes of key number ``ident``: a slice of one random buffer (the same in every
    process) at an offset that differs from key to key."""
    off = (ident * 4099) % SPREAD
    return _base()[off : off + size]


def key(ident: int) -> str:
    return f"peers-{ident}"


def same(value: Any, expected: np.ndarray) -> bool:
    """Whether a fetched value (bytes, numpy array or tensor on any device) holds exactly
    ``expected``."""
    if value is None:
        return False
    if isinstance(value, torch.Tensor):
        flat = value.reshape(-1).view(torch.uint8)
        if flat.is_cuda:
            want = torch.from_numpy(expected).to(flat.device)
            return flat.shape == want.shape and bool(torch.equal(flat, want))
        value = flat.numpy()
    arr = np.frombuffer(value, dtype=np.uint8) if not isinstance(value, np.ndarray) else value
    return arr.shape == expected.shape and bool(np.array_equal(arr, expected))


# -- the stores, as a producer or a consumer process sees them ------------------------------
Finish = Callable[[], object] | None


class Side(abc.ABC):
    """One store in one process: ``put`` and ``get`` one key or a batch, ``drop`` them."""

    @abc.abstractmethod
    def put(self, keys: list[str], values: list[Any]) -> None: ...

    @abc.abstractmethod
    def get(self, keys: list[str]) -> tuple[list[Any], Finish]:
        """The values, and what ends the read (timed too), or None."""

    @abc.abstractmethod
    def drop(self, keys: list[str]) -> None: ...

    def close(self) -> None:  # noqa: B027 (a hook: most stores hold nothing to close)
        pass


class EmbcacheSide(Side):
    """``mode``: "default" (the default client: same-node gets copy out of the pool with no
    call), "view" (zero-copy host views, leased), "bytes" (``get_bytes``, as a client on
    another machine) or "cuda" (gets to the GPU)."""

    def __init__(self, target: str, mode: str) -> None:
        from embcache.clients import EmbCacheClient

        self.client = EmbCacheClient(target)
        self.mode = mode

    def put(self, keys: list[str], values: list[Any]) -> None:
        tensors = [torch.from_numpy(v) if isinstance(v, np.ndarray) else v for v in values]
        if len(keys) == 1:
            self.client.put(keys[0], tensors[0])
        else:
            self.client.put_many(dict(zip(keys, tensors, strict=True)))

    def get(self, keys: list[str]) -> tuple[list[Any], Finish]:
        if self.mode == "bytes":
            entries = [self.client.get_bytes(k) for k in keys]
            return [None if e is None else e.tensor() for e in entries], None
        device = "cuda" if self.mode == "cuda" else None
        views = self.mode == "view"
        names = keys[0] if len(keys) == 1 else keys
        leased = self.client.get(names, device=device, zero_copy=views)
        if device:
            torch.cuda.synchronize()
        return list(leased), leased.release

    def drop(self, keys: list[str]) -> None:
        self.client.evict(keys)

    def close(self) -> None:
        self.client.close()


class RedisSide(Side):
    def __init__(self, address: str) -> None:
        import redis

        if address.startswith("unix:"):
            self.r = redis.Redis(unix_socket_path=address[5:])
        else:
            host, port = address.rsplit(":", 1)
            self.r = redis.Redis(host=host, port=int(port))
        self.r.ping()

    def put(self, keys: list[str], values: list[Any]) -> None:
        views = [memoryview(v) for v in values]
        if len(keys) == 1:
            self.r.set(keys[0], views[0])
        else:
            self.r.mset(dict(zip(keys, views, strict=True)))

    def get(self, keys: list[str]) -> tuple[list[Any], Finish]:
        return ([self.r.get(keys[0])] if len(keys) == 1 else self.r.mget(keys)), None

    def drop(self, keys: list[str]) -> None:
        self.r.delete(*keys)

    def close(self) -> None:
        self.r.close()


class SafetensorsSide(Side):
    """What ``ECExampleConnector`` does per item: a folder per hash, one safetensors file in
    it; the consumer checks that it exists, then loads it (onto ``device``)."""

    def __init__(self, folder: str, device: str) -> None:
        from safetensors.torch import load_file, save_file

        self.folder, self.device = folder, device
        self.save_file, self.load_file = save_file, load_file

    def _path(self, key: str) -> str:
        return os.path.join(self.folder, key, "encoder_cache.safetensors")

    def put(self, keys: list[str], values: list[Any]) -> None:
        for k, v in zip(keys, values, strict=True):
            t = torch.from_numpy(v) if isinstance(v, np.ndarray) else v
            os.makedirs(os.path.join(self.folder, k), exist_ok=True)
            self.save_file({"ec_cache": t.detach().cpu()}, self._path(k))

    def get(self, keys: list[str]) -> tuple[list[Any], Finish]:
        out = []
        for k in keys:
            path = self._path(k)
            found = os.path.exists(path)
            out.append(self.load_file(path, device=self.device)["ec_cache"] if found else None)
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
        return out, None

    def drop(self, keys: list[str]) -> None:
        for k in keys:
            shutil.rmtree(os.path.join(self.folder, k), ignore_errors=True)


class MooncakeSide(Side):
    """A store client that lends no memory (the storage node does), over the TCP transfer
    engine, through the bytes API (``put``/``put_batch``, ``get``/``get_batch``)."""

    def __init__(self, master: str) -> None:
        from mooncake.store import MooncakeDistributedStore

        self.store = MooncakeDistributedStore()
        rc = self.store.setup(LOOPBACK, "P2PHANDSHAKE", 0, 256 * MiB, "tcp", "", master)
        if rc != 0:
            raise RuntimeError(f"mooncake setup failed: {rc}")

    def put(self, keys: list[str], values: list[Any]) -> None:
        if len(keys) == 1:
            rc = self.store.put(keys[0], values[0])
        else:
            rc = self.store.put_batch(keys, values)
        if rc != 0:
            raise RuntimeError(f"mooncake put failed: {rc}")

    def get(self, keys: list[str]) -> tuple[list[Any], Finish]:
        if len(keys) == 1:
            return [self.store.get(keys[0])], None
        return list(self.store.get_batch(keys)), None

    def drop(self, keys: list[str]) -> None:
        self.store.batch_remove(keys, True)

    def close(self) -> None:
        self.store.close()


SIDES: dict[str, Callable[..., Side]] = {
    "embcache": EmbcacheSide,
    "redis": RedisSide,
    "safetensors": SafetensorsSide,
    "mooncake": MooncakeSide,
}
Spec = tuple[str, ...]  # (kind, its arguments...)


# -- the worker processes -------------------------------------------------------------------
class Ops:
    """What a worker does on request; each returns something picklable."""

    def __init__(self, peer: Connection | None) -> None:
        self.peer = peer
        self.sides: dict[Spec, Side] = {}

    def side(self, spec: Spec) -> Side:
        if spec not in self.sides:
            self.sides[spec] = SIDES[spec[0]](*spec[1:])
        return self.sides[spec]

    def ping(self) -> int:
        _base()
        return os.getpid()

    def put(self, spec: Spec, size: int, groups: list[list[int]], source: str) -> list[float]:
        """Microseconds per call; ``source`` "cuda" puts from tensors on the GPU."""
        side = self.side(spec)
        staged: list[list[Any]] = [[payload(i, size) for i in g] for g in groups]
        if source == "cuda":
            staged = [[torch.from_numpy(v).cuda() for v in vs] for vs in staged]
            torch.cuda.synchronize()
        lat = []
        for g, values in zip(groups, staged, strict=True):
            keys = [key(i) for i in g]
            t0 = time.perf_counter()
            side.put(keys, values)
            lat.append((time.perf_counter() - t0) * 1e6)
        return lat

    def get(
        self, spec: Spec, size: int, groups: list[list[int]], drop_each: bool = False
    ) -> tuple[list[tuple[float, float]], int]:
        """(get, finish) microseconds per call, and how many values were wrong; with
        ``drop_each`` the keys of each call are dropped after it (untimed)."""
        side = self.side(spec)
        lat, bad = [], 0
        for g in groups:
            keys = [key(i) for i in g]
            t0 = time.perf_counter()
            values, finish = side.get(keys)
            t1 = time.perf_counter()
            bad += sum(not same(v, payload(i, size)) for v, i in zip(values, g, strict=True))
            del values
            t2 = time.perf_counter()
            if finish is not None:
                finish()
            lat.append(((t1 - t0) * 1e6, (time.perf_counter() - t2) * 1e6))
            if drop_each:
                side.drop(keys)
        return lat, bad

    def drop(self, spec: Spec, groups: list[list[int]]) -> None:
        self.side(spec).drop([key(i) for g in groups for i in g])

    def stream(
        self, spec: Spec, size: int, ids: list[int], passes: int, start_at: float
    ) -> tuple[float, float, int]:
        """Fetch every key ``passes`` times, from ``start_at`` on; (start, end, wrong values)
        (the last pass is checked after the end)."""
        side = self.side(spec)
        keys = [key(i) for i in ids]
        while time.perf_counter() < start_at:
            time.sleep(0.0005)
        t0 = time.perf_counter()
        last: list[Any] = []
        for _ in range(passes):
            last = []
            for k in keys:
                values, finish = side.get([k])
                assert finish is None, "stream fetches bytes, not leased views"
                last.append(values[0])
        t1 = time.perf_counter()
        bad = sum(not same(v, payload(i, size)) for v, i in zip(last, ids, strict=True))
        return t0, t1, bad

    def fragment(self, spec: Spec) -> int:
        """Fragment the daemon's device pool as bench/grpc_e2e.py does; the largest free
        run left."""
        return fragment_device_pool(self.side(spec).client)  # type: ignore[attr-defined]

    def ipc_serve(self, size: int, groups: list[list[int]]) -> int:
        """The producer of the CUDA-IPC handoff: tensors on its GPU; each request (ids) is
        answered with ``reduce_tensor`` of each (or the error, as a string); ends on None."""
        from torch.multiprocessing.reductions import reduce_tensor

        assert self.peer is not None
        try:
            tensors = {i: torch.from_numpy(payload(i, size)).cuda() for g in groups for i in g}
            torch.cuda.synchronize()
        except Exception:
            self.peer.send(traceback.format_exc())  # the consumer stops too
            raise
        self.peer.send("ready")
        served = 0
        while (want := self.peer.recv()) is not None:
            try:
                self.peer.send([reduce_tensor(tensors[i]) for i in want])
            except Exception:
                self.peer.send(traceback.format_exc())
            served += 1
        return served

    def ipc_fetch(self, size: int, groups: list[list[int]]) -> tuple[list[float], int]:
        """The consumer: ask, rebuild each handed tensor and clone it, until the clones are
        ready on the GPU."""
        assert self.peer is not None
        if (first := self.peer.recv()) != "ready":
            raise RuntimeError(f"the producer failed:\n{first}")
        lat, bad = [], 0
        try:
            for g in groups:
                t0 = time.perf_counter()
                self.peer.send(g)
                handed = self.peer.recv()
                if isinstance(handed, str):
                    raise RuntimeError(f"the producer failed:\n{handed}")
                copies = [rebuild(*args).clone() for rebuild, args in handed]
                torch.cuda.synchronize()
                lat.append((time.perf_counter() - t0) * 1e6)
                bad += sum(not same(c, payload(i, size)) for c, i in zip(copies, g, strict=True))
                del copies, handed
        finally:
            self.peer.send(None)  # the producer stops serving
        return lat, bad

    def close(self) -> None:
        for side in self.sides.values():
            with contextlib.suppress(Exception):
                side.close()


def worker_main(conn: Connection, peer: Connection | None, cpus: str) -> None:
    if cpus:
        os.sched_setaffinity(0, parse_cpu_list(cpus))
    ops = Ops(peer)
    try:
        while (msg := conn.recv()) is not None:
            name, args = msg
            try:
                conn.send(("ok", getattr(ops, name)(*args)))
            except Exception:
                conn.send(("error", traceback.format_exc()))
    finally:
        ops.close()


class Worker:
    """A worker process started here (spawned: CUDA works in it), driven over a pipe."""

    def __init__(self, ctx: Any, cpus: str, peer: Connection | None = None) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=worker_main, args=(child, peer, cpus), daemon=True)
        self.proc.start()
        child.close()

    def send(self, op: str, *args: Any) -> None:
        self.conn.send((op, args))

    def result(self, timeout: float = 300) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"worker {self.proc.pid}: no answer in {timeout} s")
        status, value = self.conn.recv()
        if status == "error":
            raise RuntimeError(f"worker {self.proc.pid} failed:\n{value}")
        return value

    def call(self, op: str, *args: Any, timeout: float = 300) -> Any:
        self.send(op, *args)
        return self.result(timeout)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(None)
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.terminate()  # this pid only
            self.proc.join(10)


# -- measuring ------------------------------------------------------------------------------
@dataclass
class Row:
    system: str
    transport: str
    call: str
    size: int
    batch: int
    p50_us: float = 0.0
    p99_us: float = 0.0
    calls: int = 0
    gbs: float = 0.0  # bytes per call over the p50 (total GB/s for concurrent consumers)
    bad: int = 0  # values that did not hold the bytes put
    release_p50_us: float = 0.0  # zero-copy views: the release, part of p50_us on the CPU
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def payload(self) -> str:
        one = f"{self.size // MiB} MiB" if self.size >= MiB else f"{self.size // KiB} KiB"
        return one if self.batch == 1 else f"{self.batch} x {one}"


def timed_row(
    system: str, transport: str, call: str, size: int, batch: int, lat: list[float], bad: int = 0
) -> Row:
    p50, p99 = percentiles(lat)
    gbs = size * batch / (p50 / 1e6) / 1e9 if p50 > 0 else 0.0
    return Row(system, transport, call, size, batch, p50, p99, len(lat), gbs, bad)


class Ids:
    """Fresh key numbers: no key is put twice in a run."""

    def __init__(self) -> None:
        self.next = 0

    def take(self, n: int) -> list[int]:
        self.next += n
        return list(range(self.next - n, self.next))


class Case:
    """One store's put and get of one payload shape, measured in rounds: the producer puts a
    round of calls, the consumer gets them back and checks them, the producer drops them. The
    first round is a warm-up. Cases of the same shape take turns round by round
    (``Bench.interleave``), so that a slower minute of the machine hits them alike."""

    def __init__(
        self,
        bench: Bench,
        names: tuple[str, str],
        put_spec: Spec,
        get_spec: Spec,
        size: int,
        batch: int,
        *,
        source: str = "host",
        per_round: int | None = None,
        calls: int | None = None,
        time_release: bool = True,
        drop_each: bool = False,
    ) -> None:
        self.bench, self.names, self.put_spec, self.get_spec = bench, names, put_spec, get_spec
        self.size, self.batch, self.source, self.time_release = size, batch, source, time_release
        self.calls = calls or bench.calls(size, batch)
        fits = max(1, ROUND_BYTES // (size * batch))
        self.per_round = per_round or max(1, min(fits, self.calls // 5))
        self.puts: list[float] = []
        self.gets: list[tuple[float, float]] = []
        self.drop_each = drop_each
        self.bad = 0
        self.warm = True
        self.error = ""

    @property
    def done(self) -> bool:
        return len(self.puts) >= self.calls or bool(self.error)

    def step(self) -> None:
        b = self.bench
        n = min(self.per_round, WARMUP) if self.warm else self.per_round
        n = min(n, self.calls - len(self.puts)) if not self.warm else n
        groups = [b.ids.take(self.batch) for _ in range(n)]
        put_lat = b.producer.call("put", self.put_spec, self.size, groups, self.source)
        get_lat, wrong = b.consumer.call("get", self.get_spec, self.size, groups, self.drop_each)
        b.producer.call("drop", self.put_spec, groups)
        self.bad += wrong
        if not self.warm:
            self.puts += put_lat
            self.gets += get_lat
        self.warm = False

    def rows(self) -> list[Row]:
        """(put, get), or why it failed."""
        system, transport = self.names
        if self.error:
            return [Row(system, transport, "-", self.size, self.batch, note=self.error)]
        bytes_api = self.get_spec[0] == "embcache" and self.get_spec[-1] == "bytes"
        op = OP_NAMES.get("embcache bytes" if bytes_api else system, {})
        size, batch = self.size, self.batch
        put = timed_row(system, transport, op.get(("put", batch), "put"), size, batch, self.puts)
        total = [g + (r if self.time_release else 0.0) for g, r in self.gets]
        call = op.get(("get", batch), "get")
        get = timed_row(system, transport, call, size, batch, total, self.bad)
        get.release_p50_us = statistics.median(r for _, r in self.gets)
        if self.get_spec[0] == "embcache" and self.get_spec[-1] == "view":
            get.note = f"get + release ({get.release_p50_us:.0f} us)"
        if self.get_spec[0] == "embcache" and self.get_spec[-1] == "default":
            get.note = "the default client: copies, no call where the read table has them"
        return [put, get]


@dataclass
class Bench:
    producer: Worker
    consumers: list[Worker]
    ids: Ids
    quick: bool

    @property
    def consumer(self) -> Worker:
        return self.consumers[0]

    def calls(self, size: int, batch: int) -> int:
        n = CALLS.get((size, batch), 20)
        return max(5, n // 5) if self.quick else n

    def pair(self, *args: Any, **kw: Any) -> list[Row]:
        """One case on its own (Case's arguments): its rows."""
        return self.interleave([Case(self, *args, **kw)])

    @staticmethod
    def interleave(cases: list[Case]) -> list[Row]:
        """Run the cases round by round, in turn; their rows, put then get. A case whose
        store fails ends with one row that says why; the others go on."""
        while not all(c.done for c in cases):
            for c in cases:
                if c.done:
                    continue
                try:
                    c.step()
                except RuntimeError as exc:
                    c.error = "failed: " + str(exc).strip().splitlines()[-1][:200]
        return [row for c in cases for row in c.rows()]

    def concurrent(
        self, names: tuple[str, str, str], put_spec: Spec, get_spec: Spec, nkeys: int = 16
    ) -> tuple[float, int]:
        """``CONSUMERS`` processes fetch the same ``nkeys`` 4 MiB keys ``passes`` times at
        once: (total GB/s, wrong values)."""
        passes = 1 if self.quick else 2
        groups = [self.ids.take(1) for _ in range(nkeys)]
        self.producer.call("put", put_spec, LARGE, groups, "host")
        flat = [g[0] for g in groups]
        for c in self.consumers:  # connect and warm up
            c.call("get", get_spec, LARGE, groups[:2])
        start_at = time.perf_counter() + 0.2
        for c in self.consumers:
            c.send("stream", get_spec, LARGE, flat, passes, start_at)
        done = [c.result() for c in self.consumers]
        self.producer.call("drop", put_spec, groups)
        wall = max(t1 for _, t1, _ in done) - start_at
        total = len(self.consumers) * passes * nkeys * LARGE
        return total / wall / 1e9, sum(b for _, _, b in done)

    def concurrent_rows(self, sides: list[tuple[tuple[str, str, str], Spec, Spec]]) -> list[Row]:
        """``concurrent`` for each side in turn, a few times; rows with the median GB/s."""
        runs: dict[int, list[tuple[float, int]]] = {i: [] for i in range(len(sides))}
        for _ in range(2 if self.quick else 5):
            for i, side in enumerate(sides):
                runs[i].append(self.concurrent(*side))
        rows = []
        for i, (names, _, _) in enumerate(sides):
            row = Row(*names, LARGE, 1, calls=len(runs[i]))
            row.gbs = statistics.median(g for g, _ in runs[i])
            row.bad = sum(b for _, b in runs[i])
            row.note = f"{len(self.consumers)} consumers, total GB/s"
            row.extra["gbs_runs"] = [g for g, _ in runs[i]]
            rows.append(row)
        return rows


def memcpy_floor(quick: bool) -> list[Row]:
    """The in-process floor: one numpy copy per value of the same payloads."""
    rows = []
    for size, batch in ((SMALL, 1), (LARGE, 1), (SMALL, BATCH), (LARGE, BATCH)):
        src = [payload(i, size) for i in range(batch)]
        dst = [np.empty_like(s) for s in src]

        def copy(src: list[np.ndarray] = src, dst: list[np.ndarray] = dst) -> None:
            for s, d in zip(src, dst, strict=True):
                np.copyto(d, s)

        iters = 200 if quick else 1000
        lat = []
        for _ in range(WARMUP):
            copy()
        for _ in range(iters):
            t0 = time.perf_counter()
            copy()
            lat.append((time.perf_counter() - t0) * 1e6)
        bad = sum(not same(d, s) for s, d in zip(src, dst, strict=True))
        rows.append(timed_row("memcpy floor", "in-process", "np.copyto", size, batch, lat, bad))
    return rows


# -- the servers ----------------------------------------------------------------------------
class RedisWithSocket(RedisNodes):
    """One plain Redis node (tests/tiers' launcher) that also listens on a Unix socket."""

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir, 1, cluster=False)
        self.socket = workdir / "redis.sock"

    def _args(self, port: int) -> list[str]:
        sock = ["--unixsocket", str(self.socket), "--unixsocketperm", "700"]
        return [*super()._args(port), *sock]


def pin_process(pid: int, cpus: str) -> None:
    """Every thread of a server started here onto ``cpus`` (nothing when empty)."""
    if not cpus:
        return
    cpu_set = parse_cpu_list(cpus)
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(int(tid), cpu_set)


def in_loopback_namespace() -> bool:
    """Whether this process runs where loopback is the only interface (then it is up)."""
    from mooncake_scenario import loopback_only_namespace

    try:
        loopback_only_namespace()
    except SystemExit:
        return False
    except OSError:  # only loopback, but it cannot be changed here
        return True
    return True


def netns_problem() -> str | None:
    if shutil.which("unshare") is None:
        return "unshare (util-linux) not installed"
    probe = subprocess.run(["unshare", "-n", "true"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        return f"unshare -n failed: {probe.stderr.strip()[:160]}"
    return None


def mooncake_problem(netns: bool) -> str | None:
    if mooncake_master_binary() is None:
        return "Mooncake Store package not installed"
    if not netns:  # a master that cannot start is reported when it fails
        return "needs a loopback-only network namespace (its transfer engine binds every interface)"
    return None


# -- the sections ---------------------------------------------------------------------------
def shm_dir(tmp: Path) -> Path:
    """Where the safetensors files go: /dev/shm (memory), as ECExampleConnector is used."""
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp


def skipped(system: str, reason: str) -> Row:
    return Row(system, "-", "-", 0, 0, note=f"skipped: {reason}")


def mooncake_master(work: Path) -> MooncakeMaster:
    """tests/tiers' master, with reads leased for 10 s instead of 100 ms: a 16 x 4 MiB
    ``get_batch`` takes longer than that here and fails with LEASE_EXPIRED. The same binary
    runs through a wrapper that adds the flag last (gflags: the last value wins)."""
    master = MooncakeMaster(work)
    wrapper = work / "mooncake_master"
    real = shlex.quote(str(master.binary))
    wrapper.write_text(f'#!/bin/sh\nexec {real} "$@" --default_kv_lease_ttl=10000\n')
    wrapper.chmod(0o755)
    master.binary = wrapper
    return master.start()


def start_servers(
    stack: contextlib.ExitStack, tmp: Path, args: argparse.Namespace, netns: bool
) -> tuple[dict[str, tuple[tuple[str, str], Spec, Spec]], list[Row]]:
    """Every CPU server, stopped when ``stack`` closes: the cases by name (the row names,
    the producer's spec, the consumer's) and a row for each store skipped."""
    cases: dict[str, tuple[tuple[str, str], Spec, Spec]] = {}
    skips: list[Row] = []
    sock = tmp / "d.sock"
    flags = ["--grpc-socket", str(sock), "--grpc-host", LOOPBACK, "--http-host", LOOPBACK]
    flags += ["--host-pool-bytes", "1GiB", "--max-entry-bytes", "64MiB"]
    flags += ["--device-pool-bytes", "0"]  # the host paths only (the GPU part has its own)
    if args.daemon_cpus:
        flags += ["--cpu-affinity", args.daemon_cpus]
    daemon = DaemonProcess(flags)
    stack.callback(daemon.stop, timeout=30)
    unix, tcp = ("embcache", f"unix:{sock}"), ("embcache", daemon.grpc_target)
    cases["embcache unix"] = (("embcache", "unix"), (*unix, "default"), (*unix, "default"))
    views = (("embcache", "unix views"), (*unix, "default"), (*unix, "view"))
    cases["embcache unix views"] = views
    cases["embcache tcp"] = (("embcache", "tcp"), (*tcp, "default"), (*tcp, "default"))
    cases["embcache tcp bytes"] = (("embcache", "tcp bytes"), (*tcp, "bytes"), (*tcp, "bytes"))

    if reason := redis_missing():
        skips.append(skipped("redis", reason))
    else:
        (tmp / "redis").mkdir()
        redis = RedisWithSocket(tmp / "redis")
        stack.callback(redis.close)
        redis.start()
        for proc in redis.procs.values():
            pin_process(proc.pid, args.daemon_cpus)
        for transport, address in (
            ("unix", f"unix:{redis.socket}"),
            ("tcp", f"{LOOPBACK}:{redis.ports[0]}"),
        ):
            redis_spec = ("redis", address)
            cases[f"redis {transport}"] = (("redis", transport), redis_spec, redis_spec)

    try:
        import safetensors  # noqa: F401
    except ImportError:
        skips.append(skipped("safetensors", "safetensors not installed"))
    else:
        shm = shm_dir(tmp)
        folder = tempfile.mkdtemp(prefix="embcache-peers-", dir=shm)
        stack.callback(shutil.rmtree, folder, ignore_errors=True)
        files = ("safetensors", folder, "cpu")
        cases["safetensors"] = (("safetensors", f"{shm} files"), files, files)

    if reason := mooncake_problem(netns):
        skips.append(skipped("mooncake", reason))
    else:
        work = tmp / "mooncake"
        work.mkdir()
        try:
            master = mooncake_master(work)
            stack.callback(master.close)
            storage = start_storage_node(work, master.port, 1024 * MiB)
            stack.callback(stop_server, storage)
        except (AssertionError, RuntimeError, OSError) as exc:
            skips.append(skipped("mooncake", f"did not start: {exc}"))
        else:
            assert master.proc is not None
            pin_process(master.proc.pid, args.daemon_cpus)
            pin_process(storage.pid, args.daemon_cpus)
            spec = ("mooncake", f"{LOOPBACK}:{master.port}")
            cases["mooncake"] = (("mooncake", "tcp (transfer engine)"), spec, spec)
    return cases, skips


def cpu_section(bench: Bench, tmp: Path, args: argparse.Namespace, netns: bool) -> list[Row]:
    rows = memcpy_floor(args.quick)
    with contextlib.ExitStack() as stack:
        cases, skips = start_servers(stack, tmp, args, netns)
        for size, batch in ((SMALL, 1), (LARGE, 1), (SMALL, BATCH), (LARGE, BATCH)):
            rows += bench.interleave([Case(bench, *case, size, batch) for case in cases.values()])
        concurrent = [
            (
                ("embcache", "tcp bytes", "get_bytes"),
                cases["embcache unix"][1],
                cases["embcache tcp bytes"][2],
            )
        ]
        if "redis tcp" in cases:
            redis_tcp = cases["redis tcp"][1]
            concurrent.append((("redis", "tcp", "GET"), redis_tcp, redis_tcp))
        rows += bench.concurrent_rows(concurrent)
    return rows + skips


def guarded(rows: list[Row], system: str, part: Callable[[], list[Row]]) -> None:
    """Append ``part()``'s rows, or one row saying why it failed (the other parts go on)."""
    try:
        rows += part()
    except (RuntimeError, TimeoutError, AssertionError, OSError) as exc:
        last = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
        rows.append(Row(system, "-", "-", 0, 0, note=f"failed: {last[:200]}"))


def gpu_floors() -> tuple[list[Row], dict[str, Any]]:
    floors: dict[str, Any] = {"gpu": torch.cuda.get_device_name()}
    rows = []
    for batch in (1, BATCH):
        gbs = copy_engine_gbs(LARGE * batch)
        row = Row("copy engine floor", "pinned H2D", "copy_", LARGE, batch, gbs=gbs)
        row.p50_us = LARGE * batch / gbs / 1e3
        row.note = "one contiguous transfer, median"
        floors[f"copy_engine_{batch * 4}MiB_gbs"] = gbs
        floors[f"copy_engine_{batch * 4}MiB_us"] = row.p50_us
        rows.append(row)
    return rows, floors


def ipc_rows(bench: Bench, calls: tuple[int, int]) -> list[Row]:
    """The torch CUDA-IPC handoff, producer to consumer, 1 x 4 MiB and 16 x 4 MiB."""
    rows = []
    for batch, n in zip((1, BATCH), calls, strict=True):
        groups = [bench.ids.take(batch) for _ in range(n + WARMUP)]
        bench.producer.send("ipc_serve", LARGE, groups)
        try:
            lat, bad = bench.consumer.call("ipc_fetch", LARGE, groups)
        finally:
            bench.producer.result()  # its answer, whatever the consumer's was
        rows.append(
            timed_row(
                "torch CUDA IPC",
                "handle over a pipe",
                "rebuild + clone",
                LARGE,
                batch,
                lat[WARMUP:],
                bad,
            )
        )
    return rows


def embcache_gpu_rows(bench: Bench, target: str, quick: bool, calls: tuple[int, int]) -> list[Row]:
    """embcache's device paths through the client, producer and consumer apart."""
    n1, nb = calls
    host, cuda = ("embcache", target, "view"), ("embcache", target, "cuda")
    names = ("embcache", "unix -> cuda")
    iters = 30 if quick else 100
    # Cold: every key put by the producer first, each got once; then one of them again and
    # again (resident on the GPU after its first get).
    groups = [bench.ids.take(1) for _ in range(iters + WARMUP)]
    bench.producer.call("put", host, LARGE, groups, "host")
    lat, bad = bench.consumer.call("get", cuda, LARGE, groups)
    cold = timed_row(*names, "get (cold)", LARGE, 1, [g for g, _ in lat[WARMUP:]], bad)
    cold.release_p50_us = statistics.median(r for _, r in lat)
    lat, bad = bench.consumer.call("get", cuda, LARGE, [groups[0]] * (iters + WARMUP))
    hit = timed_row(*names, "get (resident)", LARGE, 1, [g for g, _ in lat[WARMUP:]], bad)
    hit.release_p50_us = statistics.median(r for _, r in lat)
    bench.producer.call("drop", host, groups)
    rows = [cold, hit]
    # Puts from the producer's GPU, checked by the consumer through a host get.
    for batch, n, call in ((1, n1, "put from device"), (BATCH, nb, "put_many from device")):
        put = bench.pair(names, host, host, LARGE, batch, source="cuda", calls=n)[0]
        put.call = call
        rows.append(put)
    # 16 x 4 MiB to the GPU, device pages fragmented: one batch put just before its get,
    # and every batch stored first, then got one at a time; each batch is evicted after its
    # get, so that every batch meets the same holes (as in bench/grpc_e2e.py).
    largest = bench.consumer.call("fragment", cuda)
    note = f"fragmented device pool (largest free run {largest} pages)"
    for per_round, call in ((1, "get, put just before"), (nb, "get, stored earlier")):
        got = bench.pair(names, host, cuda, LARGE, BATCH, per_round=per_round, calls=nb,
                         time_release=False, drop_each=True)[-1]  # fmt: skip
        got.call, got.note = call, got.note or note
        rows.append(got)
    return rows


def gpu_section(
    bench: Bench, tmp: Path, args: argparse.Namespace
) -> tuple[list[Row], dict[str, Any]]:
    """The GPU peers and embcache's device paths, with the copy engine of the same run."""
    rows, floors = gpu_floors()
    calls = (20, 4) if args.quick else (50, 10)
    try:
        import safetensors  # noqa: F401
    except ImportError:
        rows.append(skipped("safetensors -> cuda", "safetensors not installed"))
    else:
        folder = tempfile.mkdtemp(prefix="embcache-peers-", dir=shm_dir(tmp))
        try:
            spec = ("safetensors", folder, "cuda:0")
            names = ("safetensors", "/dev/shm -> cuda")
            for batch, n in zip((1, BATCH), calls, strict=True):
                part = functools.partial(
                    bench.pair, names, spec, spec, LARGE, batch, source="cuda", calls=n
                )
                guarded(rows, "safetensors", part)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    guarded(rows, "torch CUDA IPC", lambda: ipc_rows(bench, calls))
    sock = tmp / "gpu.sock"
    flags = ["--grpc-socket", str(sock), "--host-pool-bytes", "4GiB", "--device-pool-bytes", "1GiB"]
    # The device pool is fragmented on purpose; a free reserve would evict the oldest
    # fillers into one free run for the batches to land in (as in bench/grpc_e2e.py).
    flags += ["--device-free-reserve", "0", "--grpc-host", LOOPBACK, "--http-host", LOOPBACK]
    if args.daemon_cpus:
        flags += ["--cpu-affinity", args.daemon_cpus]
    daemon = DaemonProcess(flags)
    try:
        target = f"unix:{sock}"
        guarded(rows, "embcache", lambda: embcache_gpu_rows(bench, target, args.quick, calls))
    finally:
        daemon.stop(timeout=60)
    return rows, floors


# -- targets --------------------------------------------------------------------------------
def find(rows: list[Row], system: str, transport: str, call: str, size: int, batch: int) -> Row:
    for r in rows:
        if (r.system, r.transport, r.call, r.size, r.batch) == (
            system,
            transport,
            call,
            size,
            batch,
        ):
            return r
    raise KeyError((system, transport, call, size, batch))


# (path, ours, peer, target): ours and peer are find() keys; ratio = ours / peer p50, or
# ours / peer GB/s where the target is ">=".
CPU_TARGETS = [
    ("get 64 KiB, same node, the default client", ("embcache", "unix", "get", SMALL, 1),
     ("redis", "unix", "GET", SMALL, 1), "<=", 1.0),
    ("get 64 KiB, same node, TCP target", ("embcache", "tcp", "get", SMALL, 1),
     ("redis", "unix", "GET", SMALL, 1), "<=", 1.0),
    ("get 4 MiB, same node, the default client", ("embcache", "unix", "get", LARGE, 1),
     ("redis", "unix", "GET", LARGE, 1), "<=", 1.0),
    ("put 64 KiB", ("embcache", "unix", "put", SMALL, 1),
     ("redis", "unix", "SET", SMALL, 1), "<=", 1.0),
    ("put 4 MiB host tensor, same node", ("embcache", "unix", "put", LARGE, 1),
     ("redis", "unix", "SET", LARGE, 1), "<=", 0.25),
    ("put_many 16 x 64 KiB", ("embcache", "unix", "put_many", SMALL, BATCH),
     ("redis", "unix", "MSET", SMALL, BATCH), "<=", 1.0),
    ("get_bytes 4 MiB over TCP", ("embcache", "tcp bytes", "get_bytes", LARGE, 1),
     ("redis", "tcp", "GET", LARGE, 1), "<=", 1.0),
    ("4 concurrent get_bytes consumers, total", ("embcache", "tcp bytes", "get_bytes", LARGE, 1),
     ("redis", "tcp", "GET", LARGE, 1), ">=", 1.0),
    ("put 4 MiB over TCP from another process", ("embcache", "tcp bytes", "put", LARGE, 1),
     ("redis", "tcp", "SET", LARGE, 1), "<=", 1.0),
]  # fmt: skip


def cpu_targets(rows: list[Row], concurrent: dict[str, Row]) -> list[dict[str, Any]]:
    out = []
    for path, ours_key, peer_key, op, goal in CPU_TARGETS:
        entry: dict[str, Any] = {"path": path, "target": f"{op} {goal:g}"}
        try:
            if op == ">=":
                ours, peer = concurrent[ours_key[0]], concurrent[peer_key[0]]
                entry.update(ours=f"{ours.gbs:.2f} GB/s", peer=f"{peer.gbs:.2f} GB/s")
                ratio = ours.gbs / peer.gbs
            else:
                ours, peer = find(rows, *ours_key), find(rows, *peer_key)
                entry.update(ours=f"{ours.p50_us:.0f} us", peer=f"{peer.p50_us:.0f} us")
                ratio = ours.p50_us / peer.p50_us
        except (KeyError, ZeroDivisionError):
            entry.update(ours="-", peer="-", ratio=None, holds="n/a (not measured)")
        else:
            holds = ratio >= goal if op == ">=" else ratio <= goal
            entry.update(ratio=ratio, holds="yes" if holds else "no")
        entry["peer_name"] = f"{peer_key[0]} {peer_key[2]} ({peer_key[1]})"
        out.append(entry)
    return out


def gpu_targets(rows: list[Row], floors: dict[str, Any]) -> list[dict[str, Any]]:
    names = ("embcache", "unix -> cuda")
    want = [
        ("cold 1 x 4 MiB get", "get (cold)", 1, "p50 <= 150 us", 150.0),
        ("resident hit", "get (resident)", 1, "p50 <= 50 us", 50.0),
        ("put from device, 1 x 4 MiB", "put from device", 1, "p50 <= 150 us", 150.0),
        ("16 x 4 MiB batch put just before its get", "get, put just before", BATCH,
         ">= 0.85 of the copy engine", 0.85),
        ("16 x 4 MiB batch stored earlier", "get, stored earlier", BATCH,
         ">= 0.90 of the copy engine", 0.90),
    ]  # fmt: skip
    out = []
    for path, call, batch, target, goal in want:
        try:
            r = find(rows, *names, call, LARGE, batch)
        except KeyError:
            out.append({"path": path, "target": target, "holds": "n/a (not measured)"})
            continue
        if batch == 1:
            floor = floors["copy_engine_4MiB_us"]
            ratio = floor / r.p50_us  # share of the time that is the copy itself
            out.append(
                {
                    "path": path,
                    "ours": f"{r.p50_us:.0f} us",
                    "floor": f"{floor:.0f} us",
                    "ratio": ratio,
                    "target": target,
                    "holds": "yes" if r.p50_us <= goal else "no",
                }
            )
        else:
            ratio = r.gbs / floors["copy_engine_64MiB_gbs"]
            out.append(
                {
                    "path": path,
                    "ours": f"{r.gbs:.1f} GB/s",
                    "floor": f"{floors['copy_engine_64MiB_gbs']:.1f} GB/s",
                    "ratio": ratio,
                    "target": target,
                    "holds": "yes" if ratio >= goal else "no",
                }
            )
    return out


# -- output ---------------------------------------------------------------------------------
HEADERS = ["system", "transport", "call", "payload", "p50 us", "p99 us", "GB/s", "x floor",
           "bad", "note"]  # fmt: skip


def print_rows(rows: list[Row], floor_of: Callable[[Row], Row | None]) -> None:
    out: list[list[object]] = []
    for r in rows:
        if r.note.startswith(("skipped", "failed")):
            out.append([r.system, r.transport, *["-"] * 7, r.note])
            continue
        floor = floor_of(r)
        vs = f"{r.p50_us / floor.p50_us:.1f}" if floor and floor.p50_us and r.p50_us else "-"
        cells = [r.p50_us or "-", r.p99_us or "-", r.gbs, vs, r.bad, r.note]
        out.append([r.system, r.transport, r.call, r.payload(), *cells])
    print(table(HEADERS, out), flush=True)


def run(args: argparse.Namespace, netns: bool, netns_note: str) -> int:
    env = environment()
    env["daemon_cpus"], env["client_cpus"] = args.daemon_cpus or "any", args.client_cpus or "any"
    print_environment(env)
    if netns_note:
        print(netns_note, flush=True)
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")  # Mooncake's INFO lines: not here
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()  # producer <-> first consumer, for the CUDA-IPC handoff
    producer = Worker(ctx, args.client_cpus, a)
    consumers = [Worker(ctx, args.client_cpus, b if i == 0 else None) for i in range(CONSUMERS)]
    workers = [producer, *consumers]
    bench = Bench(producer, consumers, Ids(), args.quick)
    results: dict[str, Any] = {"env": env, "quick": args.quick, "netns": netns}
    t_start = time.monotonic()
    try:
        for w in workers:
            w.send("ping")
        for w in workers:
            w.result(120)
        with tempfile.TemporaryDirectory(prefix="ecp-") as tmp:
            rows = cpu_section(bench, Path(tmp), args, netns)
            gpu_rows: list[Row] = []
            floors: dict[str, Any] = {}
            if torch.cuda.is_available():
                gpu_rows, floors = gpu_section(bench, Path(tmp), args)
    finally:
        for w in workers:
            w.close()
    concurrent = {r.system: r for r in rows if r.note.endswith("total GB/s")}
    cpu_goals = cpu_targets(rows, concurrent)
    floors_by = {(r.size, r.batch): r for r in rows if r.system == "memcpy floor"}
    print("\nCPU paths: producer and consumer in separate processes; x floor = p50 over the")
    print("in-process memcpy of the same payload (zero-copy get: get + release)")
    print_rows(rows, lambda r: floors_by.get((r.size, r.batch)))
    print("\nCPU targets (ratio = embcache / Redis p50, or GB/s for the consumers)")
    print(
        table(
            ["path", "embcache", "peer", "peer call", "ratio", "target", "holds"],
            [
                [
                    g["path"],
                    g["ours"],
                    g["peer"],
                    g["peer_name"],
                    g["ratio"] if g["ratio"] is not None else "-",
                    g["target"],
                    g["holds"],
                ]
                for g in cpu_goals
            ],
        )
    )
    results.update(cpu=[asdict(r) for r in rows], cpu_targets=cpu_goals)
    if torch.cuda.is_available():
        gpu_goals = gpu_targets(gpu_rows, floors)
        ce = {1: gpu_rows[0], BATCH: gpu_rows[1]}
        print("\nGPU paths (across processes; x floor = p50 over one contiguous copy-engine")
        print("transfer of the same bytes)")
        print_rows(gpu_rows, lambda r: ce.get(r.batch) if r.size == LARGE else None)
        print("\nGPU targets (ratio: copy-engine time / p50, or GB/s / copy engine)")
        print(
            table(
                ["path", "embcache", "floor", "ratio", "target", "holds"],
                [
                    [
                        g["path"],
                        g.get("ours", "-"),
                        g.get("floor", "-"),
                        g.get("ratio", "-"),
                        g["target"],
                        g["holds"],
                    ]
                    for g in gpu_goals
                ],
            )
        )
        results.update(gpu=[asdict(r) for r in gpu_rows], gpu_floors=floors, gpu_targets=gpu_goals)
    else:
        results["gpu"] = "no CUDA here: GPU paths not measured"
        print("\nGPU paths: no CUDA here, not measured")
    results["wall_s"] = time.monotonic() - t_start
    print(f"\nwall {results['wall_s']:.0f} s", flush=True)
    save_json("peers", results, args.out_dir)
    bad = sum(r.bad for r in rows + gpu_rows)
    if bad:
        print(f"error: {bad} values did not hold the bytes put", file=sys.stderr)
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", type=Path, default=HERE / "results")
    ap.add_argument("--quick", action="store_true", help="a fifth of the calls (a smoke run)")
    ap.add_argument("--daemon-cpus", default="", help="CPUs of every server, e.g. 1")
    ap.add_argument("--client-cpus", default="", help="CPUs of this process and its workers")
    ap.add_argument("--no-netns", action="store_true", help="do not re-run in a private netns")
    args = ap.parse_args()
    if args.client_cpus:  # before any thread or worker starts; they inherit it
        os.sched_setaffinity(0, parse_cpu_list(args.client_cpus))
    netns, note = in_loopback_namespace(), ""
    if not netns and not args.no_netns:
        problem = netns_problem()
        if problem is None:
            argv = [sys.executable, str(Path(__file__).resolve()), *sys.argv[1:]]
            argv += ["--out-dir", str(args.out_dir.resolve())]
            env = {**os.environ, "EMBCACHE_GIT_COMMIT": git_commit()}
            return subprocess.call(["unshare", "-n", *argv], env=env)
        note = f"no loopback-only network namespace ({problem}): Mooncake is skipped"
    return run(args, netns, note)


if __name__ == "__main__":
    sys.exit(main())
