#!/usr/bin/env bash
# The whole test run on a clean checkout: install what is missing, build, run every test.
# Usage: scripts/test.sh [extra cmake -D options]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
kvd_install_missing "${kvd_test_packages[@]}"
kvd_build -DKVD_BUILD_TESTS=ON "$@"
cd "$KVD_BUILD_DIR"
ctest --output-on-failure -j "$KVD_JOBS" --timeout 600
