#include "gpu/slab_layout.h"

#include "absl/strings/str_cat.h"

namespace kvd {

absl::StatusOr<int64_t> SlabLayout::Offset(int64_t block, int32_t layer) const {
  if (block < 0 || block >= capacity_blocks_) {
    return absl::OutOfRangeError(absl::StrCat("block ", block, " outside [0, ", capacity_blocks_, ")"));
  }
  if (layer < 0 || layer >= num_layers_) {
    return absl::OutOfRangeError(absl::StrCat("layer ", layer, " outside [0, ", num_layers_, ")"));
  }
  return OffsetUnchecked(block, layer);
}

}  // namespace kvd
