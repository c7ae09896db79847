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
//
// A hybrid pool (PoolGeometry::groups, docs/hybrid.md §2.2) is cut into one region per group, in
// declaration order, each starting on a 2 MiB boundary (off_g = KvGroup::region_offset_bytes), and
// is layer-major within a group. With u_g = the group's unit bytes of one layer (block_tokens *
// bytes_per_token, or bytes_per_state), cap_g its capacity and i = index - first_block_g the
// group-local index of a pool-wide index:
//   offset(index, j-th layer of the group) = off_g + (j * cap_g + i) * u_g
// so each layer of a group is exactly the paged tensor [cap_g][u_g] a kernel indexes with the
// group's table. The slab is round_up(off_last + |layers_last| * cap_last * u_last, 2 MiB).
#pragma once

#include <cstdint>
#include <vector>

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

// One group's region in a hybrid pool's slab (see above).
struct GroupRegion {
  int64_t offset = 0;           // off_g, a multiple of 2 MiB
  int64_t first_block = 0;      // pool-wide index of the group's unit 0
  int64_t capacity = 0;         // units (blocks or slots)
  int64_t layer_unit_bytes = 0; // u_g
  std::vector<int32_t> layers;  // model layer of each of the group's layers, in memory order
  int64_t bytes() const { return static_cast<int64_t>(layers.size()) * capacity * layer_unit_bytes; }
  // Offset of the j-th layer of group-local unit `local`. REQUIRES: both in range.
  int64_t Offset(int64_t local, int32_t j) const { return offset + (j * capacity + local) * layer_unit_bytes; }
};

class SlabLayout {
 public:
  explicit SlabLayout(const PoolGeometry& g);

  // Bytes of payload (before rounding) and of the slab (rounded to 2 MiB).
  int64_t payload_bytes() const;
  int64_t slab_bytes() const {
    return (payload_bytes() + kSlabAlignment - 1) / kSlabAlignment * kSlabAlignment;
  }
  int64_t layer_block_bytes() const { return layer_block_bytes_; }
  // The regions of a hybrid pool, one per group; empty for a pool without groups.
  const std::vector<GroupRegion>& groups() const { return groups_; }
  // The group holding pool-wide `block`, or -1 (also for a pool without groups).
  int GroupOf(int64_t block) const;
  // Bytes of one layer of `block`: layer_block_bytes, or in a hybrid pool its group's unit (a
  // block of the group's layer, or a state). REQUIRES: 0 <= block < capacity.
  int64_t LayerUnitBytes(int64_t block) const {
    return groups_.empty() ? layer_block_bytes_ : groups_[GroupOf(block)].layer_unit_bytes;
  }

  // Offset of layer `layer` (a model layer) of block `block` in the slab. OUT_OF_RANGE for a bad
  // index, and in a hybrid pool for a layer that is not in the block's group.
  absl::StatusOr<int64_t> Offset(int64_t block, int32_t layer) const;
  // Offset of the j-th layer of group `group`'s unit `local` (group-local index). OUT_OF_RANGE
  // for a bad group, unit or layer.
  absl::StatusOr<int64_t> GroupOffset(int group, int64_t local, int32_t j) const;
  // Offset without checks. REQUIRES: 0 <= block < capacity, 0 <= layer < num_layers; a pool
  // without groups.
  int64_t OffsetUnchecked(int64_t block, int32_t layer) const {
    return layout_ == PoolLayout::kLayerMajor
               ? (layer * capacity_blocks_ + block) * layer_block_bytes_
               : (block * num_layers_ + layer) * layer_block_bytes_;
  }
  // Block `block` (REQUIRES: < capacity) as one strided region: layer-major is num_layers rows
  // of layer_block_bytes, capacity * layer_block_bytes apart; block-major is one row. In a hybrid
  // pool, the block's group's layers: one row of u_g per layer, cap_g * u_g apart.
  StridedBlock Block(int64_t block) const {
    if (!groups_.empty()) {
      const GroupRegion& r = groups_[GroupOf(block)];
      return {r.Offset(block - r.first_block, 0), r.capacity * r.layer_unit_bytes, r.layer_unit_bytes,
              static_cast<int64_t>(r.layers.size())};
    }
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
  std::vector<GroupRegion> groups_;
};

}  // namespace kvd
