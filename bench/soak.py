"""Reliability figures: the soak and the injected faults, full size or CI size.

    python bench/soak.py --full      # 16+16 processes for 60 s on a 256 MiB pool, 20 reps per fault
    python bench/soak.py             # the CI sizes (2+2 for 20 s on 64 MiB, 3 reps)
    python bench/soak.py --only soak # or --only faults

Prints one figures table per part and saves them to bench/results/soak.json (full) or
soak_ci.json. The harness is tests/reliability/relkit; the CI-sized forms also run under
pytest (tests/reliability). Only loopback and Unix sockets are used.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests" / "reliability"))

from _common import RESULTS_DIR, git_commit  # noqa: E402
from relkit import figures  # noqa: E402
from relkit.faults import run_faults  # noqa: E402
from relkit.soak import CI, FULL, run_soak  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="full sizes (else the CI sizes)")
    parser.add_argument("--only", choices=("soak", "faults"), help="run one part")
    parser.add_argument("--seconds", type=float, help="soak duration (overrides the size)")
    parser.add_argument("--reps", type=int, help="repetitions per fault (overrides the size)")
    parser.add_argument("--out", type=Path, help="JSON file (default bench/results/soak*.json)")
    args, _ = parser.parse_known_args()  # `embcache bench -- ARGS` may pass others through
    if "TRITON_INTERPRET" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"

    cfg = FULL if args.full else CI
    if args.seconds:
        cfg = dataclasses.replace(cfg, seconds=args.seconds)
    reps = args.reps or (20 if args.full else 3)
    size = "full" if args.full else "ci"
    out = args.out or RESULTS_DIR / ("soak.json" if args.full else "soak_ci.json")
    doc: dict[str, Any] = {
        "size": size,
        "commit": git_commit(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    failed = False
    if args.only in (None, "soak"):
        t0 = time.monotonic()
        soak = run_soak(cfg)
        soak["wall_s"] = round(time.monotonic() - t0, 1)
        print(
            figures.table(
                f"soak ({size}: {cfg.producers}+{cfg.consumers} x {cfg.seconds:.0f} s, {cfg.pool})",
                soak,
            ),
            flush=True,
        )
        doc["soak"] = soak
        failed |= bool(soak["violations"])
    if args.only in (None, "faults"):
        t0 = time.monotonic()
        faults = run_faults(reps)
        faults["wall_s"] = round(time.monotonic() - t0, 1)
        print(figures.table(f"faults ({size}: {reps} repetitions)", faults), flush=True)
        doc["faults"] = faults
        failed |= bool(faults["not_reclaimed_within_15s"] or faults["lost"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    print(f"saved {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
