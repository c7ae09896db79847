#!/usr/bin/env bash
# The kvd image's runtime stage, tried as closely as this machine can without a container
# runtime: (1) deploy/runtime-packages.txt must be exactly the Debian packages that provide the
# libraries kvd, kvdctl and kvd_example_worker link directly (objdump NEEDED -> ldd -> dpkg -S),
# plus the lines marked "# extra:"; (2) a bare Debian 12 root (debootstrap minbase) gets exactly
# that list through apt-get and the image's user 10001, then the kvd and python3-kvd packages
# (scripts/build-packages.sh from BUILD_DIR), as the Containerfile's runtime stage installs them:
# dpkg must find kvd's dependencies satisfied by the list. In it kvd runs as 10001 from the
# packaged /etc/kvd/kvd.yaml, kvdctl health answers SERVING, the example worker runs a request
# that writes and reads KV through the side socket, and README's Python snippet runs on python3-kvd
# (apt-get brings python3-grpcio and python3-protobuf).
#
# Usage (as root): tests/deploy/image_root_check.sh BUILD_DIR [ROOT_DIR]
# ROOT_DIR defaults to build-imageroot/ in the checkout, reused when it is there already.
set -euo pipefail
build="$(cd "${1:?usage: image_root_check.sh BUILD_DIR [ROOT_DIR]}" && pwd)"
kvd_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
root="${2:-$kvd_root/build-imageroot}"
[ "$(id -u)" -eq 0 ] || { echo "image_root_check: needs root (debootstrap, chroot)" >&2; exit 1; }
fail() { echo "image_root_check: FAIL: $*" >&2; exit 1; }
bins=("$build/server/kvd" "$build/server/kvdctl" "$build/client/kvd_example_worker")

# (1) The package list against the binaries.
needed=$(for b in "${bins[@]}"; do
  objdump -p "$b" | awk '/NEEDED/{print $2}' | while read -r lib; do
    path=$(ldd "$b" | awk -v l="$lib" '$1 == l {print $3}')
    [ -n "$path" ] || continue
    owner=$(dpkg -S "$path" 2>/dev/null || dpkg -S "/usr$path" 2>/dev/null || dpkg -S "$(readlink -f "$path")" 2>/dev/null) \
      || fail "no Debian package owns $path ($lib, needed by $(basename "$b"))"
    echo "${owner%%:*}"
  done
done | sort -u)
listed=$(grep -v '^#' "$kvd_root/deploy/runtime-packages.txt" | grep -v '# extra:' | sed 's/#.*//; s/ //g' | grep . | sort -u)
if [ "$needed" != "$listed" ]; then
  diff <(echo "$listed") <(echo "$needed") | sed 's/^</  listed, not linked:/; s/^>/  linked, not listed:/' >&2 || true
  fail "deploy/runtime-packages.txt differs from what the binaries link"
fi
packages=$(sed -e 's/#.*//' "$kvd_root/deploy/runtime-packages.txt" | tr -s ' \n' ' ')
echo "image_root_check: runtime-packages.txt matches the binaries ($(echo "$needed" | wc -l) linked packages)"

# (2) A bare root with exactly that list.
command -v debootstrap >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
source "$kvd_root/scripts/apt-mirror.sh"
# The root with the list installed and the image's user, as the Containerfile's runtime stage makes
# them (once a week; kvd_debootstrap_cached keeps a copy outside the checkout).
kvd_root_setup() {
  cp /etc/resolv.conf "$1/etc/resolv.conf" 2>/dev/null || true
  # shellcheck disable=SC2086
  chroot "$1" /usr/bin/env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $packages \
    >>"$1.log" 2>&1 || { tail -20 "$1.log" >&2; echo "apt-get install of the runtime packages failed" >&2; return 1; }
  chroot "$1" groupadd --system --gid 10001 kvd
  chroot "$1" useradd --system --uid 10001 --gid kvd --no-create-home --shell /usr/sbin/nologin kvd
  echo "$packages" >"$1/.kvd-runtime-packages"
}
if [ ! -f "$root/.kvd-runtime-packages" ] || [ "$(cat "$root/.kvd-runtime-packages")" != "$packages" ]; then
  kvd_debootstrap_cached "$root" "image-$(sha256sum <<<"$packages" | cut -c1-16)" || fail "the bare root"
