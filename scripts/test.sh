#!/usr/bin/env bash
# Quickstart command 2 (and CI): install what is missing, then run the whole CPU test suite.
# GPU tests are marked `gpu` and skip themselves where no GPU is present.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
. "$(dirname "${BASH_SOURCE[0]}")/install_engines.sh"  # vLLM and SGLang, CPU torch kept
export TRITON_INTERPRET=1   # Triton kernels run on CPU tensors; must be set before any @triton.jit
# System packages some tests need (each test skips with a reason where one is missing):
# chromium (pool-map page, /docs), redis-server (shared tier), libibverbs1 (Mooncake's
# libraries), prometheus (its promtool checks the alert rules). As root with apt-get, the
# script installs the missing ones itself, saying so first; otherwise their tests skip.
need=()
command -v chromium >/dev/null 2>&1 || need+=(chromium)
command -v promtool >/dev/null 2>&1 || need+=(prometheus)
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
ldconfig -p 2>/dev/null | grep -q libibverbs.so.1 || need+=(libibverbs1)
if [ ${#need[@]} -gt 0 ] && [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null; then
    echo "scripts/test.sh: running as root, so installing system packages with apt-get: ${need[*]}" >&2
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" \
        >/dev/null) || echo "warning: could not install ${need[*]}; their tests will skip" >&2
fi
ruff check .
ruff format --check .
# clients/_sync is generated from clients/_async: fail when it was edited or not regenerated.
python scripts/unasync.py --check
# mypy checks the packages by their import names: _gen/embcache links to the repository root.
mkdir -p _gen && ln -sfn .. _gen/embcache
MYPYPATH=_gen mypy -p embcache.service -p embcache.clients -p embcache.kernels -p embcache.proto -p embcache.integrations -m embcache.errors -m embcache.build_info
# The layers (pyproject.toml, [tool.importlinter]); tests/unit/test_import_graph.py finds cycles.
lint-imports
set +e
python -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "error: pytest collected no tests" >&2
    exit 1
fi
exit "$rc"
