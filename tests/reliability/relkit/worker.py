"""Worker processes of the soak and the faults: ``python -m relkit.worker``.

The first stdin line is a JSON config (``mode`` and its arguments). A worker prints JSON
lines on stdout: ``{"event": "ready"}`` once connected, events of its mode, and
``{"event": "done", ...counters}`` at the end. With ``wait_go`` it waits for a ``go``
line before working, so that every worker of a run starts at once.
"""

from __future__ import annotations

import json
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch

from embcache.clients import EmbCacheClient
from embcache.errors import EmbCacheError

from . import payload

# Failures a caller must be ready for while the daemon drains or dies.
DOWN = {"Draining", "RpcFailed:UNAVAILABLE", "RpcFailed:CANCELLED", "UnknownSession"}


def emit(**msg: Any) -> None:
    sys.stdout.write(json.dumps(msg) + "\n")
    sys.stdout.flush()


def error_name(exc: BaseException) -> str:
    code = getattr(exc, "code", None)
    name = type(exc).__name__
    return f"{name}:{code}" if name == "RpcFailed" else name


def zero_copy(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a view of a mapped host pool (not a gathered copy)."""
    from embcache.clients.device.shm import mapped_segment

    return mapped_segment(tensor) is not None


class Published:
    """Latest committed sequence number of each producer, in a shared file."""

    def __init__(self, path: str, n: int) -> None:
        self.arr = np.memmap(Path(path), dtype=np.int64, mode="r+", shape=(n,))

    def pick(self, rng: random.Random, prefix: str, window: int) -> str | None:
        p = rng.randrange(len(self.arr))
        last = int(self.arr[p])
        if last < 0:
            return None
        return f"{prefix}/{p}/{max(0, last - rng.randrange(window))}"


def make_client(cfg: dict[str, Any]) -> EmbCacheClient:
    return EmbCacheClient(
        cfg["target"],
        token=cfg.get("token"),
        timeout=cfg.get("timeout", 30.0),
        retries=cfg.get("retries", 4),
        client_name=cfg["mode"],
    )


def run_producer(cfg: dict[str, Any], client: EmbCacheClient, c: Counter[str]) -> None:
    rng = random.Random(cfg["seed"])
    pub = Published(cfg["published"], cfg["n_producers"])
    sizes = [int(s * payload.MiB) for s in cfg["sizes_mib"]]
    me, prefix = cfg["index"], cfg["prefix"]
    deadline = time.monotonic() + cfg["seconds"]
    seq = 0
    recent: dict[str, tuple[int, int, torch.dtype]] = {}  # key -> (nbytes, seed, dtype)
    while time.monotonic() < deadline:
        if recent and rng.random() < 0.03:  # an idempotent re-put of a recent key
            key = rng.choice(list(recent))
            try:
                created = client.put(key, payload.make(key, *recent[key]))
                c["reputs"] += 1
                c["reputs_created"] += int(created)  # True only if it had been evicted
            except EmbCacheError as exc:
                if not _allowed(exc, cfg, c):
                    return
            continue
        key = f"{prefix}/{me}/{seq}"
        params = (rng.choice(sizes), rng.getrandbits(63), rng.choice(payload.DTYPES))
        tensor = payload.make(key, *params)
        if cfg.get("device"):  # a same-node encoder: PutFromDevice from its GPU
            tensor = tensor.to(cfg["device"])
        try:
            created = client.put(key, tensor)
        except EmbCacheError as exc:
            if not _allowed(exc, cfg, c):
                return
            time.sleep(0.01)
            continue
        c["puts"] += 1
        c["put_bytes"] += params[0]
        c["puts_not_created"] += int(not created)
        pub.arr[me] = seq
        recent[key] = params
        if len(recent) > 64:
            recent.pop(next(iter(recent)))
        seq += 1


def run_consumer(cfg: dict[str, Any], client: EmbCacheClient, c: Counter[str]) -> None:
    rng = random.Random(cfg["seed"])
    pub = Published(cfg["published"], cfg["n_producers"])
    prefix, window = cfg["prefix"], cfg.get("window", 6)
    deadline = time.monotonic() + cfg["seconds"]
    kept: list[Any] = []  # [(until, keys, tensors)]: views kept after their block
    while time.monotonic() < deadline:
        _check_kept(kept, c, time.monotonic())
        keys = [k for k in (pub.pick(rng, prefix, window) for _ in range(rng.randint(1, 4))) if k]
        if not keys:
            time.sleep(0.01)
            continue
        keys = list(dict.fromkeys(keys))
        try:
            if rng.random() < 0.1:
                _get_bytes(client, keys[0], c)
            else:
                _get(cfg, client, keys, rng, c, kept)
        except EmbCacheError as exc:
            if not _allowed(exc, cfg, c):
                return
    _check_kept(kept, c, float("inf"))


def _check_kept(kept: list[Any], c: Counter[str], now: float) -> None:
    """Check again, then drop, the kept views whose time is up (their leases end then)."""
    for item in [k for k in kept if k[0] <= now]:
        kept.remove(item)
        for key, tensor in zip(item[1], item[2], strict=True):
            if tensor is not None:
                _verify(key, tensor, c)
                c["kept_verified"] += 1


def _get(
    cfg: dict[str, Any],
    client: EmbCacheClient,
    keys: list[str],
    rng: random.Random,
    c: Counter[str],
    kept: list[Any],
) -> None:
    device = cfg.get("device")
    # Views of the pool (host, or the device pool with ``device``) under leases; the other
    # gets are copies (on the daemon's node, read from its table without a call).
    views = rng.random() < cfg.get("view_prob", 0.5)
    with client.get(keys, device=device, zero_copy=views) as got:
        c["gets"] += 1
        c["view_gets"] += int(views)
        hold = views and rng.random() < cfg.get("hold_prob", 0.1)
        for key, tensor in zip(keys, got, strict=True):
            if tensor is None:
                c["misses"] += 1
                continue
            c["hits"] += 1
            c["zero_copy"] += int(tensor.is_cuda or zero_copy(tensor))
            _verify(key, tensor, c)
        if hold:  # keep the leases while others churn the pool, then check every byte again
            c["holds"] += 1
            time.sleep(rng.uniform(0.2, cfg.get("hold_max_s", 1.0)))
            for key, tensor in zip(keys, got, strict=True):
                if tensor is not None:
                    _verify(key, tensor, c)
    size = sum(t.numel() * t.element_size() for t in got if t is not None)
    keep = views and not kept and size <= cfg.get("keep_bytes", 0)
    if keep and rng.random() < cfg.get("keep_prob", 0):
        c["kept"] += 1  # the block has ended: only these tensors keep their leases now
        kept.append((time.monotonic() + rng.uniform(0.5, cfg["keep_s"]), keys, list(got)))


def _get_bytes(client: EmbCacheClient, key: str, c: Counter[str]) -> None:
    entry = client.get_bytes(key)
    c["get_bytes"] += 1
    if entry is None:
        c["misses"] += 1
        return
    c["hits"] += 1
    problem = payload.check_bytes(key, entry.data)
    c["verified_bytes"] += len(entry.data)
    if problem:
        c["mismatches"] += 1
        print(f"MISMATCH {key} (get_bytes): {problem}", file=sys.stderr, flush=True)


def _verify(key: str, tensor: torch.Tensor | None, c: Counter[str]) -> None:
    problem = payload.check(key, tensor)
    if tensor is not None:
        c["verified_bytes"] += tensor.numel() * tensor.element_size()
    c["verified"] += 1
    if problem:
        c["mismatches"] += 1
        print(f"MISMATCH {key}: {problem}", file=sys.stderr, flush=True)


def _allowed(exc: EmbCacheError, cfg: dict[str, Any], c: Counter[str]) -> bool:
    """Count a failure; False ends the worker (the daemon is going away)."""
    name = error_name(exc)
    c[f"error:{name}"] += 1
    if name == "PoolExhausted":  # every page leased or filling: a clean refusal
        return True
    if name in DOWN and cfg.get("until_down"):
        c["stopped_by_daemon"] += 1
        return False
    c["unexpected"] += 1
    print(f"UNEXPECTED {name}: {exc}", file=sys.stderr, flush=True)
    return True


def run_holder(cfg: dict[str, Any], client: EmbCacheClient, c: Counter[str]) -> None:
    """Lease ``keys`` (zero-copy views), verify, report, then wait for orders on stdin."""
    keys = cfg["keys"]
    leased = client.get(keys, ttl_s=cfg.get("ttl_s"), zero_copy=True)
    for key, tensor in zip(keys, leased, strict=True):
        _verify(key, tensor, c)
    emit(event="held", leases=len(leased.lease_ids), mismatches=c["mismatches"])
    line = sys.stdin.readline()  # the orchestrator may SIGKILL or SIGSTOP us here
    if line.strip() != "read":
        return
    report: dict[str, Any] = {"problems": [], "read_error": None, "release_error": None}
    try:  # read every view again: reused memory must not pass silently
        report["problems"] = [payload.check(k, t) for k, t in zip(keys, leased, strict=True)]
    except Exception as exc:
        report["read_error"] = error_name(exc)
    try:
        leased.release()
    except Exception as exc:
        report["release_error"] = error_name(exc)
    emit(event="read", **report)


def run_slow_put(cfg: dict[str, Any], client: EmbCacheClient, c: Counter[str]) -> None:
    """Stream a put and stall after a few chunks (the orchestrator kills us there)."""
    from embcache.clients.core.payload import payload_of

    key = cfg["key"]
    tensor = payload.make(key, cfg["nbytes"], 1)
    data = payload_of(tensor)

    def messages() -> Any:
        for i, msg in enumerate(data.messages(key)):
            yield msg
            if i == 2:
                emit(event="streaming")
                for _ in range(600):  # stall (bounded); we are killed or cut off here
                    time.sleep(0.1)

    try:
        client._conn.call(
            lambda md, to: client._conn.put_stream(messages(), timeout=to, metadata=md)
        )
        c["put_committed"] += 1
    except EmbCacheError as exc:
        c[f"error:{error_name(exc)}"] += 1


MODES = {
    "producer": run_producer,
    "consumer": run_consumer,
    "holder": run_holder,
    "slow_put": run_slow_put,
}


def main() -> int:
    cfg = json.loads(sys.stdin.readline())
    run = MODES[cfg["mode"]]
    c: Counter[str] = Counter()
    t0 = time.monotonic()
    with make_client(cfg) as client:
        emit(event="ready")
        if cfg.get("wait_go") and sys.stdin.readline().strip() != "go":
            return 0
        t0 = time.monotonic()
        run(cfg, client, c)
    if cfg.get("device"):
        from embcache.clients.device.pools import process_device_pools

        c["device_pool_opens"] = process_device_pools().opens
    emit(event="done", seconds=time.monotonic() - t0, **c)
    return 0


if __name__ == "__main__":
    sys.exit(main())
