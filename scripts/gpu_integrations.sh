#!/usr/bin/env bash
# On the GPU machine: the vLLM integration GPU test and bench/vllm_connector.py, with vLLM
# carried as pure Python (scripts/carry_vllm.sh builds .whl/engines/). Output under $OUT.
# .whl/ and .whl/engines/ together pass the device tool's 64 MiB carry: run gpu_suite.sh
# first (it installs .whl/*.whl into /tmp/embcache-site, which this script reuses), then,
# on the still-warm machine, this script carrying .whl/engines alone.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/bench/results}"
mkdir -p "$OUT"
site=/tmp/embcache-engines
mkdir -p "$site"
tar -xzf .whl/engines/vllm-pure.tar.gz -C "$site" || exit 1
# The pure-Python vLLM carried here has no compiled extensions (none is built for this
# machine's torch); its CUDA platform imports this one first. An empty module stands in: the
# connector uses none of vLLM's kernels, only its classes.
[ -e "$site/vllm/_C_stable_libtorch.py" ] || : >"$site/vllm/_C_stable_libtorch.py"
python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" \
    .whl/engines/wheels/*.whl || exit 1
if compgen -G ".whl/*.whl" >/dev/null; then  # embcache's own dependencies, as gpu_suite.sh
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/embcache-site \
    .whl/*.whl || exit 1
fi
pp="$(mktemp -d)"
ln -s "$PWD" "$pp/embcache"
mkdir -p "$pp/bin"
printf '#!/bin/sh\nexec python3 -m embcache.service.cli "$@"\n' >"$pp/bin/embcache"
chmod +x "$pp/bin/embcache"
export PYTHONPATH="$pp:/tmp/embcache-site:$site${PYTHONPATH:+:$PYTHONPATH}" PATH="$pp/bin:$PATH"
# vLLM's CUDA platform needs its compiled extensions (flash attention) to inspect a model:
# its classes run under its CPU platform here, while the connector's tensors are CUDA.
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 VLLM_TARGET_DEVICE=cpu
status=0
python3 -m pytest -m gpu -p no:cacheprovider -q -s tests/gpu/test_integrations_gpu.py \
    2>&1 | tee "$OUT/integrations_gpu.log" || status=1
python3 bench/vllm_connector.py --out-dir "$OUT" 2>&1 | tee "$OUT/vllm_connector.log" || status=1
exit "$status"
