#include "server/core/budget_ledger.h"

#include "absl/strings/str_cat.h"
#include "proto/vocab/status_macros.h"

namespace kvd {

BudgetLedger::BudgetLedger(int64_t budget_bytes, std::vector<PoolLimit> pools)
    : budget_bytes_(budget_bytes), pools_(std::move(pools)), reserved_blocks_(pools_.size(), 0) {}

bool BudgetLedger::CanReserve(PoolId pool, int64_t blocks) const {
  if (blocks < 0) return false;
  return reserved_blocks_[pool] + blocks <= pools_[pool].capacity_blocks &&
         reserved_bytes_ + BytesOf(pool, blocks) <= budget_bytes_;
}

absl::Status BudgetLedger::Reserve(PoolId pool, int64_t blocks) {
  if (!CanReserve(pool, blocks)) {
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
  reserved_blocks_[pool] -= blocks;
  reserved_bytes_ -= BytesOf(pool, blocks);
}

}  // namespace kvd
