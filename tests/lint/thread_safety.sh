#!/usr/bin/env bash
# Checks the lock annotations (ABSL_GUARDED_BY, ABSL_EXCLUSIVE_LOCKS_REQUIRED, ...) with clang's
# thread-safety analysis as errors. GCC ignores the annotations; this is what enforces them.
# Usage: thread_safety.sh SOURCE_ROOT BUILD_DIR   (BUILD_DIR holds the generated proto headers)
set -uo pipefail
root="$1"; build="$2"
clang=$(command -v clang++ || command -v clang++-14 || true)
if [ -z "$clang" ]; then
  # A missing clang must not pass silently: scripts/test.sh installs it.
  echo "thread-safety analysis: clang++ is not installed (apt-get install clang)" >&2
  exit 1
fi
cd "$root"
files=$(ls server/core/*.cc server/store/*.cc server/events/*.cc server/rpc/*.cc server/obs/*.cc server/daemon.cc client/client.cc client/client_calls.cc client/client_step.cc gpu/*.cc | grep -v cuda_)
failed=0
for f in $files; do
  if ! "$clang" -std=c++20 -fsyntax-only -Wthread-safety -Werror=thread-safety -I. -I"$build/proto" \
       -DKVD_HAVE_CUDA=0 -DKVD_VERSION='"check"' "$f"; then
    failed=$((failed + 1))
  fi
done
echo "thread-safety analysis: $(echo "$files" | wc -w) files, $failed failed"
[ "$failed" -eq 0 ]
