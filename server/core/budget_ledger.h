// BudgetLedger accounts the KV bytes reserved by admitted requests and held by orphaned
// checkpoints against one global byte budget, and the units reserved per pool group against
// each group's capacity. Both limits hold at all times (invariant 6): a reservation that would
// pass either is refused and changes nothing.
//
// Why per group too: the budget is global, but blocks come from one group of one pool; if the
// reservations of a group never exceed its capacity, every admitted request can always get its
// blocks (cached, unreferenced blocks are evictable and are not charged here).
//
// A pool without KV groups is one group of every block, charged `block_bytes` per block: the
// count-based calls (CanReserve, Reserve, Unreserve, BytesOf) are for such pools. A hybrid pool
// (docs/hybrid.md §2.5) charges each unit of group g its own `unit_bytes` (all shards), through
// the per-group calls (*Units); the count-based calls refuse any non-zero count there.
// Thread-compatible: the caller serializes access.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "proto/vocab/types.h"

namespace kvd {

class BudgetLedger {
 public:
  struct GroupLimit {
    int64_t capacity = 0;    // units (blocks or slots)
    int64_t unit_bytes = 0;  // charged per reserved unit (all shards)
  };
  struct PoolLimit {
    int64_t capacity_blocks = 0;
    int64_t block_bytes = 0;  // charged per reserved block (all shards); pools without groups
    std::vector<GroupLimit> groups;  // hybrid pools only; empty otherwise
  };
  BudgetLedger(int64_t budget_bytes, std::vector<PoolLimit> pools);

  // Pools without groups: whether `blocks` more blocks of `pool` fit under both limits (a hybrid
  // pool: only for 0).
  bool CanReserve(PoolId pool, int64_t blocks) const;
  // RESOURCE_EXHAUSTED, changing nothing, when CanReserve() is false.
  absl::Status Reserve(PoolId pool, int64_t blocks);
  // REQUIRES: at most what was reserved in `pool`.
  void Unreserve(PoolId pool, int64_t blocks);

  // Hybrid pools: `units[g]` more units of each group g (units.size() == the pool's groups).
  bool CanReserveUnits(PoolId pool, absl::Span<const int64_t> units) const;
  // RESOURCE_EXHAUSTED naming the first limit passed, changing nothing.
  absl::Status ReserveUnits(PoolId pool, absl::Span<const int64_t> units);
  // REQUIRES: at most what was reserved in each group.
  void UnreserveUnits(PoolId pool, absl::Span<const int64_t> units);
  int64_t BytesOfUnits(PoolId pool, absl::Span<const int64_t> units) const;

  int64_t budget_bytes() const { return budget_bytes_; }
  int64_t reserved_bytes() const { return reserved_bytes_; }
  // Blocks (a hybrid pool: units of all groups) reserved in `pool`.
  int64_t reserved_blocks(PoolId pool) const { return reserved_blocks_[pool]; }
  int64_t reserved_units(PoolId pool, int group) const { return reserved_units_[pool][group]; }
  int64_t BytesOf(PoolId pool, int64_t blocks) const { return blocks * pools_[pool].block_bytes; }
  bool hybrid(PoolId pool) const { return !pools_[pool].groups.empty(); }

 private:
  int64_t budget_bytes_;
  std::vector<PoolLimit> pools_;
  std::vector<int64_t> reserved_blocks_;
  std::vector<std::vector<int64_t>> reserved_units_;  // hybrid pools: per group
  int64_t reserved_bytes_ = 0;
};

}  // namespace kvd
