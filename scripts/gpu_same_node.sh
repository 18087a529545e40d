#!/usr/bin/env bash
# The same-node data plane on a CUDA machine: its GPU tests, then its benchmarks (the first
# gets after connect, device-resident hits from the read table, the vLLM connector next to
# ECExampleConnector). Logs and JSON go to $OUT (default bench/results). Each part is bounded.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/bench/results}"
mkdir -p "$OUT"
S=scripts/gpu_env.sh
status=0
timeout 240 $S python3 -m pytest -m gpu -q -p no:cacheprovider --durations=5 \
  tests/gpu/test_table_cuda.py tests/gpu/test_client_table_gpu.py tests/gpu/test_table_device.py \
  >"$OUT/gpu_same_node.log" 2>&1 || status=1
tail -25 "$OUT/gpu_same_node.log"
timeout 60 $S python3 bench/first_get.py --out-dir "$OUT" 2>&1 | tail -12
timeout 60 $S python3 bench/table_device.py --out-dir "$OUT" 2>&1 | tail -14
if [ -d .whl/engines ]; then
  site=/tmp/embcache-engines
  mkdir -p "$site"
  tar -xzf .whl/engines/vllm-pure.tar.gz -C "$site" &&
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" \
      .whl/engines/wheels/*.whl
  [ -e "$site/vllm/_C_stable_libtorch.py" ] || : >"$site/vllm/_C_stable_libtorch.py"
  PYTHONPATH="$site" VLLM_TARGET_DEVICE=cpu timeout 180 $S python3 bench/vllm_connector.py \
    --out-dir "$OUT" >"$OUT/vllm_connector.log" 2>&1 || status=1
  tail -22 "$OUT/vllm_connector.log"
fi
exit "$status"
