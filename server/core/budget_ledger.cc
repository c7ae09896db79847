#include "server/core/budget_ledger.h"

#include "absl/strings/str_cat.h"
#include "proto/vocab/status_macros.h"

namespace kvd {

BudgetLedger::BudgetLedger(int64_t budget_bytes, std::vector<PoolLimit> pools)
    : budget_bytes_(budget_bytes), pools_(std::move(pools)), reserved_blocks_(pools_.size(), 0) {
  for (const PoolLimit& p : pools_) reserved_units_.emplace_back(p.groups.size(), 0);
}

bool BudgetLedger::CanReserve(PoolId pool, int64_t blocks) const {
  if (blocks < 0) return false;
  if (hybrid(pool)) return blocks == 0;
  return reserved_blocks_[pool] + blocks <= pools_[pool].capacity_blocks &&
         reserved_bytes_ + BytesOf(pool, blocks) <= budget_bytes_;
}

absl::Status BudgetLedger::Reserve(PoolId pool, int64_t blocks) {
  if (!CanReserve(pool, blocks)) {
    if (hybrid(pool)) {
      return absl::FailedPreconditionError("KV budget: a hybrid pool reserves per group, not by block count");
    }
    return absl::ResourceExhaustedError(absl::StrCat(
        "KV budget: ", BytesOf(pool, blocks), " more bytes do not fit (reserved ", reserved_bytes_,
        " of ", budget_bytes_, " bytes; pool reserved ", reserved_blocks_[pool], " of ",
        pools_[pool].capacity_blocks, " blocks)"));
  }
  reserved_blocks_[pool] += blocks;
  reserved_bytes_ += BytesOf(pool, blocks);
  return absl::OkStatus();
}

void BudgetLedger::Unreserve(PoolId pool, int64_t blocks) {
  KVD_CHECK(blocks >= 0 && blocks <= reserved_blocks_[pool]);
  KVD_CHECK(!hybrid(pool) || blocks == 0);
  reserved_blocks_[pool] -= blocks;
  reserved_bytes_ -= BytesOf(pool, blocks);
}

int64_t BudgetLedger::BytesOfUnits(PoolId pool, absl::Span<const int64_t> units) const {
  int64_t bytes = 0;
  for (size_t g = 0; g < units.size() && g < pools_[pool].groups.size(); ++g) {
    bytes += units[g] * pools_[pool].groups[g].unit_bytes;
  }
  return bytes;
}

bool BudgetLedger::CanReserveUnits(PoolId pool, absl::Span<const int64_t> units) const {
  const PoolLimit& p = pools_[pool];
  if (units.size() != p.groups.size()) return false;
  for (size_t g = 0; g < units.size(); ++g) {
    if (units[g] < 0 || reserved_units_[pool][g] + units[g] > p.groups[g].capacity) return false;
  }
  return reserved_bytes_ + BytesOfUnits(pool, units) <= budget_bytes_;
}

absl::Status BudgetLedger::ReserveUnits(PoolId pool, absl::Span<const int64_t> units) {
  const PoolLimit& p = pools_[pool];
  if (units.size() != p.groups.size()) {
    return absl::InvalidArgumentError(absl::StrCat("KV budget: ", units.size(), " groups named; pool has ", p.groups.size()));
  }
  for (size_t g = 0; g < units.size(); ++g) {
    if (units[g] < 0) return absl::InvalidArgumentError("KV budget: negative units");
    if (reserved_units_[pool][g] + units[g] > p.groups[g].capacity) {
      return absl::ResourceExhaustedError(absl::StrCat("KV budget: group ", g, " reserved ", reserved_units_[pool][g],
                                                       " of ", p.groups[g].capacity, " units; ", units[g],
                                                       " more do not fit"));
    }
  }
  const int64_t bytes = BytesOfUnits(pool, units);
  if (reserved_bytes_ + bytes > budget_bytes_) {
    return absl::ResourceExhaustedError(absl::StrCat("KV budget: ", bytes, " more bytes do not fit (reserved ",
                                                     reserved_bytes_, " of ", budget_bytes_, " bytes)"));
  }
  for (size_t g = 0; g < units.size(); ++g) {
    reserved_units_[pool][g] += units[g];
    reserved_blocks_[pool] += units[g];
  }
  reserved_bytes_ += bytes;
  return absl::OkStatus();
}

void BudgetLedger::UnreserveUnits(PoolId pool, absl::Span<const int64_t> units) {
  KVD_CHECK(units.size() == pools_[pool].groups.size());
  for (size_t g = 0; g < units.size(); ++g) {
    KVD_CHECK(units[g] >= 0 && units[g] <= reserved_units_[pool][g]);
    reserved_units_[pool][g] -= units[g];
    reserved_blocks_[pool] -= units[g];
  }
  reserved_bytes_ -= BytesOfUnits(pool, units);
}

}  // namespace kvd
