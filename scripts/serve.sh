#!/usr/bin/env bash
# Quickstart command 1: install what is missing, then run the daemon with embedded defaults
# (CPU mode on a machine without a GPU). Extra arguments go to `embcache serve`.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
exec embcache serve "$@"
