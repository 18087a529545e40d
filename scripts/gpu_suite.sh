#!/usr/bin/env bash
# The whole GPU suite, for a CUDA machine (the H200 the device tool lends): GPU tests of every
# part, then the GPU benchmarks. Logs and JSON go to $OUT (default bench/results).
#   scripts/gpu_suite.sh [PART ...]   parts: kernels device grpc rest reliability multi
#                                            bench-kernels bench-device bench-colocate
#                                            bench-grpc bench-rest bench-profile
#                                            bench-multi grpc-mps (the gRPC GPU tests as
#                                            clients of an MPS control daemon of their own)
#                                            (default: all; multi and bench-multi only where
#                                            torch sees at least two GPUs)
# .whl/ (not committed) holds cp312 wheels of the dependencies the GPU machine lacks, e.g.
#   pip download --only-binary=:all: --no-deps --python-version 3.12 -d .whl isal grpcio ...
# Nothing is installed system-wide: wheels carried in .whl/ go to a private target directory,
# and embcache is imported from this checkout through a symlink on PYTHONPATH.
# Benchmarks label their results with EMBCACHE_GIT_COMMIT when set: set it to the commit of
# the checkout that was copied (a copied working tree may carry older git metadata).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/bench/results}"
mkdir -p "$OUT"
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
parts=("$@")
if [ ${#parts[@]} -eq 0 ]; then
  parts=(kernels device grpc rest reliability bench-kernels bench-device bench-colocate
    bench-grpc bench-rest)
  gpus="$(python3 -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null)"
  [[ "$gpus" =~ ^[0-9]+$ ]] && [ "$gpus" -ge 2 ] && parts+=(multi bench-multi)
fi
status=0
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv
python3 -c "import torch, triton, grpc, google.protobuf as pb; print('torch', torch.__version__, 'triton', triton.__version__, 'grpc', grpc.__version__, 'protobuf', pb.__version__)"

run_tests() {  # name, pytest args...
  local name="$1"; shift
  python3 -m pytest -m gpu -q -p no:cacheprovider --durations=5 "$@" 2>&1 | tee "$OUT/gpu_$name.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
}
with_mps() {  # "$@" as clients of a private MPS control daemon, quit afterwards
  local dir rc
  dir="$(mktemp -d)"
  mkdir -p "$dir/pipe" "$dir/log"
  export CUDA_MPS_PIPE_DIRECTORY="$dir/pipe" CUDA_MPS_LOG_DIRECTORY="$dir/log"
  nvidia-cuda-mps-control -d || { status=1; unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY; return; }
  "$@"; rc=$?
  echo quit | nvidia-cuda-mps-control
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  rm -rf "$dir"
  return $rc
}
for part in "${parts[@]}"; do
  echo "=== $part"
  case "$part" in
    kernels) run_tests kernels tests/kernels ;;
    device) run_tests device tests/gpu/test_device_engine.py tests/gpu/test_uva_ids.py \
      tests/gpu/test_views_gpu.py ;;
    grpc) [ -e tests/gpu/test_grpc_device.py ] && run_tests grpc tests/gpu/test_grpc_device.py ;;
    grpc-mps) with_mps run_tests grpc_mps tests/gpu/test_grpc_device.py ;;
    rest) run_tests rest tests/transport/test_http_gpu.py $(compgen -G "tests/gpu/test_rest*.py") ;;
    reliability) compgen -G "tests/gpu/test_soak*.py" >/dev/null && run_tests soak tests/gpu/test_soak*.py ;;
    multi) run_tests multi tests/gpu/test_multi_gpu.py ;;
    bench-kernels)
      python3 bench/transfer.py --out-dir "$OUT" 2>&1 | tee "$OUT/bench_transfer.log" || status=1
      python3 bench/page_table.py --out-dir "$OUT" 2>&1 | tee "$OUT/bench_page_table.log" || status=1 ;;
    bench-device)
      python3 bench/get_to_device.py --out-dir "$OUT" 2>&1 | tee "$OUT/bench_get_to_device.log" || status=1 ;;
    bench-colocate)  # starts and quits an MPS control daemon of its own (private pipe dir)
      python3 bench/colocated_gemm.py --out-dir "$OUT" 2>&1 | tee "$OUT/bench_colocated_gemm.log" \
        || status=1 ;;
    bench-grpc)
      python3 bench/grpc_e2e.py --out-dir "$OUT" 2>&1 | tee "$OUT/bench_grpc.log" || status=1 ;;
    bench-multi)
      python3 bench/multi_gpu.py --out-dir "$OUT" 2>&1 | tee "$OUT/bench_multi_gpu.log" || status=1 ;;
    bench-rest)
      [ -e bench/rest_e2e.py ] && { python3 bench/rest_e2e.py --out-dir "$OUT" 2>&1 \
        | tee "$OUT/bench_rest.log" || status=1; } ;;
    bench-profile)  # where a call's time goes, both ends (cProfile), device calls only
      python3 bench/call_profile.py --only device --out-dir "$OUT" 2>&1 \
        | tee "$OUT/bench_call_profile.log" || status=1 ;;
    bench-peers) python3 bench/peers.py --out-dir "$OUT" 2>&1 | tee "$OUT/bench_peers.log" || status=1 ;;
    *) echo "unknown part $part"; status=1 ;;
  esac
done
rm -rf "$pp"
exit $status
