#!/usr/bin/env bash
# Idempotent set-up: a virtual environment in .venv with embcache and everything it needs.
# Sourced by scripts/serve.sh and scripts/test.sh; safe to run again at any time.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    echo "embcache: first run: creating .venv and installing embcache with the CPU build of" \
        "torch, triton, gRPC, FastAPI and the test tools (about 2 GB; 3-10 minutes)." >&2
    "$PY" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
STAMP=.venv/.embcache-installed
if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ] || [ setup.py -nt "$STAMP" ]; then
    echo "embcache: installing what is missing into .venv (pip; minutes on a first run)" >&2
    python -m pip install -q --upgrade pip setuptools wheel
    # The CPU build of torch is pinned: an unpinned torch pulls a multi-GB CUDA build.
    python -m pip install -q "torch==2.13.0" "triton==3.7.1" numpy
    python -m pip install -q -e ".[dev]"
    touch "$STAMP"
fi
