#!/usr/bin/env bash
# Builds what the GPU machine (Python 3.12, no package index) needs for the vLLM
# integration test and benchmark, into .whl/engines/ (git-ignored, carried by the device
# tool): vLLM's pure-Python files as a tarball (no compiled extensions: the EC connector
# interface imports without them) and cp312 wheels of the small packages that interface
# imports (scripts/install_engines.sh lists them). Run here, with the package index.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VLLM_VERSION="${VLLM_VERSION:-0.34.0}"  # VLLM_VERSION=0.33.0 for the older one
DEST=.whl/engines
rm -rf "$DEST" && mkdir -p "$DEST/wheels"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps -d "$work" "vllm==$VLLM_VERSION"
python3 -m zipfile -e "$work"/vllm-*.whl "$work/tree"
# Python sources, small package data (json, jinja, yaml) and the dist-info; no compiled
# extensions, no kernel sources, no tuned-kernel tables.
(cd "$work/tree" && find vllm "vllm-$VLLM_VERSION.dist-info" -type f \
    \( -name '*.py' -o -path '*.dist-info/*' -o \( -size -64k ! -name '*.so' \
    ! -name '*.cu' ! -name '*.cuh' ! -path '*/configs/*' \) \) \
    ! -path '*/__pycache__/*' -print0 |
    tar --null -czf "$ROOT/$DEST/vllm-pure.tar.gz" -T -)
# The GPU machine already has torch, triton, numpy, safetensors, pydantic, protobuf and
# embcache's own wheels (.whl/); these are what vLLM's EC interface adds.
deps=(transformers==5.19.0 tokenizers==0.23.3 huggingface_hub==2.4.0 pyzmq==27.3.0
    regex==2026.11.19 cbor2==6.3.0 openai==3.57.0 openai-harmony==0.0.8 pybase64==1.5.1
    cachetools==8.0.2 msgspec==0.23.0 cloudpickle==3.1.3 py-cpuinfo==9.0.0 einops==0.8.2
    partial-json-parser==0.2.1.1.post7 "llguidance>=1.7.0,<1.8.0" xgrammar==0.2.8
    pillow==13.0.0 jiter distro sniffio anyio tqdm filelock fsspec pyyaml packaging
    # found missing on the H200 (huggingface_hub 2.4 imports httpx2; xgrammar imports tvm_ffi)
    httpx2 httpcore2 truststore apache-tvm-ffi)
python3 -m pip download -q --only-binary=:all: --no-deps --python-version 3.12 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_31_x86_64 \
    --platform manylinux_2_34_x86_64 -d "$DEST/wheels" "${deps[@]}"
du -sh "$DEST" "$DEST"/* | sed 's/^/carry: /'
