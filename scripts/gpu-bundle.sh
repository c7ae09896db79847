#!/usr/bin/env bash
# Builds the GPU proof bundle on a development machine without a GPU: kvd, kvdctl, the example
# worker, the [.gpu] test binary, kvd_cuda_bench, kvd_gpu_probe, the Python client with its
# generated stubs and the stub-free PyTorch check, plus every shared library those binaries need
# that is not part of glibc or the NVIDIA driver (found with ldd; RUNPATH $ORIGIN/lib, set with
# patchelf). The folder has a run.sh (tests/gpu/bundle/run.sh) and stays under 60 MiB; it needs
# nothing but Linux x86-64 with glibc >= 2.36, an NVIDIA driver and, for the Python part, a
# python3 with PyTorch. Prints the folder's path as its last line.
#
# Usage: scripts/gpu-bundle.sh [OUT_DIR]   (default: gpu-bundle/ in the checkout, git-ignored)
# Uses $KVD_BUILD_DIR (default build/) with the CUDA backend, tests and benchmarks enabled; only
# the bundle's targets are built, so after scripts/test.sh this adds the benchmark binary alone.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
out="${1:-$KVD_ROOT/gpu-bundle}"
kvd_install_missing patchelf python3 python3-grpcio python3-protobuf
export PATH="/usr/local/cuda/bin:$PATH"
command -v nvcc >/dev/null || { echo "gpu-bundle: the CUDA toolkit (nvcc) is needed to build the CUDA backend" >&2; exit 1; }

bins=(kvd kvdctl kvd_example_worker kvd_step_worker gpu_cuda_test kvd_cuda_bench kvd_gpu_probe)
KVD_BUILD_TARGETS="${bins[*]} kvd_python" kvd_build -DKVD_WITH_CUDA=ON -DKVD_BUILD_TESTS=ON \
  -DKVD_BUILD_BENCHMARKS=ON >"$KVD_BUILD_DIR.bundle.log" 2>&1 \
  || { tail -40 "$KVD_BUILD_DIR.bundle.log" >&2; echo "gpu-bundle: build failed" >&2; exit 1; }

rm -rf "$out"
mkdir -p "$out/lib" "$out/python"
for b in "${bins[@]}"; do
  src=$(find "$KVD_BUILD_DIR" -name "$b" -type f -perm -u+x -not -path "*/CMakeFiles/*" | head -1)
  [ -n "$src" ] || { echo "gpu-bundle: $b was not built" >&2; exit 1; }
  install -m 0755 "$src" "$out/$b"
done

# Every library ldd resolves, except glibc's own and the NVIDIA driver's (the machine brings
# those). libstdc++ and libgcc_s are carried: they are not part of glibc.
is_system_lib() {
  case "$(basename "$1")" in
    ld-linux*|libc.so.*|libm.so.*|libpthread.so.*|libdl.so.*|librt.so.*|libresolv.so.*|libutil.so.*|\
    libanl.so.*|libnsl.so.*|libmvec.so.*|libBrokenLocale.so.*|libcrypt.so.*) return 0 ;;
    libcuda.so*|libnvidia-*|libnvcuvid*) return 0 ;;
  esac
  return 1
}
for b in "${bins[@]}"; do
  ldd "$out/$b" | awk '/=>/ && $3 ~ /^\// {print $3}' | while read -r lib; do
    is_system_lib "$lib" || cp -Ln "$lib" "$out/lib/" 2>/dev/null || true
  done
done
if grep -q "not found" <(for b in "${bins[@]}"; do ldd "$out/$b"; done); then
  echo "gpu-bundle: a library is missing on this machine:" >&2
  for b in "${bins[@]}"; do ldd "$out/$b" | grep "not found" >&2; done
  exit 1
fi
strip --strip-unneeded "$out"/lib/*.so* "${bins[@]/#/$out/}"
for b in "${bins[@]}"; do patchelf --set-rpath '$ORIGIN/lib' "$out/$b"; done
for l in "$out"/lib/*.so*; do patchelf --set-rpath '$ORIGIN' "$l"; done

# Python: the client with its generated stubs (for machines that have grpcio and protobuf), and
# the stub-free check that run.sh uses (PyTorch and the driver's libcuda only).
cp -r "$KVD_BUILD_DIR/python/kvd" "$out/python/"
# kvd._native (the pybind11 step binding, ~30 MiB with debug info) stays out: it links this
# machine's gRPC and Python, which the device machine does not have, and no bundle step uses it.
rm -f "$out"/python/kvd/_native*.so
cp "$KVD_ROOT/tests/gpu/torch_slab_check.py" "$KVD_ROOT/tests/python/kvd_testlib.py" "$out/python/"
# The hybrid_model step: the reference hybrid model's test, run on the CUDA backend.
cp "$KVD_ROOT/tests/gpu/hybrid_gpu_check.py" "$KVD_ROOT/tests/python/test_hybrid_engine.py" "$out/python/"
install -m 0755 "$KVD_ROOT/tests/gpu/bundle/run.sh" "$out/run.sh"
{
  echo "commit: $(git -C "$KVD_ROOT" rev-parse HEAD 2>/dev/null || echo unknown)"
  echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(. /etc/os-release && echo "$PRETTY_NAME")"
  echo "cuda toolkit: $(nvcc --version | sed -n 's/.*release \([0-9.]*\).*/\1/p')"
  echo "glibc: $(ldd --version | head -1 | awk '{print $NF}')"
} >"$out/BUILD_INFO"

size_kib=$(du -sk "$out" | cut -f1)
if [ "$size_kib" -gt $((60 * 1024)) ]; then
  echo "gpu-bundle: $out is $((size_kib / 1024)) MiB, over the 60 MiB limit" >&2
  exit 1
fi
echo "gpu-bundle: $((size_kib / 1024)) MiB, $(ls "$out/lib" | wc -l) libraries" >&2
echo "$out"
