"""kvd.v1: generated from proto/kvd/v1/kvd.proto by scripts/gen-python-stubs.sh."""
