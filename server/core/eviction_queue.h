// EvictionQueue orders the evictable blocks of one pool: cached blocks that no request or
// checkpoint references and that have no cached children (leaves). Evicting a leaf may turn its
// parent into a leaf, which KvCache then pushes here, so a prefix is always evicted tail first.
//
// Order is least recently used first, by each block's `last_use` tick. Blocks that a session
// protects sit in a second, softly protected tier: they go only when no unprotected block is left.
// Push, Remove and Pop are O(log n) in the number of queued blocks; nothing scans the cache.
// Thread-compatible: the caller serializes access.
#pragma once

#include <cstdint>
#include <utility>

#include "absl/container/btree_map.h"
#include "server/core/prefix_index.h"

namespace kvd {

class EvictionQueue {
 public:
  // REQUIRES: !block->queued. Files the block by its protect_count and last_use.
  void Push(CachedBlock* block);
  // No-op when the block is not queued.
  void Remove(CachedBlock* block);
  // The next victim (oldest unprotected, else oldest protected), still queued; nullptr if empty.
  CachedBlock* Peek() const;
  // The oldest unprotected block, or nullptr.
  CachedBlock* PeekUnprotected() const;

  int64_t size() const { return static_cast<int64_t>(unprotected_.size() + protected_.size()); }
  int64_t num_protected() const { return static_cast<int64_t>(protected_.size()); }

 private:
  using Order = std::pair<uint64_t, uint64_t>;  // (last_use, serial)
  absl::btree_map<Order, CachedBlock*> unprotected_;
  absl::btree_map<Order, CachedBlock*> protected_;
};

}  // namespace kvd
