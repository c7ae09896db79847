#!/usr/bin/env bash
# The target graph's layers (docs/architecture.md, "Layers and targets"), checked on the sources:
#   proto/vocab  the vocabulary: includes only itself (and Abseil, xxHash, the standard library)
#   proto, gpu, client  include nothing under server/
#   kvd_vocab, kvd_gpu, kvd_proto, kvd_client  link no engine (kvd_core) and no store
#   server/store, server/transfer  see the engine through TierPort only; server/obs includes nothing of server/rpc
# Usage: layering.sh SOURCE_DIR
set -euo pipefail
root="$1"
cd "$root"
fail=0
bad() { echo "layering: $*"; fail=1; }

while IFS= read -r hit; do bad "vocabulary reaches outside itself: $hit"; done < <(
  grep -rn '#include "' proto/vocab | grep -v -e '#include "proto/vocab/' -e '#include "absl/' -e '#include "xxhash.h"' || true)
while IFS= read -r hit; do bad "includes server/: $hit"; done < <(
  grep -rn '#include "server/' proto gpu client --include=*.h --include=*.cc --include=*.cu || true)
while IFS= read -r hit; do bad "the store reaches into the engine (use server/core/tier_port.h): $hit"; done < <(
  grep -rn '#include "server/core/kv_cache' server/store || true)
while IFS= read -r hit; do bad "peer transfer reaches into the engine (use server/core/tier_port.h): $hit"; done < <(
  grep -rn '#include "server/core/kv_cache' server/transfer || true)
while IFS= read -r hit; do bad "obs depends on rpc (read registries through functions): $hit"; done < <(
  grep -rn '#include "server/rpc/' server/obs || true)
for f in proto/CMakeLists.txt gpu/CMakeLists.txt client/CMakeLists.txt; do
  while IFS= read -r hit; do bad "$f links the engine or the store: $hit"; done < <(
    grep -n 'target_link_libraries' "$f" | grep -E '\bkvd_(core|store|server|events|obs)\b' || true)
done
if [[ $fail -ne 0 ]]; then
  echo "layering: FAILED"
  exit 1
fi
echo "layering: ok"
