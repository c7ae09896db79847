#!/usr/bin/env bash
# Builds the libFuzzer targets with clang in build-fuzz/ and runs each for a bounded time over its
# seed corpus in tests/fuzz/corpus/ (new inputs go to a scratch copy; crashes are saved in
# build-fuzz/crashes/ and fail the run). A crash found becomes a regression test: copy the input
# into tests/fuzz/corpus/<target>/ and fix the bug; every corpus input is replayed on each run.
# The targets run KVD_JOBS (default 2) at a time, each for its seconds of wall time in one
# process. Compiles through ccache when scripts/test.sh runs it (KVD_CCACHE=1).
# Usage: scripts/fuzz.sh [seconds per target, default 60]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
root="$KVD_ROOT"
seconds="${1:-60}"
if ! command -v clang++ >/dev/null 2>&1; then
  echo "kvd: clang++ not installed: fuzzing skipped"
  exit 0
fi
build="$root/build-fuzz"
gen=()
command -v ninja >/dev/null 2>&1 && gen=(-G Ninja)
kvd_use_ccache
CC=clang CXX=clang++ cmake -S "$root" -B "$build" "${gen[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DKVD_FUZZ=ON -DKVD_BUILD_TESTS=OFF -DKVD_WITH_CUDA=OFF "${kvd_launcher[@]}" >/dev/null
targets=(core_ops store_decode service remote_value)
build_targets=()
for target in "${targets[@]}"; do build_targets+=(--target "kvd_fuzz_$target"); done
cmake --build "$build" -j "$KVD_JOBS" "${build_targets[@]}"
rm -rf "$build/crashes" && mkdir -p "$build/crashes"

# fuzz_one TARGET: one target's run, its summary lines in build-fuzz/fuzz-TARGET.log.
fuzz_one() {
  local target="$1" work="$build/corpus-$1"
  rm -rf "$work" && mkdir -p "$work"
  cp "$root/tests/fuzz/corpus/$target/"* "$work/" 2>/dev/null || true
  # The service target keeps a daemon (and gRPC's threads) across inputs: leak checks are per
  # process there, not per input.
  local leaks=1
  [ "$target" = service ] && leaks=0
  ASAN_OPTIONS=detect_leaks=$leaks "$build/tests/fuzz/kvd_fuzz_$target" -max_total_time="$seconds" \
    -detect_leaks=$leaks -max_len=4096 -artifact_prefix="$build/crashes/$target-" -print_final_stats=1 \
    "$work" "$root/tests/fuzz/corpus/$target" >"$build/fuzz-$target.log" 2>&1 || true
}

for ((i = 0; i < ${#targets[@]}; i += KVD_JOBS)); do
  batch=("${targets[@]:i:KVD_JOBS}")
  echo "kvd: fuzzing ${batch[*]} for ${seconds}s each, side by side"
  for target in "${batch[@]}"; do fuzz_one "$target" & done
  wait
done
failed=0
for target in "${targets[@]}"; do
  echo "kvd: $target:"
  grep -E "^#[0-9]+ *DONE|stat::number_of_executed_units|==ERROR|SUMMARY|Done" "$build/fuzz-$target.log" || true
  if ls "$build/crashes/$target-"* >/dev/null 2>&1; then
    echo "kvd: $target found a crash: $(ls "$build/crashes/$target-"*)"
    failed=1
  fi
done
exit "$failed"
