#!/usr/bin/env bash
# Run one command on a CUDA machine with embcache importable from this checkout, as
# scripts/gpu_suite.sh sets it up (wheels carried in .whl/ go to a private target directory):
#   scripts/gpu_env.sh python3 -m pytest -m gpu tests/gpu/test_client_table_gpu.py
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/embcache-site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/embcache-site${PYTHONPATH:+:$PYTHONPATH}"
fi
pp="$(mktemp -d)"
ln -s "$PWD" "$pp/embcache"
mkdir -p "$pp/bin"
printf '#!/bin/sh\nexec python3 -m embcache.service.cli "$@"\n' >"$pp/bin/embcache"
chmod +x "$pp/bin/embcache"
export PYTHONPATH="$pp:$PYTHONPATH" PATH="$pp/bin:$PATH"
exec "$@"
