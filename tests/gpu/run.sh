#!/usr/bin/env bash
# The one command that proves the CUDA path on a machine with a GPU: builds kvd with the CUDA
# backend, tests and benchmarks, runs the [.gpu] tests and the CUDA benchmark, and prints a short
# summary. Takes a few minutes (the build dominates). Usage: tests/gpu/run.sh [build-dir]
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
export KVD_BUILD_DIR="${1:-$root/build-gpu}"
export KVD_JOBS="${KVD_JOBS:-$(nproc)}"
source "$root/scripts/setup.sh"
kvd_install_missing
nvidia-smi -L || echo "nvidia-smi not found"
kvd_build -DKVD_WITH_CUDA=ON -DKVD_BUILD_TESTS=ON -DKVD_BUILD_BENCHMARKS=ON >"$KVD_BUILD_DIR.log" 2>&1 \
  || { tail -40 "$KVD_BUILD_DIR.log"; echo "SUMMARY: build failed"; exit 1; }
"$KVD_BUILD_DIR/tests/gpu/gpu_cuda_test" "[.gpu]" --success --reporter compact 2>&1 | tail -40
gpu_rc=${PIPESTATUS[0]}
"$KVD_BUILD_DIR/tests/bench/kvd_cuda_bench" --max-gib="${KVD_IPC_MAX_GIB:-16}" 2>&1
bench_rc=$?
cudart=$(ls /usr/local/cuda/lib64/libcudart.so* /usr/lib/x86_64-linux-gnu/libcudart.so* 2>/dev/null | head -1)
KVD_CUDART="$cudart" PYTHONPATH="$KVD_BUILD_DIR/python" /usr/bin/python3 "$root/tests/gpu/test_python_cuda.py" \
  "$KVD_BUILD_DIR/server/kvd" "$(find "$KVD_BUILD_DIR" -name kvd_example_worker -type f | head -1)" 2>&1 | tail -20
py_rc=${PIPESTATUS[0]}
echo "SUMMARY: gpu tests rc=$gpu_rc, cuda bench rc=$bench_rc, python cuda rc=$py_rc"
[ "$gpu_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ] && [ "$py_rc" -eq 0 ]
