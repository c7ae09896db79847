// BudgetLedger accounts the KV bytes reserved by admitted requests and held by orphaned
// checkpoints against one global byte budget, and the blocks reserved per pool against each
// pool's capacity. Both limits hold at all times (invariant 6): a reservation that would pass
// either is refused and changes nothing.
//
// Why per pool too: the budget is global, but blocks come from one pool; if the reservations of
// one pool never exceed its capacity, every admitted request can always get its blocks (cached,
// unreferenced blocks are evictable and are not charged here).
// Thread-compatible: the caller serializes access.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "proto/vocab/types.h"

namespace kvd {

class BudgetLedger {
 public:
  struct PoolLimit {
    int64_t capacity_blocks = 0;
    int64_t block_bytes = 0;  // charged per reserved block (all shards)
  };
  BudgetLedger(int64_t budget_bytes, std::vector<PoolLimit> pools);

  // Whether `blocks` more blocks of `pool` fit under both limits.
  bool CanReserve(PoolId pool, int64_t blocks) const;
  // RESOURCE_EXHAUSTED, changing nothing, when CanReserve() is false.
  absl::Status Reserve(PoolId pool, int64_t blocks);
  // REQUIRES: at most what was reserved in `pool`.
  void Unreserve(PoolId pool, int64_t blocks);

  int64_t budget_bytes() const { return budget_bytes_; }
  int64_t reserved_bytes() const { return reserved_bytes_; }
  int64_t reserved_blocks(PoolId pool) const { return reserved_blocks_[pool]; }
  int64_t BytesOf(PoolId pool, int64_t blocks) const { return blocks * pools_[pool].block_bytes; }

 private:
  int64_t budget_bytes_;
  std::vector<PoolLimit> pools_;
  std::vector<int64_t> reserved_blocks_;
  int64_t reserved_bytes_ = 0;
};

}  // namespace kvd
