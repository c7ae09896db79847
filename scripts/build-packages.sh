#!/usr/bin/env bash
# Builds the Debian packages with Debian's own tooling (dpkg-buildpackage, debhelper; debian/)
# and a wheel of the Python client (pip wheel), into OUT_DIR:
#   kvd_<v>_<arch>.deb          the daemon, kvdctl, the example worker, the unit, /etc/kvd/kvd.yaml
#   libkvd-dev_<v>_<arch>.deb   the worker library: headers, static libraries, CMake and pkg-config
#   python3-kvd_<v>_all.deb     the Python client (import kvd)
#   kvd_client-<v>-py3-none-any.whl
# With BUILD_DIR the packages hold that existing build (the tests package their own); without,
# dpkg-buildpackage configures and builds a Release one. The checkout is not written to: the
# build runs in a staging copy of debian/ beside links to the sources.
# Usage: scripts/build-packages.sh OUT_DIR [BUILD_DIR]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="$(mkdir -p "${1:?usage: build-packages.sh OUT_DIR [BUILD_DIR]}" && cd "$1" && pwd)"
prebuilt="${2:+$(cd "$2" && pwd)}"
stage="$(mktemp -d /tmp/kvd-packages.XXXXXX)"
trap 'rm -rf "$stage"' EXIT
mkdir "$stage/src"
for entry in "$root"/* "$root"/.ci; do
  name="$(basename "$entry")"
  case "$name" in debian|build*) continue ;; esac
  [ -e "$entry" ] && ln -s "$entry" "$stage/src/$name"
done
cp -r "$root/debian" "$stage/src/debian"
(cd "$stage/src" && KVD_PREBUILT="$prebuilt" dpkg-buildpackage -b -us -uc >"$stage/build.log" 2>&1) \
  || { tail -40 "$stage/build.log" >&2; echo "build-packages: dpkg-buildpackage failed" >&2; exit 1; }
cp "$stage"/*.deb "$out"/
cp -r "$root/client/python" "$stage/python"
rm -rf "$stage/python/build" "$stage/python/"*.egg-info
/usr/bin/python3 -m pip wheel --quiet --no-deps --no-build-isolation --no-index -w "$out" "$stage/python" >"$stage/wheel.log" 2>&1 \
  || { cat "$stage/wheel.log" >&2; echo "build-packages: pip wheel failed" >&2; exit 1; }
ls "$out"
