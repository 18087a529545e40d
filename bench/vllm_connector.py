"""EmbCacheECConnector against vLLM's own ECExampleConnector (safetensors on /dev/shm), in
one run on one GPU: per-item put and load of 4 MiB items, a batch of 16 x 4 MiB, and the
stall a save adds to the forward stream.

Both connectors run through vLLM's V2 model runner's ``ActiveECConnector`` and the
scheduler-side hooks in the order of vLLM's scheduler (tests/integrations/vllm_kit.py
builds the configs and drives the steps; vLLM 0.33 and 0.34). A load is timed from the
request's arrival to its items in the encoder cache, over as many engine steps as the
connector takes (embcache: a lookup, a staging, the step that uses it). The embcache
daemon is a child process on a Unix socket. On its node embcache's loads should make no call
(the lookup reads the daemon's read table, the staging copies out of the registered pool):
the daemon's counters over the timed rounds are recorded (``daemon_during_rounds``: hits
answered by a call should be 0, every load a table read).
``python3 bench/vllm_connector.py --out-dir DIR``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "tests" / "integrations"))
sys.path.insert(0, str(ROOT))
import vllm_kit as kit  # noqa: E402
from _common import git_commit, gpu_name  # noqa: E402
from vllm.distributed.ec_transfer import (  # noqa: E402
    ensure_ec_transfer_initialized,
    ensure_ec_transfer_shutdown,
    get_ec_transfer,
)
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole  # noqa: E402
from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory  # noqa: E402

from embcache.clients import EmbCacheClient  # noqa: E402
from embcache.service.daemon_process import DaemonProcess  # noqa: E402

ROWS, WIDTH = 512, 4096  # bf16: 4 MiB per item
ROUNDS = 20


def item(seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(ROWS, WIDTH, generator=g, device="cuda").to(torch.bfloat16)


class Side:
    """One connector kind, as one vLLM instance holds it: an ``ec_both`` worker connector
    (vLLM's EC transfer state) and a scheduler-role connector, both kept for the whole run
    and driven by one ``vllm_kit.Engine``. A fresh worker connects on its first call;
    ``first`` times that call apart."""

    def __init__(self, name: str, model: Any, extra: dict[str, Any], connector: str) -> None:
        self.name, self.model, self.extra, self.connector = name, model, extra, connector
        self.engine: Any = None

    def config(self, role: str) -> Any:
        return kit.vllm_config(self.model, role, self.extra, connector=self.connector)

    def __enter__(self) -> Side:
        ensure_ec_transfer_initialized(self.config("ec_both"))
        sched = ECConnectorFactory.create_connector(
            self.config("ec_both"), ECConnectorRole.SCHEDULER
        )

        def encode(identifier: str) -> torch.Tensor:
            raise AssertionError(f"{self.name}: {identifier} was encoded, not loaded")

        self.engine = kit.Engine(sched, get_ec_transfer(), encode)
        return self

    def __exit__(self, *exc: object) -> None:
        conn = get_ec_transfer()
        if hasattr(conn, "wait_for_saves"):
            conn.wait_for_saves(120)
        ensure_ec_transfer_shutdown()
        self.engine.sched.shutdown()

    def empty_step(self) -> Any:
        """A scheduler output with this connector's metadata of a step with nothing new."""
        meta = self.engine.sched.build_connector_meta(kit.scheduler_output(None))
        return kit.scheduler_output(meta)

    def put(self, items: dict[str, torch.Tensor]) -> tuple[float, float]:
        """(seconds until stored, seconds the step's save calls held the caller)."""
        conn = get_ec_transfer()
        cache = self.engine.cache
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = self.empty_step()
        with self.engine.active.maybe_get_output(out):
            cache.update(items)  # the encoder's outputs; saved as the block ends
            h = time.perf_counter()
        held = time.perf_counter() - h
        if hasattr(conn, "wait_for_saves"):
            assert conn.wait_for_saves(60)
        seconds = time.perf_counter() - t0
        cache.clear()
        return seconds, held

    def load(self, items: dict[str, torch.Tensor]) -> float:
        """Seconds from the request's arrival to its items on the GPU (bytes checked after)."""
        rid = f"r-{time.time_ns()}"
        engine = self.engine
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.add(kit.request(rid, [(k, ROWS) for k in items]))
        engine.run(pause_s=0)
        # Under vLLM's CPU platform (scripts/gpu_integrations.sh says why) the example
        # connector's load_file lands on the CPU; the move to the GPU is what its
        # load_file(device="cuda") does on the CUDA platform, so it is timed here too.
        read = engine.read[rid]
        for k, t in read.items():
            if not t.is_cuda:
                read[k] = t.to("cuda")
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        assert engine.done.get(rid) == "ok", f"{self.name}: {engine.done.get(rid)}"
        for k, t in items.items():
            assert torch.equal(read[k], t), f"{self.name}: {k} differs"
        engine.cache.clear()
        engine.read.clear()
        return seconds


def registered_wait_s(timeout_s: float = 600) -> float:
    """Wait until the worker's mapping of the daemon's pool is registered with CUDA (until
    then its GPU loads are calls, docs/same_node_reads.md): the rounds time the steady
    state, a fresh worker's first load is timed apart. Returns the seconds waited."""
    try:
        from embcache.clients.device.registered import registered_pool
    except ImportError:  # a client without GPU reads from the table
        return 0.0
    client = getattr(getattr(get_ec_transfer(), "_loader", None), "_client", None)
    table = client._tables.read_table() if client is not None else None
    registration = registered_pool(table.pool) if table is not None else None
    if registration is None:
        return 0.0
    started = time.perf_counter()
    registration.wait_registered(timeout_s)
    return time.perf_counter() - started


def read_counters(target: str) -> dict[str, int]:
    """The daemon's hits, misses and read-table reads (hits through a call: hits - reads)."""
    with EmbCacheClient(target) as c:
        s = c.stats()
    return {"hits": s["hits"], "misses": s["misses"], "table_reads": s["read_table"]["reads"]}


def counted(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """What reached the daemon between two ``read_counters``."""
    reads = after["table_reads"] - before["table_reads"]
    return {
        "table_reads": reads,
        "hits_by_call": after["hits"] - before["hits"] - reads,
        "misses": after["misses"] - before["misses"],
    }


def stall(side: Side, n_kernels: int = 40) -> float:
    """Extra milliseconds a save per kernel adds to a stream of GEMMs (the forward pass),
    through the worker connector in place: V2 saves a step's new items as the step's
    connector block ends, so each kernel is one step here."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    conn = get_ec_transfer()
    cache = side.engine.cache

    def run(save: bool, tag: str) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(n_kernels):
            with side.engine.active.maybe_get_output(side.empty_step()):
                b = a @ a
                if save:
                    cache[f"{tag}-{i}"] = b[:ROWS].contiguous()
        torch.cuda.synchronize()
        cache.clear()
        return time.perf_counter() - t0

    run(False, "warm")
    base = statistics.median(run(False, "b") for _ in range(3))
    with_saves = statistics.median(run(True, f"s{r}-{time.time_ns()}") for r in range(3))
    if hasattr(conn, "wait_for_saves"):
        conn.wait_for_saves(120)
    return (with_saves - base) * 1e3 / n_kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out-dir", type=Path, default=ROOT / "results")
    args = parser.parse_args()
    torch.cuda.init()
    tmp = Path(tempfile.mkdtemp(prefix="ecbench-"))
    shm = Path(tempfile.mkdtemp(prefix="ecbench-", dir="/dev/shm"))
    daemon = DaemonProcess(
        [
            "--grpc-socket",
            str(tmp / "d.sock"),
            "--host-pool-bytes",
            "8GiB",
            "--device-pool-bytes",
            "2GiB",
        ]
    )
    try:
        model = kit.model_config(kit.write_model(tmp / "model"))
        sides = [
            Side(
                "embcache",
                model,
                {"embcache_target": daemon.unix_target, "namespace": "bench"},
                "EmbCacheECConnector",
            ),
            Side(
                "ECExampleConnector", model, {"shared_storage_path": str(shm)}, "ECExampleConnector"
            ),
        ]
        rows: dict[str, dict[str, float]] = {}
        during: dict[str, dict[str, int]] = {}
        for side in sides:
            r: dict[str, list[float]] = {"put_ms": [], "save_call_ms": [], "load_ms": []}
            with side:
                first = {f"{side.name}-first": item(99)}
                first_put, _ = side.put(first)
                first_load = side.load(first)
                waited = registered_wait_s() if side.name == "embcache" else 0.0
                before = read_counters(daemon.unix_target)
                for i in range(ROUNDS):
                    items = {f"{side.name}-1x-{i}": item(i)}
                    stored, held = side.put(items)
                    r["put_ms"].append(stored * 1e3)
                    r["save_call_ms"].append(held * 1e3)
                    r["load_ms"].append(side.load(items) * 1e3)
                batch = {f"{side.name}-16x-{j}": item(1000 + j) for j in range(16)}
                stored, held = side.put(batch)
                load16 = side.load(batch)
                if side.name == "embcache":
                    time.sleep(0.2)  # the readers' touches are posted, not waited for
                    during[side.name] = counted(before, read_counters(daemon.unix_target))
                rows[side.name] = {
                    "put_1x4MiB_ms_p50": statistics.median(r["put_ms"]),
                    "save_call_1x4MiB_ms_p50": statistics.median(r["save_call_ms"]),
                    "load_1x4MiB_ms_p50": statistics.median(r["load_ms"]),
                    "put_16x4MiB_ms_per_item": stored * 1e3 / 16,
                    "load_16x4MiB_ms_per_item": load16 * 1e3 / 16,
                    "stall_ms_per_save": stall(side),
                    "first_put_fresh_worker_ms": first_put * 1e3,
                    "first_load_fresh_worker_ms": first_load * 1e3,
                    "waited_for_registration_s": waited,
                }
    finally:
        daemon.stop()
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
    names = list(next(iter(rows.values())))
    print(f"{'measure':32} {'embcache':>12} {'ECExample':>12} {'ratio':>7}")
    for n in names:
        e, b = rows["embcache"][n], rows["ECExampleConnector"][n]
        print(f"{n:32} {e:12.3f} {b:12.3f} {b / e if e else float('nan'):7.2f}")
    print("embcache daemon during the timed rounds:", during.get("embcache"))
    result = {
        "bench": "vllm_connector",
        "gpu": gpu_name(),
        "commit": git_commit(),
        "item_bytes": ROWS * WIDTH * 2,
        "rounds": ROUNDS,
        "vllm_platform": os.environ.get("VLLM_TARGET_DEVICE", "auto"),
        "results": rows,
        "daemon_during_rounds": during,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "vllm_connector.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
