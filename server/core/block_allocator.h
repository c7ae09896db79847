// BlockAllocator hands out the free blocks of one pool. It never touches block contents and knows
// nothing of caching: a block is either free (here) or handed out (the caller's).
//
// A pool's index space may be cut into groups (a hybrid pool's KV groups, docs/hybrid.md §2.2):
// group g owns [first_g, first_g + capacity_g), the ranges laid end to end in group order, and
// each group has its own free list, so a block of one group is never handed out for another. A
// pool without groups is one group of every block.
// Thread-compatible: the caller (KvCache) serializes access.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "proto/vocab/types.h"

namespace kvd {

class BlockAllocator {
 public:
  // One group: all `capacity_blocks` blocks start free.
  explicit BlockAllocator(int64_t capacity_blocks);
  // One group per entry, of that many blocks, laid end to end; all start free.
  explicit BlockAllocator(const std::vector<int64_t>& group_capacities);

  // `count` blocks of `group`. Returns RESOURCE_EXHAUSTED, and changes nothing, if fewer than
  // `count` blocks of the group are free.
  absl::StatusOr<std::vector<BlockIndex>> Allocate(int64_t count, int group = 0);
  // REQUIRES: every index came from Allocate() (or Claim()) and is not yet freed. Each goes back
  // to the free list of the group whose range holds it.
  void Free(absl::Span<const BlockIndex> indices);
  void Free(BlockIndex index);
  // Takes exactly `indices` out of the free set (a hot handoff re-creates blocks where the previous
  // process had them). INVALID_ARGUMENT, changing nothing, when one is out of range, repeated or
  // not free. O(capacity).
  absl::Status Claim(absl::Span<const BlockIndex> indices);

  int64_t num_free() const { return num_free_; }  // all groups
  int64_t num_free(int group) const { return static_cast<int64_t>(free_[group].size()); }
  int64_t capacity() const { return capacity_; }
  int num_groups() const { return static_cast<int>(first_.size()); }
  int64_t first_block(int group) const { return first_[group]; }
  int64_t group_capacity(int group) const { return capacity_of_[group]; }
  // The group whose range holds `index`. REQUIRES: index < capacity().
  int GroupOf(BlockIndex index) const;

 private:
  int64_t capacity_ = 0;
  int64_t num_free_ = 0;
  std::vector<int64_t> first_;
  std::vector<int64_t> capacity_of_;
  // Free blocks of each group as a stack: a just-freed block is handed out first (its pages are warm).
  std::vector<std::vector<BlockIndex>> free_;
};

}  // namespace kvd
