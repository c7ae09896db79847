#!/usr/bin/env bash
# Builds the libFuzzer targets with clang in build-fuzz/ and runs each for a bounded time over its
# seed corpus in tests/fuzz/corpus/ (new inputs go to a scratch copy; crashes are saved in
# build-fuzz/crashes/ and fail the run). A crash found becomes a regression test: copy the input
# into tests/fuzz/corpus/<target>/ and fix the bug; every corpus input is replayed on each run.
# Usage: scripts/fuzz.sh [seconds per target, default 60]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
seconds="${1:-60}"
if ! command -v clang++ >/dev/null 2>&1; then
  echo "kvd: clang++ not installed: fuzzing skipped"
  exit 0
fi
build="$root/build-fuzz"
gen=()
command -v ninja >/dev/null 2>&1 && gen=(-G Ninja)
CC=clang CXX=clang++ cmake -S "$root" -B "$build" "${gen[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DKVD_FUZZ=ON -DKVD_BUILD_TESTS=OFF -DKVD_WITH_CUDA=OFF >/dev/null
cmake --build "$build" -j "${KVD_JOBS:-2}" --target kvd_fuzz_core_ops kvd_fuzz_store_decode kvd_fuzz_service kvd_fuzz_remote_value
mkdir -p "$build/crashes"
for target in core_ops store_decode service remote_value; do
  work="$build/corpus-$target"
  rm -rf "$work" && mkdir -p "$work"
  cp "$root/tests/fuzz/corpus/$target/"* "$work/" 2>/dev/null || true
  echo "kvd: fuzzing $target for ${seconds}s"
  # The service target keeps a daemon (and gRPC's threads) across inputs: leak checks are per
  # process there, not per input.
  leaks=1
  [ "$target" = service ] && leaks=0
  ASAN_OPTIONS=detect_leaks=$leaks "$build/tests/fuzz/kvd_fuzz_$target" -max_total_time="$seconds" \
    -detect_leaks=$leaks -max_len=4096 -artifact_prefix="$build/crashes/$target-" -print_final_stats=1 \
    "$work" "$root/tests/fuzz/corpus/$target" 2>&1 | grep -E "^#[0-9]+ *DONE|stat::number_of_executed_units|==ERROR|SUMMARY|Done" || true
  if ls "$build/crashes/$target-"* >/dev/null 2>&1; then
    echo "kvd: $target found a crash: $(ls "$build/crashes/$target-"*)"
    exit 1
  fi
done
