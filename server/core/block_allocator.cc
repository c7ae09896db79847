#include "server/core/block_allocator.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "proto/vocab/status_macros.h"

namespace kvd {

BlockAllocator::BlockAllocator(int64_t capacity_blocks) : capacity_(capacity_blocks) {
  free_.reserve(capacity_blocks);
  // Lowest index on top of the stack, so a fresh pool hands out 0, 1, 2, ...
  for (int64_t i = capacity_blocks - 1; i >= 0; --i) free_.push_back(static_cast<BlockIndex>(i));
}

absl::StatusOr<std::vector<BlockIndex>> BlockAllocator::Allocate(int64_t count) {
  if (count < 0) return absl::InvalidArgumentError("block count must be >= 0");
  if (count > num_free()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("need ", count, " free blocks, have ", num_free()));
  }
  std::vector<BlockIndex> out(free_.end() - count, free_.end());
  free_.resize(free_.size() - count);
  // Hand out in ascending order of the stack top, so a request's blocks tend to be ascending.
  std::reverse(out.begin(), out.end());
  return out;
}

absl::Status BlockAllocator::Claim(absl::Span<const BlockIndex> indices) {
  std::vector<bool> is_free(capacity_, false);
  for (BlockIndex i : free_) is_free[i] = true;
  for (BlockIndex i : indices) {
    if (static_cast<int64_t>(i) >= capacity_ || !is_free[i]) {
      return absl::InvalidArgumentError(absl::StrCat("block ", i, " is out of range, repeated or not free"));
    }
    is_free[i] = false;
  }
  // Keep the stack's order for what stays free.
  std::erase_if(free_, [&is_free](BlockIndex i) { return !is_free[i]; });
  return absl::OkStatus();
}

void BlockAllocator::Free(absl::Span<const BlockIndex> indices) {
  for (BlockIndex i : indices) Free(i);
}

void BlockAllocator::Free(BlockIndex index) {
  KVD_CHECK(static_cast<int64_t>(index) < capacity_);
  KVD_CHECK(num_free() < capacity_);
  free_.push_back(index);
}

}  // namespace kvd
