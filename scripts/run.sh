#!/usr/bin/env bash
# Install what is missing, build, and start kvd on host memory. Without --config it serves two
# pools: "default" (what the example workers and README use) and "tiny-engine" (the reference
# engine, python3 -m kvd.engine.worker).
# Usage: scripts/run.sh [kvd flags...]     e.g. scripts/run.sh --config deploy/kvd.example.yaml
# An existing build (a test build too) is brought up to date as it is configured, never reconfigured.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
kvd_install_missing
if [ -f "$KVD_BUILD_DIR/CMakeCache.txt" ] && [ -x "$KVD_BUILD_DIR/server/kvd" ]; then
  cmake --build "$KVD_BUILD_DIR" -j "$KVD_JOBS" --target kvd kvdctl kvd_example_worker
else
  kvd_build -DKVD_BUILD_TESTS=OFF
fi
b="${KVD_BUILD_DIR#"$PWD"/}"
cat <<MSG
kvd: starting. From another shell in $PWD (workers, kvdctl and the Python client find kvd's
default socket by themselves; with --listen, export KVD_TARGET=<that address> first):
  $b/client/kvd_example_worker --id=r1 --prompt-range=0:100 --gen=20
  $b/client/kvd_example_worker --id=r2 --prompt-range=0:100 --gen=20   # "cached_tokens":96: r1's prefix
  $b/server/kvdctl status
Stop with Ctrl-C (SIGINT) or SIGTERM: kvd drains and exits 0.
MSG
exec "$KVD_BUILD_DIR/server/kvd" "$@"
