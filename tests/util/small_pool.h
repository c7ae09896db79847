// The small pool the in-process daemon tests and fuzzers run: "default", 4-token blocks, 2 layers,
// 16 bytes per token and layer (128-byte blocks), 64 blocks.
#pragma once

#include "proto/vocab/pool_geometry.h"

namespace kvd::testing {

inline PoolGeometry SmallPool() {
  PoolGeometry g;
  g.name = "default";
  g.block_tokens = 4;
  g.num_layers = 2;
  g.bytes_per_token_per_layer = 16;
  g.capacity_blocks = 64;
  g.max_model_len = 256;
  return g;
}

}  // namespace kvd::testing
