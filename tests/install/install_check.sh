#!/usr/bin/env bash
# `cmake --install` as an operator and an engine developer use it: installs BUILD_DIR into a
# temporary prefix, checks what is there (binaries, the unit naming the prefix's kvd, headers,
# the CMake package, the pkg-config file), builds tests/install/consumer out of tree twice —
# with find_package(kvd) and with pkg-config — starts the installed kvd and runs both workers:
# the second reuses the first's published blocks and verifies their bytes.
# Usage: tests/install/install_check.sh BUILD_DIR
set -euo pipefail
build="$(cd "${1:?usage: install_check.sh BUILD_DIR}" && pwd)"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
tmp="$(mktemp -d /tmp/kvd-install.XXXXXX)"
kvd_pid=
cleanup() { [ -n "$kvd_pid" ] && kill "$kvd_pid" 2>/dev/null; wait 2>/dev/null || true; rm -rf "$tmp"; }
trap cleanup EXIT
fail() { echo "install_check: FAIL: $*" >&2; exit 1; }
source "$here/consumer_build.sh"
prefix="$tmp/prefix"

cmake --install "$build" --prefix "$prefix" >"$tmp/install.log" || { cat "$tmp/install.log" >&2; fail "cmake --install"; }
for f in bin/kvd bin/kvdctl lib/systemd/system/kvd.service include/kvd/client/client.h include/kvd/client/kv_request.h include/kvd/client/step.h \
         include/kvd/proto/vocab/default_paths.h share/doc/kvd/kvd.example.yaml; do
  [ -e "$prefix/$f" ] || fail "$f is not installed"
done
libdir=$(find "$prefix" -name libkvd_client.a -printf '%h\n' | head -1)
[ -n "$libdir" ] || fail "libkvd_client.a is not installed"
[ -f "$libdir/cmake/kvd/kvdConfig.cmake" ] || fail "no CMake package under $libdir/cmake/kvd"
[ -f "$libdir/pkgconfig/kvd-client.pc" ] || fail "no pkg-config file under $libdir/pkgconfig"
grep -q "^ExecStart=$prefix/bin/kvd " "$prefix/lib/systemd/system/kvd.service" \
  || fail "the installed unit does not run $prefix/bin/kvd: $(grep ExecStart "$prefix/lib/systemd/system/kvd.service")"
! grep -rq "$(cd "$here/../.." && pwd)" "$libdir/cmake/kvd" "$libdir/pkgconfig" \
  || fail "the installed package names the source tree"

consumer_cmake "$build" "$prefix" "$tmp/consumer-cmake" "$tmp/consumer.log" \
  || { tail -30 "$tmp/consumer.log" >&2; fail "find_package(kvd) and kvd::client in an out-of-tree project"; }
consumer_pkg_config "$build" "$libdir/pkgconfig" "$tmp/consumer-pc" "$tmp/pc.log" \
  || { tail -30 "$tmp/pc.log" >&2; fail "building with pkg-config --static kvd-client"; }

sock="$tmp/kvd.sock"
"$prefix/bin/kvd" --listen="unix://$sock" --metrics-listen=off --ready-file="$tmp/ready" >"$tmp/kvd.log" 2>&1 &
kvd_pid=$!
for _ in $(seq 1 600); do [ -f "$tmp/ready" ] && break; kill -0 "$kvd_pid" 2>/dev/null || break; sleep 0.1; done
[ -f "$tmp/ready" ] || { cat "$tmp/kvd.log" >&2; fail "the installed kvd did not start"; }
first=$("$tmp/consumer-cmake/consumer_worker" "unix://$sock" first) || fail "the find_package worker: $first"
[ "$first" = "cached=0 verified=0" ] || fail "the first worker reports $first"
second=$("$tmp/consumer-pc" "unix://$sock" second) || fail "the pkg-config worker: $second"
[[ "$second" == cached=32\ verified=* ]] || fail "the second worker did not reuse the first's 2 blocks: $second"
"$prefix/bin/kvdctl" --target="unix://$sock" health >/dev/null || fail "the installed kvdctl"
kill -TERM "$kvd_pid"; wait "$kvd_pid" || fail "kvd did not exit 0 on SIGTERM"; kvd_pid=
echo "install_check: ok (installed to a prefix; find_package(kvd) and pkg-config workers built out of tree; $second)"
