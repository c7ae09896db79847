// BlockAllocator hands out the free blocks of one pool. It never touches block contents and knows
// nothing of caching: a block is either free (here) or handed out (the caller's).
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
  // All `capacity_blocks` blocks start free.
  explicit BlockAllocator(int64_t capacity_blocks);

  // Returns RESOURCE_EXHAUSTED, and changes nothing, if fewer than `count` blocks are free.
  absl::StatusOr<std::vector<BlockIndex>> Allocate(int64_t count);
  // REQUIRES: every index came from Allocate() and is not yet freed.
  void Free(absl::Span<const BlockIndex> indices);
  void Free(BlockIndex index);
  // Takes exactly `indices` out of the free set (a hot handoff re-creates blocks where the previous
  // process had them). INVALID_ARGUMENT, changing nothing, when one is out of range, repeated or
  // not free. O(capacity).
  absl::Status Claim(absl::Span<const BlockIndex> indices);

  int64_t num_free() const { return static_cast<int64_t>(free_.size()); }
  int64_t capacity() const { return capacity_; }

 private:
  int64_t capacity_;
  // Free blocks as a stack: a just-freed block is handed out first (its pages are warm).
  std::vector<BlockIndex> free_;
};

}  // namespace kvd
