#!/usr/bin/env bash
# Regenerates the Python client's gRPC stubs (client/python/kvd/v1/) from proto/kvd/v1/kvd.proto
# with Debian's protoc and grpc_python_plugin, keeping the client side only (the stub and the
# experimental call helpers: kvd's server is C++, so the generated servicer base class, whose
# methods answer UNIMPLEMENTED, is left out). They are committed so that `pip install
# client/python` and the build need no compiler; the CTest `python_package` runs this script into
# a scratch directory and fails when the committed files differ.
# Usage: scripts/gen-python-stubs.sh [OUT_DIR]   (default: client/python)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-$root/client/python}"
mkdir -p "$out/kvd/v1"
protoc --python_out="$out" --grpc_python_out="$out" \
  --plugin=protoc-gen-grpc_python="$(command -v grpc_python_plugin)" \
  -I "$root/proto" kvd/v1/kvd.proto
# Drop `class KvdServicer` and `add_KvdServicer_to_server`: everything from the first up to the
# experimental `class Kvd` helpers (with the comment line that precedes them).
python3 - "$out/kvd/v1/kvd_pb2_grpc.py" <<'PY'
import sys
path = sys.argv[1]
src = open(path).read()
start = src.index("class KvdServicer(object):")
end = src.index(" # This class is part of an EXPERIMENTAL API.\nclass Kvd(object):")
open(path, "w").write(src[:start] + src[end:])
PY
printf '"""kvd.v1: generated from proto/kvd/v1/kvd.proto by scripts/gen-python-stubs.sh."""\n' \
  > "$out/kvd/v1/__init__.py"
echo "regenerated $out/kvd/v1"
