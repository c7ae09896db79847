#!/usr/bin/env bash
# Regenerates the Python client's gRPC stubs (client/python/kvd/v1/) from proto/kvd/v1/kvd.proto
# with Debian's protoc and grpc_python_plugin. They are committed so that `pip install
# client/python` needs no compiler; the CTest `python_package` fails when they are stale.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="$root/client/python"
mkdir -p "$out/kvd/v1"
protoc --python_out="$out" --grpc_python_out="$out" \
  --plugin=protoc-gen-grpc_python="$(command -v grpc_python_plugin)" \
  -I "$root/proto" kvd/v1/kvd.proto
printf '"""kvd.v1: generated from proto/kvd/v1/kvd.proto by scripts/gen-python-stubs.sh."""\n' \
  > "$out/kvd/v1/__init__.py"
echo "regenerated $out/kvd/v1"
