#include "gpu/slab_layout.h"

#include "absl/strings/str_cat.h"

namespace kvd {

SlabLayout::SlabLayout(const PoolGeometry& g)
    : layout_(g.layout),
      capacity_blocks_(g.capacity_blocks),
      num_layers_(g.num_layers),
      layer_block_bytes_(g.layer_block_bytes()) {
  for (size_t j = 0; j < g.groups.size(); ++j) {
    const KvGroup& k = g.groups[j];
    groups_.push_back({.offset = k.region_offset_bytes, .first_block = k.first_block, .capacity = k.capacity,
                       .layer_unit_bytes = g.GroupLayerUnitBytes(static_cast<int>(j)), .layers = k.layers});
  }
}

int64_t SlabLayout::payload_bytes() const {
  if (groups_.empty()) return capacity_blocks_ * num_layers_ * layer_block_bytes_;
  return groups_.back().offset + groups_.back().bytes();
}

int SlabLayout::GroupOf(int64_t block) const {
  for (size_t g = 0; g < groups_.size(); ++g) {
    if (block >= groups_[g].first_block && block < groups_[g].first_block + groups_[g].capacity) {
      return static_cast<int>(g);
    }
  }
  return -1;
}

absl::StatusOr<int64_t> SlabLayout::GroupOffset(int group, int64_t local, int32_t j) const {
  if (group < 0 || group >= static_cast<int>(groups_.size())) {
    return absl::OutOfRangeError(absl::StrCat("group ", group, " outside [0, ", groups_.size(), ")"));
  }
  const GroupRegion& r = groups_[group];
  if (local < 0 || local >= r.capacity) {
    return absl::OutOfRangeError(absl::StrCat("unit ", local, " outside [0, ", r.capacity, ") of group ", group));
  }
  if (j < 0 || j >= static_cast<int32_t>(r.layers.size())) {
    return absl::OutOfRangeError(absl::StrCat("layer ", j, " outside [0, ", r.layers.size(), ") of group ", group));
  }
  return r.Offset(local, j);
}

absl::StatusOr<int64_t> SlabLayout::Offset(int64_t block, int32_t layer) const {
  if (!groups_.empty()) {
    const int g = GroupOf(block);
    if (g < 0) return absl::OutOfRangeError(absl::StrCat("block ", block, " outside [0, ", capacity_blocks_, ")"));
    const GroupRegion& r = groups_[g];
    for (size_t j = 0; j < r.layers.size(); ++j) {
      if (r.layers[j] == layer) return r.Offset(block - r.first_block, static_cast<int32_t>(j));
    }
    return absl::OutOfRangeError(absl::StrCat("layer ", layer, " is not in group ", g, " of block ", block));
  }
  if (block < 0 || block >= capacity_blocks_) {
    return absl::OutOfRangeError(absl::StrCat("block ", block, " outside [0, ", capacity_blocks_, ")"));
  }
  if (layer < 0 || layer >= num_layers_) {
    return absl::OutOfRangeError(absl::StrCat("layer ", layer, " outside [0, ", num_layers_, ")"));
  }
  return OffsetUnchecked(block, layer);
}

}  // namespace kvd
