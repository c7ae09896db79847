#!/usr/bin/env bash
# Sourced by the root checks (tests/deploy/image_root_check.sh, tests/gpu/bundle/minimal_root_check.sh):
# kvd_apt_mirror prints the Debian mirror this machine's apt uses (deb822 debian.sources, else a
# one-line sources.list, as in a debootstrap root), or deb.debian.org. Never fails: the checks run
# under `set -euo pipefail`, where a missing sources file must not end them. kvd_debootstrap_cached
# makes their roots.
kvd_apt_mirror() {
  local m=""
  m=$(sed -n 's/^URIs: *//p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -1 || true)
  [ -n "$m" ] || m=$(awk '$1 == "deb" && $3 == "bookworm" {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
  echo "${m:-http://deb.debian.org/debian}"
}

# kvd_debootstrap_cached ROOT KEY [debootstrap options...]: a fresh bookworm minbase root at ROOT,
# unpacked from ${KVD_CACHE_DIR:-~/.cache/kvd}/root-KEY.tar when that is there and under a week
# old, else made with debootstrap (the options, then whatever kvd_root_setup does in it, when the
# caller defines that function) and saved there. Each run gets a root no earlier run has touched;
# the week brings Debian's point releases in. KEY names what the root holds.
kvd_debootstrap_cached() {
  local root="$1" key="$2"
  shift 2
  local cache="${KVD_CACHE_DIR:-${XDG_CACHE_HOME:-${HOME:-/var/tmp}/.cache}/kvd}"
  local tarball="$cache/root-$key.tar"
  rm -rf "$root"
  mkdir -p "$root"
  if [ -f "$tarball" ] && [ -n "$(find "$tarball" -mtime -7)" ] && tar -C "$root" -xf "$tarball"; then
    return 0
  fi
  rm -rf "$root"
  debootstrap --variant=minbase "$@" bookworm "$root" "$(kvd_apt_mirror)" >"$root.log" 2>&1 \
    || { tail -20 "$root.log" >&2; echo "debootstrap failed" >&2; return 1; }
  if declare -F kvd_root_setup >/dev/null; then kvd_root_setup "$root" || return 1; fi
  chroot "$root" apt-get clean >/dev/null 2>&1 || true
  mkdir -p "$cache"
  tar -C "$root" -cf "$tarball.$$" . && mv "$tarball.$$" "$tarball"
}
