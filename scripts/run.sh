#!/usr/bin/env bash
# Install what is missing, build, and start kvd.
# Usage: scripts/run.sh [kvd flags...]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
kvd_install_missing
kvd_build -DKVD_BUILD_TESTS=OFF -DKVD_BUILD_BENCHMARKS=ON
trace="$KVD_ROOT/../shared/data/mooncake-fast25/conversation_trace.jsonl"
exec "$KVD_BUILD_DIR/tests/bench/kvd_core_replay" --trace="${KVD_TRACE:-$trace}" "$@"
