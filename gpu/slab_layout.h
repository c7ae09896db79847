// SlabLayout is the byte layout of one pool's slab on one shard (device). The daemon and every
// worker compute it from the pool geometry alone, so only block indices travel between them.
//
// A pool has one slab per shard; every shard holds the same block indices. Let
//   L = layer_block_bytes = block_tokens * bytes_per_token_per_layer
//   C = capacity_blocks, N = num_layers
// Layer-major (default): each layer is one contiguous array [C][L], exactly a paged-attention KV
// tensor whose block table is kvd's block indices:
//   offset(block b, layer l) = l * C * L + b * L
// Block-major: each block is contiguous across its layers (cheaper to move between tiers):
//   offset(block b, layer l) = b * N * L + l * L
// The slab is rounded up to a multiple of 2 MiB; bytes past N * C * L are padding.
// Within a layer's L bytes the engine chooses the arrangement (e.g. [K|V][tokens][heads][dim]).
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "proto/vocab/pool_geometry.h"

namespace kvd {

inline constexpr int64_t kSlabAlignment = int64_t{2} << 20;  // 2 MiB

// One block of one shard as a strided region: `rows` rows of `row_bytes`, `slab_pitch` apart in
// the slab starting at `slab_offset`, packed back to back ([layer][layer block bytes]) in a
// contiguous buffer. The shape of cudaMemcpy2D; every tier copy of every backend follows it.
struct StridedBlock {
  int64_t slab_offset = 0;
  int64_t slab_pitch = 0;
  int64_t row_bytes = 0;
  int64_t rows = 0;
  int64_t bytes() const { return row_bytes * rows; }
};

class SlabLayout {
 public:
  explicit SlabLayout(const PoolGeometry& g)
      : layout_(g.layout),
        capacity_blocks_(g.capacity_blocks),
        num_layers_(g.num_layers),
        layer_block_bytes_(g.layer_block_bytes()) {}

  // Bytes of payload (before rounding) and of the slab (rounded to 2 MiB).
  int64_t payload_bytes() const { return capacity_blocks_ * num_layers_ * layer_block_bytes_; }
  int64_t slab_bytes() const {
    return (payload_bytes() + kSlabAlignment - 1) / kSlabAlignment * kSlabAlignment;
  }
  int64_t layer_block_bytes() const { return layer_block_bytes_; }

  // Offset of layer `layer` of block `block` in the slab. OUT_OF_RANGE for a bad index.
  absl::StatusOr<int64_t> Offset(int64_t block, int32_t layer) const;
  // Offset without checks. REQUIRES: 0 <= block < capacity, 0 <= layer < num_layers.
  int64_t OffsetUnchecked(int64_t block, int32_t layer) const {
    return layout_ == PoolLayout::kLayerMajor
               ? (layer * capacity_blocks_ + block) * layer_block_bytes_
               : (block * num_layers_ + layer) * layer_block_bytes_;
  }
  // Block `block` (REQUIRES: < capacity) as one strided region: layer-major is num_layers rows
  // of layer_block_bytes, capacity * layer_block_bytes apart; block-major is one row.
  StridedBlock Block(int64_t block) const {
    if (layout_ == PoolLayout::kLayerMajor) {
      return {block * layer_block_bytes_, capacity_blocks_ * layer_block_bytes_, layer_block_bytes_,
              num_layers_};
    }
    const int64_t row = num_layers_ * layer_block_bytes_;
    return {block * row, row, row, 1};
  }

 private:
  PoolLayout layout_;
  int64_t capacity_blocks_;
  int32_t num_layers_;
  int64_t layer_block_bytes_;
};

}  // namespace kvd
