#!/usr/bin/env bash
# The GPU proof bundle, tried the way it will be used: copied into a minimal Debian 12 root
# (debootstrap --variant=minbase, plus python3 without any module of ours; no kvd dependency
# installed) and run there with chroot. Without a GPU driver, run.sh must get as far as reporting
# that the driver is missing (exit 2) — never a missing library — and the Python check must get
# as far as reporting that PyTorch is missing — never a missing module.
#
# Usage (as root): tests/gpu/bundle/minimal_root_check.sh BUNDLE_DIR [ROOT_DIR]
# ROOT_DIR defaults to build-minroot/ in the checkout and is reused when it is there already.
set -euo pipefail
bundle="$(cd "${1:?usage: minimal_root_check.sh BUNDLE_DIR [ROOT_DIR]}" && pwd)"
kvd_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
root="${2:-$kvd_root/build-minroot}"
[ "$(id -u)" -eq 0 ] || { echo "minimal_root_check: needs root (debootstrap, chroot)" >&2; exit 1; }
command -v debootstrap >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
if [ ! -x "$root/usr/bin/python3" ]; then
  # From the mirror apt already uses here; a copy is kept outside the checkout for a week.
  source "$kvd_root/scripts/apt-mirror.sh"
  kvd_debootstrap_cached "$root" minbase-python3 --include=python3 \
    || { echo "minimal_root_check: debootstrap failed" >&2; exit 1; }
fi
fail() { echo "minimal_root_check: FAIL: $*" >&2; exit 1; }
rm -rf "$root/opt/kvd-bundle" "$root/tmp/kvd-out"
cp -a "$bundle" "$root/opt/kvd-bundle"
# The root has none of kvd's libraries: prove it, so that the check cannot pass by accident.
for lib in libgrpc++.so.1.51 libprotobuf.so.32 libabsl_base.so.20220623 libspdlog.so.1.10; do
  ! chroot "$root" /bin/sh -c "ls /usr/lib/x86_64-linux-gnu/$lib" >/dev/null 2>&1 || fail "$lib is in the root"
done
# A real machine has /proc, which the loader needs to expand $ORIGIN in the binaries' RUNPATH.
if ! mountpoint -q "$root/proc"; then
  mount -t proc proc "$root/proc" 2>/dev/null && trap 'umount "$root/proc"' EXIT \
    || echo "minimal_root_check: cannot mount /proc here; run.sh's LD_LIBRARY_PATH stands in for RUNPATH"
fi
set +e
chroot "$root" /opt/kvd-bundle/run.sh /tmp/kvd-out >"$root.run.log" 2>&1
rc=$?
set -e
cat "$root.run.log"
[ "$rc" -eq 2 ] || fail "run.sh exited $rc, expected 2 (no NVIDIA driver)"
grep -q '"step": "libraries", "ok": true' "$root/tmp/kvd-out/results.jsonl" || fail "a binary did not load"
grep -q "no NVIDIA driver" "$root/tmp/kvd-out/summary.txt" || fail "the summary does not say the driver is missing"
! grep -rq "error while loading shared libraries" "$root/tmp/kvd-out" || fail "a shared library is missing"
if mountpoint -q "$root/proc"; then  # RUNPATH alone, as an operator runs a bundled binary by hand
  chroot "$root" /usr/bin/env -u LD_LIBRARY_PATH /opt/kvd-bundle/kvd --help >/dev/null 2>&1 \
    || fail "kvd does not load through its RUNPATH (\$ORIGIN/lib)"
fi
set +e
py=$(chroot "$root" /usr/bin/python3 /opt/kvd-bundle/python/torch_slab_check.py /opt/kvd-bundle 2>&1)
py_rc=$?
set -e
echo "$py"
[ "$py_rc" -eq 4 ] && grep -q "skipped: no PyTorch" <<<"$py" || fail "the Python check exited $py_rc (expected 4, skipped for want of PyTorch)"
set +e
hy=$(chroot "$root" /usr/bin/python3 /opt/kvd-bundle/python/hybrid_gpu_check.py /opt/kvd-bundle 2>&1)
hy_rc=$?
set -e
echo "$hy"
[ "$hy_rc" -eq 4 ] && grep -q "skipped: no PyTorch" <<<"$hy" || fail "the hybrid model check exited $hy_rc (expected 4, skipped for want of PyTorch)"
! grep -q "ModuleNotFoundError" <<<"$py$hy$(cat "$root.run.log")" || fail "a Python module is missing"
echo "minimal_root_check: ok (bundle $(du -sh "$bundle" | cut -f1), every binary loads in a bare Debian 12 root; no driver reported)"
