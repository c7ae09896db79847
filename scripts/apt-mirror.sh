#!/usr/bin/env bash
# Sourced by the root checks (tests/deploy/image_root_check.sh, tests/gpu/bundle/minimal_root_check.sh):
# kvd_apt_mirror prints the Debian mirror this machine's apt uses (deb822 debian.sources, else a
# one-line sources.list, as in a debootstrap root), or deb.debian.org. Never fails: the checks run
# under `set -euo pipefail`, where a missing sources file must not end them.
kvd_apt_mirror() {
  local m=""
  m=$(sed -n 's/^URIs: *//p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -1 || true)
  [ -n "$m" ] || m=$(awk '$1 == "deb" && $3 == "bookworm" {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
  echo "${m:-http://deb.debian.org/debian}"
}
