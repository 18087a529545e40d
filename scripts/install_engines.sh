#!/usr/bin/env bash
# Idempotent: vLLM and SGLang for the integration tests (tests/integrations/), on the CPU.
# Sourced by scripts/test.sh after bootstrap.sh (the venv is active); safe to run again.
#
# Both engines are installed without their dependencies: their full dependency sets pull a
# CUDA build of torch and gigabytes of GPU libraries. What their EC connector / embedding
# store interfaces import on the CPU is listed below, pinned (the versions each engine's
# own metadata accepts), and installed under a constraint that keeps the CPU torch. The
# run fails loudly if torch has become a CUDA build anyway.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VLLM_VERSION=0.34.0
# The connector supports vLLM 0.33 and 0.34 (pyproject's [vllm] range); the other version
# sits beside the venv's, as pure files for PYTHONPATH, and
# tests/integrations/test_vllm_versions.py runs the vLLM tests against it in a subprocess.
VLLM_OTHER_VERSION=0.33.0
VLLM_OTHER_DIR="$ROOT/.venv/vllm-$VLLM_OTHER_VERSION"
SGLANG_VERSION=0.5.23
# Imported by vLLM's config, EC connector, scheduler-output and request modules on the CPU,
# and by SGLang's embedding store and plugin loader.
ENGINE_DEPS=(
    "transformers==5.19.0"
    "xgrammar==0.2.8"
    "llguidance>=1.7.0,<1.8.0"
    "pyzmq==27.3.0"
    "regex==2026.11.19"
    "cbor2==6.3.0"
    "openai==3.57.0"
    "openai-harmony==0.0.8"
    "pillow==13.0.0"
    "pybase64==1.5.1"
    "cachetools==8.0.2"
    "msgspec==0.23.0"
    "cloudpickle==3.1.3"
    "py-cpuinfo==9.0.0"
    "partial-json-parser==0.2.1.1.post7"
    "einops==0.8.2"
    "orjson==3.13.0"
    "ipython==9.18.1"
)
STAMP=.venv/.embcache-engines-installed
WANT="vllm==$VLLM_VERSION vllm-other==$VLLM_OTHER_VERSION sglang==$SGLANG_VERSION ${ENGINE_DEPS[*]}"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
    torch_pin="$(python -c 'import torch; print(torch.__version__.split("+")[0])')"
    constraints="$(mktemp)"
    trap 'rm -f "$constraints"' EXIT
    printf 'torch==%s\n' "$torch_pin" >"$constraints"
    python -m pip install -q -c "$constraints" "${ENGINE_DEPS[@]}"
    python -m pip install -q --no-deps "vllm==$VLLM_VERSION" "sglang==$SGLANG_VERSION"
    rm -rf "$VLLM_OTHER_DIR"
    python -m pip install -q --no-deps --target "$VLLM_OTHER_DIR" "vllm==$VLLM_OTHER_VERSION"
    printf '%s' "$WANT" >"$STAMP"
fi
if ! python -c 'import sys, torch; sys.exit(torch.version.cuda is not None)'; then
    echo "error: the engine install replaced the CPU torch with a CUDA build" \
        "($(python -c 'import torch; print(torch.__version__)')); remove .venv and rerun" >&2
    rm -f "$STAMP"
    exit 1
fi
export EMBCACHE_VLLM_OTHER="$VLLM_OTHER_DIR"
