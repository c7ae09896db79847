#!/usr/bin/env bash
# What the source tree must not hold: tests' logs and outputs (they belong in the tests' own
# temporary directories), and what building or installing the Python client leaves beside its
# sources (ignored by .gitignore, so that `pip install ./client/python` as README says leaves the
# checkout clean). Skipped outside a git checkout (an unpacked source package).
# Usage: tree_hygiene.sh SOURCE_DIR
set -euo pipefail
cd "$1"
if ! git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  echo "tree_hygiene: not a git checkout; skipped"
  exit 0
fi
fail=0
while IFS= read -r f; do
  echo "tree_hygiene: a log or core file is tracked: $f"
  fail=1
done < <(git ls-files -- '*.log' '*.log.*' 'core' 'core.*' 'vgcore.*')
for path in client/python/build/lib/x.py client/python/kvd_client.egg-info/PKG-INFO client/python/kvd/__pycache__/x.pyc; do
  if ! git check-ignore -q --no-index "$path"; then
    echo "tree_hygiene: $path would show up untracked (add it to .gitignore)"
    fail=1
  fi
done
[ "$fail" = 0 ] && echo "tree_hygiene: ok"
exit "$fail"
