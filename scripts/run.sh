#!/usr/bin/env bash
# Install what is missing, build, and start kvd on host memory with its default pool.
# Usage: scripts/run.sh [kvd flags...]     e.g. scripts/run.sh --config deploy/kvd.example.yaml
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
kvd_install_missing
kvd_build -DKVD_BUILD_TESTS=OFF
if [ "$(id -u)" -eq 0 ]; then sock=/run/kvd/kvd.sock
elif [ -n "${XDG_RUNTIME_DIR:-}" ]; then sock="$XDG_RUNTIME_DIR/kvd/kvd.sock"
else sock="/tmp/kvd-$(id -u)/kvd.sock"; fi
cat <<MSG
kvd: starting. Try a worker from another shell:
  $KVD_BUILD_DIR/client/kvd_example_worker --target=unix://$sock --id=r1 --prompt-range=0:100 --gen=20
  $KVD_BUILD_DIR/client/kvd_example_worker --target=unix://$sock --id=r2 --prompt-range=0:100 --gen=20   # reuses r1's prefix
Stop with Ctrl-C (SIGINT) or SIGTERM: kvd drains and exits 0.
MSG
exec "$KVD_BUILD_DIR/server/kvd" "$@"
