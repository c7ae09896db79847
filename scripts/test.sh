#!/usr/bin/env bash
# The whole test run on a clean checkout: install what is missing, build, run every test.
# With KVD_SANITIZE=1 (as CI runs it), also builds the tests with AddressSanitizer and
# UndefinedBehaviorSanitizer in build-asan/ and runs them there (all but the static and packaging
# checks, labelled nosan, which run no instrumented code and ran in the first pass), then the core, store and events
# tests under ThreadSanitizer against an Abseil built from Debian's source with TSan
# (scripts/tsan.sh, build-tsan/), then runs each libFuzzer target for KVD_FUZZ_SECONDS (default
# 60) over its seed corpus (scripts/fuzz.sh).
# Every build compiles through ccache (KVD_CCACHE=0 turns it off), so a clean checkout on a
# machine that has run this before recompiles only what changed; scripts/setup.sh says how.
# Usage: scripts/test.sh [extra cmake -D options]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
export KVD_CCACHE="${KVD_CCACHE:-1}"
kvd_install_missing "${kvd_test_packages[@]}" $(kvd_packages_for_missing_commands "${kvd_test_commands[@]}")
kvd_build -DKVD_BUILD_TESTS=ON "$@"
(cd "$KVD_BUILD_DIR" && ctest --output-on-failure -j "$KVD_JOBS" --timeout 600)

# The image's runtime stage: its package list against what the binaries link, then kvd serving
# in a bare Debian 12 root with only that list installed. Needs root (debootstrap, chroot).
if [ "$(id -u)" -eq 0 ]; then
  bash "$KVD_ROOT/tests/deploy/image_root_check.sh" "$KVD_BUILD_DIR"
else
  echo "kvd: not root; the image root check is skipped"
fi

# The GPU proof bundle, built here and run in a bare Debian 12 root (it must report the missing
# driver, never a missing library). Needs the CUDA toolkit and root (debootstrap, chroot).
if [ "$(id -u)" -ne 0 ]; then
  echo "kvd: not root; the GPU bundle's minimal-root check is skipped"
elif ! command -v nvcc >/dev/null && [ ! -x /usr/local/cuda/bin/nvcc ]; then
  echo "kvd: no CUDA toolkit; the GPU bundle is not built"
else
  bundle="$(bash "$KVD_ROOT/scripts/gpu-bundle.sh" | tail -1)"
  bash "$KVD_ROOT/tests/gpu/bundle/minimal_root_check.sh" "$bundle"
fi

if [ "${KVD_SANITIZE:-0}" = 1 ]; then
  echo "kvd: sanitizer run (ASan + UBSan)"
  # Debug, at -O0: -O1 ran core_test and store_test 4x faster but integration_test, which bounds
  # this pass, no faster, and took GCC twice as long to compile (3,280 s of CPU against 1,762).
  KVD_BUILD_DIR="$KVD_ROOT/build-asan" KVD_BUILD_TYPE=Debug kvd_build -DKVD_BUILD_TESTS=ON -DKVD_WITH_CUDA=OFF \
    "-DCMAKE_CXX_FLAGS=-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined" \
    "-DCMAKE_EXE_LINKER_FLAGS=-fsanitize=address,undefined" "$@"
  (cd "$KVD_ROOT/build-asan" &&
     ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
     ctest --output-on-failure -j "$KVD_JOBS" --timeout 900 --label-exclude nosan)
fi
if [ "${KVD_SANITIZE:-0}" = 1 ]; then
  bash "$KVD_ROOT/scripts/tsan.sh"
  bash "$KVD_ROOT/scripts/fuzz.sh" "${KVD_FUZZ_SECONDS:-60}"
fi
