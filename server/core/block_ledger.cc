#include "server/core/block_ledger.h"

#include "absl/strings/str_cat.h"

namespace kvd {

std::string OwnerKindName(OwnerKind kind) {
  switch (kind) {
    case OwnerKind::kRequest: return "request";
    case OwnerKind::kCredit: return "credit";
    case OwnerKind::kPin: return "pin";
    case OwnerKind::kPull: return "pull";
    case OwnerKind::kFence: return "fence";
  }
  return "unknown";
}

namespace {

std::string Describe(const Owner& o) {
  return absl::StrCat(OwnerKindName(o.kind), " of '", o.attachment.value(), "' (epoch ", o.epoch, ")");
}

}  // namespace

void BlockLedger::AddPool(int64_t capacity_blocks) {
  writer_.emplace_back(static_cast<size_t>(capacity_blocks), 0);
}

absl::Status BlockLedger::CheckBlock(PoolId pool, BlockIndex block) const {
  if (pool >= writer_.size() || block >= writer_[pool].size()) {
    return absl::InvalidArgumentError(absl::StrCat("block ", block, " of pool ", pool, " is out of range"));
  }
  return absl::OkStatus();
}

absl::Status BlockLedger::Assign(PoolId pool, BlockIndex block, const Owner& to) {
  if (absl::Status s = CheckBlock(pool, block); !s.ok()) return s;
  if (to.epoch == 0) return absl::InvalidArgumentError("an owner's epoch is > 0");
  uint64_t& slot = writer_[pool][block];
  if (slot != 0) {
    return absl::FailedPreconditionError(absl::StrCat("block ", block, " of pool ", pool, " is held by ",
                                                      Describe(owners_.at(slot).owner), "; ",
                                                      Describe(to), " cannot take it"));
  }
  auto [it, added] = owners_.try_emplace(to.epoch);
  if (added) {
    it->second.owner = to;
    it->second.pool = pool;
  } else if (!(it->second.owner == to) || it->second.pool != pool) {
    return absl::InvalidArgumentError(absl::StrCat("epoch ", to.epoch, " is ", Describe(it->second.owner),
                                                   " in pool ", it->second.pool));
  }
  it->second.blocks.insert(block);
  slot = to.epoch;
  ++num_owned_;
  return absl::OkStatus();
}

absl::Status BlockLedger::Release(PoolId pool, BlockIndex block, const Owner& from) {
  if (absl::Status s = CheckBlock(pool, block); !s.ok()) return s;
  uint64_t& slot = writer_[pool][block];
  auto it = owners_.find(slot);
  if (slot == 0 || it == owners_.end() || !(it->second.owner == from)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "block ", block, " of pool ", pool, " is ",
        slot == 0 || it == owners_.end() ? std::string("unowned") : "held by " + Describe(it->second.owner),
        ", not by ", Describe(from)));
  }
  it->second.blocks.erase(block);
  if (it->second.blocks.empty()) owners_.erase(it);
  slot = 0;
  --num_owned_;
  return absl::OkStatus();
}

absl::Status BlockLedger::Transfer(PoolId pool, BlockIndex block, const Owner& from, const Owner& to) {
  if (absl::Status s = CheckBlock(pool, block); !s.ok()) return s;
  const uint64_t slot = writer_[pool][block];
  auto it = owners_.find(slot);
  if (slot == 0 || it == owners_.end() || !(it->second.owner == from)) return Release(pool, block, from);
  if (auto t = owners_.find(to.epoch); to.epoch == 0 || (t != owners_.end() && (!(t->second.owner == to) || t->second.pool != pool))) {
    return absl::InvalidArgumentError(absl::StrCat("cannot transfer block ", block, " to ", Describe(to)));
  }
  absl::Status released = Release(pool, block, from);
  if (!released.ok()) return released;
  return Assign(pool, block, to);
}

const Owner* BlockLedger::OwnerOf(PoolId pool, BlockIndex block) const {
  const uint64_t slot = writer_[pool][block];
  if (slot == 0) return nullptr;
  auto it = owners_.find(slot);
  return it == owners_.end() ? nullptr : &it->second.owner;
}

const absl::flat_hash_set<BlockIndex>& BlockLedger::BlocksOf(uint64_t epoch) const {
  static const absl::flat_hash_set<BlockIndex>* const kNone = new absl::flat_hash_set<BlockIndex>();
  auto it = owners_.find(epoch);
  return it == owners_.end() ? *kNone : it->second.blocks;
}

const Owner* BlockLedger::Find(uint64_t epoch) const {
  auto it = owners_.find(epoch);
  return it == owners_.end() ? nullptr : &it->second.owner;
}

void BlockLedger::ForEach(const std::function<void(PoolId, BlockIndex, const Owner&)>& fn) const {
  for (PoolId p = 0; p < writer_.size(); ++p) {
    for (BlockIndex b = 0; b < writer_[p].size(); ++b) {
      if (writer_[p][b] != 0) fn(p, b, owners_.at(writer_[p][b]).owner);
    }
  }
}

void BlockLedger::ForEachOwner(
    const std::function<void(const Owner&, PoolId, const absl::flat_hash_set<BlockIndex>&)>& fn) const {
  for (const auto& [epoch, r] : owners_) fn(r.owner, r.pool, r.blocks);
}

}  // namespace kvd
