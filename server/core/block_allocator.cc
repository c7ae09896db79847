#include "server/core/block_allocator.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "proto/vocab/status_macros.h"

namespace kvd {

BlockAllocator::BlockAllocator(int64_t capacity_blocks)
    : BlockAllocator(std::vector<int64_t>{capacity_blocks}) {}

BlockAllocator::BlockAllocator(const std::vector<int64_t>& group_capacities) {
  for (int64_t cap : group_capacities) {
    first_.push_back(capacity_);
    capacity_of_.push_back(cap);
    std::vector<BlockIndex>& stack = free_.emplace_back();
    stack.reserve(cap);
    // Lowest index on top of the stack, so a fresh group hands out first, first + 1, ...
    for (int64_t i = capacity_ + cap - 1; i >= capacity_; --i) stack.push_back(static_cast<BlockIndex>(i));
    capacity_ += cap;
  }
  num_free_ = capacity_;
}

int BlockAllocator::GroupOf(BlockIndex index) const {
  int g = 0;
  while (g + 1 < num_groups() && static_cast<int64_t>(index) >= first_[g + 1]) ++g;
  return g;
}

absl::StatusOr<std::vector<BlockIndex>> BlockAllocator::Allocate(int64_t count, int group) {
  if (count < 0) return absl::InvalidArgumentError("block count must be >= 0");
  if (group < 0 || group >= num_groups()) return absl::InvalidArgumentError(absl::StrCat("no group ", group));
  std::vector<BlockIndex>& stack = free_[group];
  if (count > static_cast<int64_t>(stack.size())) {
    return absl::ResourceExhaustedError(
        num_groups() == 1 ? absl::StrCat("need ", count, " free blocks, have ", stack.size())
                          : absl::StrCat("need ", count, " free blocks of group ", group, ", have ", stack.size()));
  }
  std::vector<BlockIndex> out(stack.end() - count, stack.end());
  stack.resize(stack.size() - count);
  num_free_ -= count;
  // Hand out in ascending order of the stack top, so a request's blocks tend to be ascending.
  std::reverse(out.begin(), out.end());
  return out;
}

absl::Status BlockAllocator::Claim(absl::Span<const BlockIndex> indices) {
  std::vector<bool> is_free(capacity_, false);
  for (const auto& stack : free_) {
    for (BlockIndex i : stack) is_free[i] = true;
  }
  for (BlockIndex i : indices) {
    if (static_cast<int64_t>(i) >= capacity_ || !is_free[i]) {
      return absl::InvalidArgumentError(absl::StrCat("block ", i, " is out of range, repeated or not free"));
    }
    is_free[i] = false;
  }
  // Keep the stacks' order for what stays free.
  for (auto& stack : free_) std::erase_if(stack, [&is_free](BlockIndex i) { return !is_free[i]; });
  num_free_ -= static_cast<int64_t>(indices.size());
  return absl::OkStatus();
}

void BlockAllocator::Free(absl::Span<const BlockIndex> indices) {
  for (BlockIndex i : indices) Free(i);
}

void BlockAllocator::Free(BlockIndex index) {
  KVD_CHECK(static_cast<int64_t>(index) < capacity_);
  const int g = GroupOf(index);
  KVD_CHECK(num_free(g) < capacity_of_[g]);
  free_[g].push_back(index);
  ++num_free_;
}

}  // namespace kvd