fi
# The packages, installed as the image installs them: kvd with dpkg alone (its dependencies must
# already be there), python3-kvd through apt-get (it brings the Python gRPC packages).
packages_dir="$root/tmp/kvd-packages"
rm -rf "$packages_dir" && mkdir -p "$packages_dir"
bash "$kvd_root/scripts/build-packages.sh" "$packages_dir" "$build" >"$root.packages.log" 2>&1 \
  || { tail -30 "$root.packages.log" >&2; fail "scripts/build-packages.sh"; }
chroot "$root" dpkg -i --force-confnew /tmp/kvd-packages/"$(basename "$packages_dir"/kvd_*.deb)" >>"$root.log" 2>&1 \
  || { tail -20 "$root.log" >&2; fail "dpkg -i kvd (are its dependencies all in deploy/runtime-packages.txt?)"; }
chroot "$root" /usr/bin/env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
  /tmp/kvd-packages/"$(basename "$packages_dir"/python3-kvd_*.deb)" >>"$root.log" 2>&1 \
  || { tail -20 "$root.log" >&2; fail "apt-get install python3-kvd"; }
[ "$(chroot "$root" id -u kvd)" = 10001 ] || fail "the package replaced the image's kvd user"
mkdir -p "$root/run/kvd" && chown 10001:10001 "$root/run/kvd" && rm -f "$root/run/kvd/"*
mountpoint -q "$root/proc" || { mount -t proc proc "$root/proc" && trap 'umount "$root/proc" 2>/dev/null || true' EXIT; }
cleanup_kvd() { [ -n "${kvd_pid:-}" ] && kill "$kvd_pid" 2>/dev/null; wait 2>/dev/null || true; umount "$root/proc" 2>/dev/null || true; }
trap cleanup_kvd EXIT
chroot --userspec=10001:10001 "$root" /usr/bin/kvd --config=/etc/kvd/kvd.yaml --listen=unix:///run/kvd/kvd.sock \
  --metrics-listen=off --ready-file=/run/kvd/ready.json >"$root.kvd.log" 2>&1 &
kvd_pid=$!
# Up to 180 s: kvd pre-faults its pool before it binds, slow on a loaded 2-core machine.
for _ in $(seq 1 1800); do [ -f "$root/run/kvd/ready.json" ] && break; kill -0 "$kvd_pid" 2>/dev/null || break; sleep 0.1; done
[ -f "$root/run/kvd/ready.json" ] || { cat "$root.kvd.log" >&2; fail "kvd did not start in the image root"; }
health=$(chroot "$root" /usr/bin/kvdctl --target=unix:///run/kvd/kvd.sock health) || fail "kvdctl health: $health"
[ "$health" = SERVING ] || fail "kvdctl health says $health"
pool=$(sed -n 's/^ *- name: *\([^ #]*\).*/\1/p' "$kvd_root/deploy/kvd.example.yaml" | head -1)
out=$(chroot --userspec=10001:10001 "$root" /usr/bin/kvd_example_worker --target=unix:///run/kvd/kvd.sock \
  ${pool:+--pool="$pool"} --id=image-check --prompt-range=0:64) || fail "the example worker failed: $out"
grep -q '"mismatches": 0' <<<"$out" || fail "the example worker saw wrong KV: $out"
sed -n '/<!-- python-snippet -->/,/^```$/p' "$kvd_root/README.md" | sed '1,2d;$d' >"$root/tmp/snippet.py"
py=$(chroot --userspec=10001:10001 "$root" /usr/bin/env KVD_TARGET=unix:///run/kvd/kvd.sock python3 /tmp/snippet.py 2>&1) \
  || fail "README's Python snippet on python3-kvd: $py"
grep -q "prompt tokens already cached" <<<"$py" || fail "README's Python snippet printed: $py"
kill -TERM "$kvd_pid"; wait "$kvd_pid" || fail "kvd did not exit cleanly on SIGTERM"; kvd_pid=
! grep -q "error while loading shared libraries" "$root.kvd.log" || fail "a shared library is missing"
echo "image_root_check: ok (the kvd and python3-kvd packages served in a bare Debian 12 root with only deploy/runtime-packages.txt installed)"
