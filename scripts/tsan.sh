#!/usr/bin/env bash
# ThreadSanitizer pass (run by scripts/test.sh with KVD_SANITIZE=1, as CI does).
#
# Debian's Abseil is not built with TSan, so absl::Mutex hand-offs would be invisible to it and
# every guarded access would be reported as a race. This script builds Abseil from Debian's own
# source package (the version installed, with Debian's patches) with -fsanitize=thread into
# ~/.cache/kvd/absl-tsan-VERSION (KVD_CACHE_DIR overrides ~/.cache/kvd): a side build kept outside
# the checkout, so a clean clone reuses it. Then builds kvd's core, store and events libraries and
# their tests against it, instrumented (through ccache when scripts/test.sh runs it), in
# build-tsan/, and runs them.
#
# The gRPC layer stays out: Debian's gRPC and protobuf link Debian's uninstrumented Abseil, and two
# Abseils cannot share one binary. The RPC layer's races are covered by clang's thread-safety
# analysis, ASan/UBSan over the multi-threaded integration tests and the service fuzzer.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"

tsan_dir="$KVD_ROOT/build-tsan"
flags="-fsanitize=thread -g -O1"
sudo=""
[ "$(id -u)" -ne 0 ] && sudo="sudo"

version=$(dpkg-query -W -f='${Version}' libabsl-dev)
cache_dir="${KVD_CACHE_DIR:-${XDG_CACHE_HOME:-${HOME:-/var/tmp}/.cache}/kvd}"
absl_prefix="$cache_dir/absl-tsan-$version"
stamp="$version $flags"
if [ "$(cat "$absl_prefix/.version" 2>/dev/null)" != "$stamp" ]; then
  echo "kvd: building Abseil $version with ThreadSanitizer (once; cached in $absl_prefix)"
  kvd_install_missing dpkg-dev
  if ! apt-get source --print-uris "abseil=$version" >/dev/null 2>&1; then
    # Debian's source archive, next to the binary one this machine already uses.
    printf 'Types: deb-src\nURIs: http://deb.debian.org/debian\nSuites: bookworm bookworm-updates\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' |
      $sudo tee /etc/apt/sources.list.d/kvd-deb-src.sources >/dev/null
    $sudo apt-get update -qq
  fi
  rm -rf "$tsan_dir/absl-src" "$tsan_dir/absl-build" "$absl_prefix"
  mkdir -p "$cache_dir"
  mkdir -p "$tsan_dir/absl-src"
  (cd "$tsan_dir/absl-src" && apt-get source -qq "abseil=$version" >/dev/null)
  src=$(find "$tsan_dir/absl-src" -mindepth 1 -maxdepth 1 -type d -name 'abseil-*' | head -n 1)
  cmake -S "$src" -B "$tsan_dir/absl-build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    "-DCMAKE_CXX_FLAGS=$flags" "-DCMAKE_C_FLAGS=$flags" -DCMAKE_CXX_STANDARD=20 \
    -DABSL_PROPAGATE_CXX_STD=ON -DBUILD_TESTING=OFF -DABSL_BUILD_TESTING=OFF \
    -DCMAKE_POSITION_INDEPENDENT_CODE=ON "-DCMAKE_INSTALL_PREFIX=$absl_prefix" >/dev/null
  cmake --build "$tsan_dir/absl-build" -j "$KVD_JOBS"
  cmake --install "$tsan_dir/absl-build" >/dev/null
  echo "$stamp" > "$absl_prefix/.version"
fi

echo "kvd: ThreadSanitizer run (core, store, events)"
kvd_use_ccache
cmake -S "$KVD_ROOT" -B "$tsan_dir/kvd" -G Ninja -DCMAKE_BUILD_TYPE=Debug -DKVD_BUILD_TESTS=ON "${kvd_launcher[@]}" \
  -DKVD_WITH_CUDA=OFF "-DCMAKE_PREFIX_PATH=$absl_prefix" "-Dabsl_DIR=$absl_prefix/lib/cmake/absl" \
  "-DCMAKE_CXX_FLAGS=$flags" "-DCMAKE_EXE_LINKER_FLAGS=-fsanitize=thread" >/dev/null
cmake --build "$tsan_dir/kvd" -j "$KVD_JOBS" --target core_test store_test events_test
(cd "$tsan_dir/kvd" &&
   TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 suppressions=$KVD_ROOT/tests/tsan.supp" \
   ctest --output-on-failure -j "$KVD_JOBS" --timeout 1200 -R '^(core_test|store_test|events_test)$')
