#!/usr/bin/env bash
# Kernel GPU tests and both benchmarks on a CUDA machine, in one go.
#   scripts/gpu_kernels.sh [tests|bench|all]    (default: all)
# Logs and JSON results go to $OUT (default: bench/results). Needs python3 with torch, triton,
# numpy, pytest, pytest-timeout and hypothesis; embcache is imported from this checkout through
# a symlink on PYTHONPATH, nothing is installed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/bench/results}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# Compile the kernels for the GPU (tests/conftest.py defaults TRITON_INTERPRET to 1 when unset).
export TRITON_INTERPRET=0
pp="$(mktemp -d)"
ln -s "$PWD" "$pp/embcache"
export PYTHONPATH="$pp${PYTHONPATH:+:$PYTHONPATH}"
what="${1:-all}"
status=0

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

if [[ "$what" == "tests" || "$what" == "all" ]]; then
  python3 -m pytest -m gpu tests/kernels -q -p no:cacheprovider --durations=5 2>&1 \
    | tee "$OUT/gpu_tests.log" || status=1
fi
if [[ "$what" == "bench" || "$what" == "all" ]]; then
  python3 bench/transfer.py --out-dir "$OUT" ${TRANSFER_ARGS:-} 2>&1 \
    | tee "$OUT/bench_transfer.log" || status=1
  python3 bench/page_table.py --out-dir "$OUT" 2>&1 | tee "$OUT/bench_page_table.log" || status=1
fi
rm -rf "$pp"
exit $status
