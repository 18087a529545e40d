"""Worker processes for the same-node read tests: writers that re-put keys with new bytes,
readers that get them through the default client and check every value they are given.

    python -m relkit.table_churn '<json config>'

Config: ``role`` ("writer", "reader" or "spinner"), ``target``, ``keys`` (how many), ``elems``
(int32 elements per entry), ``seconds``, ``seed``, ``device`` (a reader's destination:
"cpu" or "cuda"). It prints one JSON line at the end: what it did and every problem seen.

Every entry is ``elems`` copies of one stamp, ``key index << 20 | version``: a value that is
not one stamp throughout, or whose key index is another key's, is a torn or foreign read.
"""

from __future__ import annotations

import json
import random
import sys
import time
from typing import Any

import torch

from embcache.clients import EmbCacheClient
from embcache.errors import EmbCacheError


def key(i: int) -> str:
    return f"churn/{i}"


def value(i: int, version: int, elems: int) -> torch.Tensor:
    return torch.full((elems,), (i << 20) | (version & 0xFFFFF), dtype=torch.int32)


def problem(i: int, got: torch.Tensor, elems: int) -> str | None:
    """Why ``got`` is not a whole value of key ``i`` (None: it is one)."""
    flat = got.reshape(-1).cpu()
    if flat.dtype != torch.int32 or flat.numel() != elems:
        return f"key {i}: {flat.dtype} x {flat.numel()}"
    stamp = int(flat[0])
    if stamp >> 20 != i:
        return f"key {i}: holds key {stamp >> 20}'s bytes"
    if not bool((flat == stamp).all()):
        return f"key {i}: torn ({int((flat != stamp).sum())} elements differ from the first)"
    return None


def write(client: EmbCacheClient, cfg: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    done, version = 0, cfg["seed"] << 12
    deadline = time.monotonic() + cfg["seconds"]
    while time.monotonic() < deadline:
        i = rng.randrange(cfg["keys"])
        version += 1
        try:
            client.evict(key(i))
            client.put(key(i), value(i, version, cfg["elems"]))
            done += 1
        except EmbCacheError:  # another writer's put of the key won the race: fine
            pass
    return {"puts": done}


def read(client: EmbCacheClient, cfg: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    reads = found = errors = 0
    problems: list[str] = []
    device = None if cfg.get("device", "cpu") == "cpu" else cfg["device"]
    deadline = time.monotonic() + cfg["seconds"]
    while time.monotonic() < deadline:
        picked = rng.sample(range(cfg["keys"]), k=min(2, cfg["keys"]))
        try:
            with client.get([key(i) for i in picked], device=device) as tensors:
                for i, got in zip(picked, tensors, strict=True):
                    reads += 1
                    if got is not None:
                        found += 1
                        why = problem(i, got, cfg["elems"])
                        if why is not None:
                            problems.append(why)
        except EmbCacheError:  # the daemon restarting: a call that failed cleanly
            errors += 1
            time.sleep(0.01)
    return {
        "reads": reads,
        "found": found,
        "errors": errors,
        "problems": problems[:20],
        "bad": len(problems),
    }


def spin(client: EmbCacheClient, cfg: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    """Get one large entry again and again (until killed): copies always in flight."""
    print(json.dumps({"event": "spinning"}), flush=True)
    while True:
        with client.get(key(0)) as (got,):
            assert got is not None


def main() -> int:
    cfg = json.loads(sys.argv[1])
    rng = random.Random(cfg["seed"])
    role = {"writer": write, "reader": read, "spinner": spin}[cfg["role"]]
    with EmbCacheClient(cfg["target"], timeout=10) as client:
        out = role(client, cfg, rng)
    print(json.dumps({"event": "done", **out}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
