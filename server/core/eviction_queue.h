// EvictionQueue orders the evictable blocks of one pool: cached blocks that no request or
// checkpoint references and that have no cached children (leaves). Evicting a leaf may turn its
// parent into a leaf, which KvCache then pushes here, so a prefix is always evicted tail first.
//
// Blocks sit in one of three tiers, each ordered least recently used first by `last_use`:
//   kProbation  - cached blocks not reused since they were stored (all blocks under plain LRU),
//   kMain       - blocks that were reused, or re-stored soon after being evicted (SLRU policy),
//   kProtected  - blocks a session protects (soft: they go only when nothing else is left).
// Victims come from the lowest non-empty tier. Push, Remove and Peek are O(log n) in the number
// of queued blocks; nothing scans the cache. Between probation and main, the victim is the oldest
// probation block unless main holds more than its share of the unprotected queue.
// Thread-compatible: the caller serializes access.
#pragma once

#include <cstdint>
#include <limits>
#include <utility>

#include "absl/container/btree_map.h"
#include "server/core/prefix_index.h"

namespace kvd {

class EvictionQueue {
 public:
  enum Tier : uint8_t { kProbation = 0, kMain = 1, kProtected = 2 };

  // REQUIRES: !block->queued. Files the block by protect_count (kProtected), reused (kMain) and
  // last_use.
  void Push(CachedBlock* block);
  // No-op when the block is not queued.
  void Remove(CachedBlock* block);
  // The next victim (oldest of the lowest non-empty tier), still queued; nullptr if empty.
  CachedBlock* Peek() const;
  // The oldest block that no session protects, or nullptr.
  CachedBlock* PeekUnprotected() const;
  // The oldest block of one tier, or nullptr.
  CachedBlock* Oldest(Tier tier) const;

  int64_t size() const { return size(kProbation) + size(kMain) + size(kProtected); }
  int64_t size(Tier tier) const { return static_cast<int64_t>(tiers_[tier].size()); }
  int64_t num_protected() const { return size(kProtected); }
  // SLRU: the share of the unprotected queue the main tier may keep before its own oldest block
  // is the victim (below it, probation goes first), and the most blocks main may hold at all
  // (Push demotes its oldest to probation past that). Default: 1.0 and unbounded.
  void set_main_limits(double share, int64_t max_blocks) {
    main_share_ = share;
    main_max_ = max_blocks;
  }

 private:
  CachedBlock* UnprotectedVictim() const;
  void Insert(CachedBlock* block);
  double main_share_ = 1.0;
  int64_t main_max_ = std::numeric_limits<int64_t>::max();
  using Order = std::pair<uint64_t, uint64_t>;  // (last_use, serial)
  absl::btree_map<Order, CachedBlock*> tiers_[3];
};

}  // namespace kvd
