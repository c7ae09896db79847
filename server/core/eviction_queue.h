// EvictionQueue orders the evictable blocks of one pool: cached blocks that no request or
// checkpoint references and that have no cached children (leaves). Evicting a leaf may turn its
// parent into a leaf, which KvCache then pushes here, so a prefix is always evicted tail first.
//
// Blocks sit in one of three tiers, each ordered least recently used first by `last_use`:
//   kProbation  - cached blocks not reused since they were stored (all blocks under plain LRU),
//   kMain       - blocks that were reused, or re-stored soon after being evicted (SLRU policy),
//   kProtected  - blocks a session protects (soft: they go only when nothing else is left).
// Victims come from the lowest non-empty tier. Nothing scans the cache.
//
// Each tier is an intrusive doubly-linked list (links in the block) kept in (last_use, serial)
// order, plus an ordered spill for the blocks that cannot join it at either end. Recency ticks
// grow, so almost every Push is the newest (appended) or, for a parent re-queued after its leaf was
// evicted, the oldest (prepended): O(1), no allocation. A block that enters with a recency
// strictly inside the list's range (main's oldest moved to probation when main is full, a block a
// flush held and let go, a session's block changing tier) goes to the spill, a btree: O(log s) in
// the spill's size. The oldest of a tier is the older of the list's head and the spill's first, so
// the order is exactly that of one sorted set.
//
// Which unprotected block goes first depends on the order in force (set_order):
//   kRecency (LRU and SLRU) - the oldest probation block, unless main holds more than its share of
//     the unprotected queue (then main's oldest);
//   kHorizon (the horizon policy, docs/architecture.md "Eviction") - a block unused for longer than
//     its tier's horizon first (probation's oldest, then main's); otherwise the *newest* probation
//     block, then the newest main block. Ages count blocks stored in the pool since the block's
//     last use (`use_clock` against clock()), so the horizon scales with the pool, not with time.
// Both orders evict only queued leaves, so every invariant above holds under either.
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
  enum class Order : uint8_t { kRecency, kHorizon };

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
  // The most recently used block of one tier, or nullptr.
  CachedBlock* Newest(Tier tier) const;

  int64_t size() const { return size(kProbation) + size(kMain) + size(kProtected); }
  int64_t size(Tier tier) const {
    return lists_[tier].size + static_cast<int64_t>(spills_[tier].size());
  }
  // Queued blocks that sit in a spill rather than a list (for tests).
  int64_t spilled() const {
    return static_cast<int64_t>(spills_[0].size() + spills_[1].size() + spills_[2].size());
  }
  int64_t num_protected() const { return size(kProtected); }
  // SLRU: the share of the unprotected queue the main tier may keep before its own oldest block
  // is the victim (below it, probation goes first), and the most blocks main may hold at all
  // (Push demotes its oldest to probation past that). Default: 1.0 and unbounded.
  void set_main_limits(double share, int64_t max_blocks) {
    main_share_ = share;
    main_max_ = max_blocks;
  }

  // The pool's store clock: blocks stored in the pool so far. KvCache ticks it once per stored
  // block and stamps a block's use_clock with it whenever it stamps last_use.
  uint64_t clock() const { return clock_; }
  void TickClock() { ++clock_; }
  void set_clock(uint64_t clock) { clock_ = clock; }  // PolicyDuel's shadows follow the pool's
  // kHorizon: how many stored blocks may pass since a probation / main block's last use before it
  // is overdue.
  void set_horizons(int64_t probation_blocks, int64_t main_blocks) {
    probation_horizon_ = probation_blocks;
    main_horizon_ = main_blocks;
  }
  void set_order(Order order) { order_ = order; }
  Order order() const { return order_; }

 private:
  CachedBlock* UnprotectedVictim() const;
  CachedBlock* HorizonVictim() const;
  bool Overdue(const CachedBlock* block, int64_t horizon) const {
    return block != nullptr && static_cast<uint32_t>(clock_ - block->use_clock) > horizon;
  }
  using Key = std::pair<uint64_t, uint64_t>;  // (last_use, serial)
  static Key KeyOf(const CachedBlock* b) { return Key{b->last_use, b->serial}; }
  struct List {  // intrusive, oldest first, in Key order
    CachedBlock* head = nullptr;
    CachedBlock* tail = nullptr;
    int64_t size = 0;
  };
  void Insert(CachedBlock* block);
  double main_share_ = 1.0;
  int64_t main_max_ = std::numeric_limits<int64_t>::max();
  uint64_t clock_ = 0;
  int64_t probation_horizon_ = std::numeric_limits<uint32_t>::max();
  int64_t main_horizon_ = std::numeric_limits<uint32_t>::max();
  Order order_ = Order::kRecency;
  List lists_[3];
  absl::btree_map<Key, CachedBlock*> spills_[3];
};

}  // namespace kvd
