#!/usr/bin/env bash
# Shared set-up for scripts/test.sh and scripts/run.sh: installs what is missing (Debian 12 packages)
# and configures + builds kvd into ${KVD_BUILD_DIR:-build}. Sourced, not run.
set -euo pipefail

KVD_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
KVD_BUILD_DIR="${KVD_BUILD_DIR:-$KVD_ROOT/build}"
KVD_JOBS="${KVD_JOBS:-2}"

kvd_packages=(
  g++ make cmake ninja-build pkg-config
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libspdlog-dev prometheus-cpp-dev catch2 libabsl-dev libxxhash-dev
  libcli11-dev libyaml-cpp-dev libsystemd-dev liblz4-dev libzstd-dev
  libzmq3-dev libmsgpack-cxx-dev libssl-dev libhiredis-dev
)
# Only the tests need these: manifest and unit-file checks, the Python client and router-event
# subscriber, a real redis-server for the shared tier, PyTorch (CPU) for the engine proof, strace
# for the unit's syscall filter, venv/pip/setuptools to install the Python client as users do, and
# debhelper and build-essential (which dpkg-buildpackage requires of every build) to build the
# .deb packages (scripts/build-packages.sh), and pybind11 with the Python headers for kvd._native
# (the C++ step path for Python engines, client/python/native), and ccache, which keeps the test
# run's four builds' objects between clean checkouts (kvd_use_ccache).
kvd_test_packages=(python3 python3-yaml python3-grpcio python3-protobuf systemd strace prometheus clang
                   python3-zmq python3-msgpack python3-cbor2 python3-numpy redis-server python3-torch
                   python3-venv python3-pip python3-setuptools python3-wheel debhelper build-essential
                   iproute2 openssl ucx-utils pybind11-dev python3-dev ccache)
# Commands the deploy checks run (kubectl renders the kustomize overlays; node and npm validate
# them against the API schemas), as "command:Debian package": installed only when the command is
# missing, since a kubectl or node from another repository conflicts with Debian's package.
kvd_test_commands=(kubectl:kubernetes-client node:nodejs npm:npm)

# The Debian packages of those of `command:package` pairs whose command is not on PATH.
kvd_packages_for_missing_commands() {
  local pair
  for pair in "$@"; do
    command -v "${pair%%:*}" >/dev/null 2>&1 || echo "${pair#*:}"
  done
}

kvd_install_missing() {
  local missing=()
  for p in "${kvd_packages[@]}" "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  echo "kvd: installing missing packages: ${missing[*]}"
  local sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
}

# With KVD_CCACHE=1 (scripts/test.sh sets it) and ccache installed, sets kvd_launcher to the CMake
# options that compile through ccache, and exports what lets a clean clone anywhere hit objects
# another clone compiled: paths under the checkout hashed relative to it, and the build directory
# left out of the hash (the objects' DWARF then names the first clone's build directory; nothing
# reads it). The cache is ccache's own (~/.cache/ccache unless CCACHE_DIR says otherwise), outside
# any clone. A production build (scripts/run.sh) never goes through it.
kvd_launcher=()
kvd_use_ccache() {
  kvd_launcher=()
  [ "${KVD_CCACHE:-0}" = 1 ] && command -v ccache >/dev/null 2>&1 || return 0
  export CCACHE_BASEDIR="$KVD_ROOT" CCACHE_NOHASHDIR=true CCACHE_MAXSIZE="${CCACHE_MAXSIZE:-8G}"
  # ccache finds its cache under $HOME; a root without one (a bare chroot) gets one in /var/tmp.
  [ -n "${HOME:-}" ] || [ -n "${XDG_CACHE_HOME:-}" ] || export CCACHE_DIR="${CCACHE_DIR:-/var/tmp/.cache/ccache}"
  local lang
  for lang in C CXX CUDA; do kvd_launcher+=("-DCMAKE_${lang}_COMPILER_LAUNCHER=ccache"); done
}

kvd_build() {
  local extra=("$@")
  local gen=()
  command -v ninja >/dev/null 2>&1 && gen=(-G Ninja)
  # nvcc lives outside PATH on a stock CUDA install.
  if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
    export PATH="/usr/local/cuda/bin:$PATH"
  fi
  if [ -f "$KVD_BUILD_DIR/CMakeCache.txt" ] && ! grep -q "CMAKE_GENERATOR:INTERNAL=${gen[1]:-Unix Makefiles}\$" "$KVD_BUILD_DIR/CMakeCache.txt"; then
    rm -rf "$KVD_BUILD_DIR"
  fi
  kvd_use_ccache
  cmake -S "$KVD_ROOT" -B "$KVD_BUILD_DIR" "${gen[@]}" -DCMAKE_BUILD_TYPE="${KVD_BUILD_TYPE:-RelWithDebInfo}" \
    "${kvd_launcher[@]}" "${extra[@]}"
  # KVD_BUILD_TARGETS (space-separated) builds only those targets.
  local targets=()
  for t in ${KVD_BUILD_TARGETS:-}; do targets+=(--target "$t"); done
  cmake --build "$KVD_BUILD_DIR" -j "$KVD_JOBS" "${targets[@]}"
}
