#!/usr/bin/env bash
# Idempotent set-up: a virtual environment in .venv with embcache and everything it needs.
# Sourced by scripts/serve.sh and scripts/test.sh; safe to run again at any time.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
STAMP=.venv/.embcache-installed
if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ] || [ setup.py -nt "$STAMP" ]; then
    python -m pip install -q --upgrade pip setuptools wheel
    # The CPU build of torch is pinned: an unpinned torch pulls a multi-GB CUDA build.
    python -m pip install -q "torch==2.13.0" "triton==3.7.1" numpy
    python -m pip install -q -e ".[dev]"
    touch "$STAMP"
fi
