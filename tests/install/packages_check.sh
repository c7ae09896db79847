#!/usr/bin/env bash
# The Debian packages and the wheel (scripts/build-packages.sh) built from BUILD_DIR, and what is
# in them: kvd holds the daemon, kvdctl, the example worker, a unit that runs /usr/bin/kvd and is
# enabled on install, /etc/kvd/kvd.yaml as a conffile, and a postinst that makes the kvd user;
# libkvd-dev's CMake package builds tests/install/consumer from the unpacked package (relocated:
# it must not name where it was built); python3-kvd and the wheel hold the whole Python client,
# and the wheel installs into a virtual environment and imports. tests/deploy/image_root_check.sh
# installs the packages into a bare Debian 12 root and runs them (as root).
# Usage: tests/install/packages_check.sh BUILD_DIR
set -euo pipefail
# Listings are piped into a grep that reads them whole (>/dev/null, never -q): under pipefail a
# grep -q that exits at its first match breaks the pipe of a listing still being written.
build="$(cd "${1:?usage: packages_check.sh BUILD_DIR}" && pwd)"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
tmp="$(mktemp -d /tmp/kvd-packages-check.XXXXXX)"
trap 'rm -rf "$tmp"' EXIT
fail() { echo "packages_check: FAIL: $*" >&2; exit 1; }
source "$here/consumer_build.sh"
for tool in dpkg-buildpackage dh; do
  command -v "$tool" >/dev/null || fail "$tool is missing (scripts/setup.sh installs debhelper and dpkg-dev)"
done

bash "$root/scripts/build-packages.sh" "$tmp/out" "$build" >"$tmp/build.log" 2>&1 || { tail -40 "$tmp/build.log" >&2; fail "build-packages.sh"; }
deb() { ls "$tmp/out/$1"_*.deb 2>/dev/null | head -1; }
for p in kvd libkvd-dev python3-kvd; do [ -n "$(deb "$p")" ] || fail "no $p package"; done
wheel=$(ls "$tmp/out/"kvd_client-*.whl 2>/dev/null | head -1)
[ -n "$wheel" ] || fail "no wheel"

contents() { dpkg-deb -c "$1" | awk '{print $6}' | sed 's|^\./|/|'; }
for f in /usr/bin/kvd /usr/bin/kvdctl /usr/bin/kvd_example_worker /lib/systemd/system/kvd.service /etc/kvd/kvd.yaml; do
  contents "$(deb kvd)" | grep -x "$f" >/dev/null || fail "the kvd package lacks $f"
done
mkdir "$tmp/kvd" "$tmp/kvd-control"
dpkg-deb -x "$(deb kvd)" "$tmp/kvd"
dpkg-deb -e "$(deb kvd)" "$tmp/kvd-control"
grep -q '^ExecStart=/usr/bin/kvd ' "$tmp/kvd/lib/systemd/system/kvd.service" || fail "the packaged unit does not run /usr/bin/kvd"
grep -qx /etc/kvd/kvd.yaml "$tmp/kvd-control/conffiles" || fail "/etc/kvd/kvd.yaml is not a conffile"
grep -q 'adduser --system --group' "$tmp/kvd-control/postinst" || fail "the postinst does not make the kvd user"
grep -q 'deb-systemd-helper' "$tmp/kvd-control/postinst" || fail "the postinst does not enable the unit"
dpkg-deb -f "$(deb kvd)" Depends | grep libgrpc++ >/dev/null || fail "kvd's Depends do not name its shared libraries"
"$tmp/kvd/usr/bin/kvd" --version | grep '^kvd ' >/dev/null || fail "the packaged kvd does not run"

for f in /usr/include/kvd/client/client.h /usr/lib/libkvd_client.a /usr/lib/cmake/kvd/kvdConfig.cmake /usr/lib/pkgconfig/kvd-client.pc; do
  contents "$(deb libkvd-dev)" | grep -x "$f" >/dev/null || fail "the libkvd-dev package lacks $f"
done
mkdir "$tmp/dev"
dpkg-deb -x "$(deb libkvd-dev)" "$tmp/dev"
! grep -rq "$build\|$root" "$tmp/dev/usr/lib/cmake" "$tmp/dev/usr/lib/pkgconfig" || fail "libkvd-dev names the build or source tree"
consumer_cmake "$build" "$tmp/dev/usr" "$tmp/consumer" "$tmp/consumer.log" \
  || { tail -30 "$tmp/consumer.log" >&2; fail "a worker against libkvd-dev"; }

for f in /usr/lib/python3/dist-packages/kvd/client.py /usr/lib/python3/dist-packages/kvd/v1/kvd_pb2.py \
         /usr/lib/python3/dist-packages/kvd/engine/worker.py; do
  contents "$(deb python3-kvd)" | grep -x "$f" >/dev/null || fail "the python3-kvd package lacks $f"
done
/usr/bin/python3 -m zipfile -l "$wheel" | grep 'kvd/v1/kvd_pb2.py' >/dev/null || fail "the wheel lacks the gRPC stubs"
/usr/bin/python3 -m venv --system-site-packages "$tmp/venv"
"$tmp/venv/bin/pip" install --quiet --no-deps --no-index "$wheel" || fail "the wheel does not install"
(cd "$tmp" && env -u PYTHONPATH "$tmp/venv/bin/python" -c 'import kvd, kvd.engine.worker; assert kvd.__file__.startswith("'"$tmp"'/venv")') \
  || fail "the installed wheel does not import"
echo "packages_check: ok ($(cd "$tmp/out" && ls | tr '\n' ' '))"
