// KvCache::Step: one scheduler step of one worker under one acquisition of the lock, and the
// worker's block credit (proto/vocab/step_types.h states what credit is and promises).
#include <algorithm>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "proto/vocab/status_macros.h"
#include "server/core/kv_cache.h"

namespace kvd {

std::vector<StepOpResult> KvCache::Step(const WorkerId& worker, const WorkerId& principal,
                                        std::vector<StepOp> ops, absl::Span<const CreditWant> credit,
                                        std::vector<CreditHeld>* held) {
  std::vector<StepOpResult> out(ops.size());
  {
    absl::MutexLock lock(&mu_);
    ExpireLocked(nullptr);
    for (size_t i = 0; i < ops.size(); ++i) out[i] = ApplyStepOpLocked(worker, ops[i]);
    absl::flat_hash_map<std::pair<PoolId, int>, int64_t> wanted;
    for (const CreditWant& want : credit) wanted[{want.pool, want.group}] = SetCreditLocked(worker, principal, want);
    if (held != nullptr) {
      held->clear();
      if (auto it = credit_.find(worker); it != credit_.end()) {
        for (const auto& [pool, pc] : it->second.pools) {
          // One ledger owner holds a pool's credit; a hybrid pool's is answered per group.
          absl::flat_hash_map<int, std::vector<BlockIndex>> by_group;
          for (BlockIndex b : owners_.BlocksOf(pc.serial)) {
            by_group[pools_[pool]->geometry.hybrid() ? pools_[pool]->allocator.GroupOf(b) : 0].push_back(b);
          }
          for (auto& [g, blocks] : by_group) {
            auto w = wanted.find({pool, g});
            std::sort(blocks.begin(), blocks.end());
            held->push_back(CreditHeld{pool, std::move(blocks), w == wanted.end() ? 0 : w->second, g});
          }
        }
      }
      std::sort(held->begin(), held->end(), [](const CreditHeld& a, const CreditHeld& b) {
        return std::make_pair(a.pool, a.group) < std::make_pair(b.pool, b.group);
      });
    }
    UpdatePressureLocked();
  }
  Deliver();
  return out;
}

int64_t KvCache::CreditBlocks(const WorkerId& worker, PoolId pool) const {
  absl::MutexLock lock(&mu_);
  const cache_state::PoolCredit* pc = FindCreditLocked(worker, pool);
  return pc == nullptr ? 0 : static_cast<int64_t>(owners_.BlocksOf(pc->serial).size());
}

int64_t KvCache::DropCredit(const WorkerId& worker) {
  std::vector<CreditHeld> taken;
  {
    absl::MutexLock lock(&mu_);
    DropCreditLocked(worker, &taken);
    UpdatePressureLocked();
  }
  Deliver();
  int64_t n = 0;
  for (const CreditHeld& c : taken) n += static_cast<int64_t>(c.blocks.size());
  return n;
}

const cache_state::PoolCredit* KvCache::FindCreditLocked(const WorkerId& worker, PoolId pool) const {
  auto w = credit_.find(worker);
  if (w == credit_.end()) return nullptr;
  auto p = w->second.pools.find(pool);
  return p == w->second.pools.end() ? nullptr : &p->second;
}

absl::Status KvCache::CheckCreditForTesting(const WorkerId& worker, PoolId pool,
                                            absl::Span<const BlockIndex> believed) const {
  absl::MutexLock lock(&mu_);
  const cache_state::PoolCredit* pc = FindCreditLocked(worker, pool);
  for (BlockIndex b : believed) {
    if (pool >= pools_.size() || b >= pools_[pool]->blocks.size()) {
      return absl::InternalError(absl::StrCat("block ", b, " of pool ", pool, " does not exist"));
    }
    const Owner* o = owners_.OwnerOf(pool, b);
    if (pc == nullptr || o == nullptr || o->kind != OwnerKind::kCredit || o->epoch != pc->serial ||
        o->attachment != worker) {
      return absl::InternalError(absl::StrCat(
          "block ", b, " that worker ", worker.value(), " placed or holds as credit is ",
          o == nullptr ? std::string("not owned in the ledger")
                       : absl::StrCat("held by ", OwnerKindName(o->kind), " of '", o->attachment.value(), "'"),
          "; its BlockState is ", static_cast<int>(pools_[pool]->blocks[b].kind)));
    }
  }
  return absl::OkStatus();
}

StepOpResult KvCache::ApplyStepOpLocked(const WorkerId& worker, StepOp& op) {
  StepOpResult r;
  absl::StatusOr<Request*> found = FindRequestLocked(op.id);
  if (!found.ok()) {
    r.status = found.status();
    return r;
  }
  Request& req = **found;
  if (req.spec.owner != worker) {
    r.status = absl::PermissionDeniedError(absl::StrCat("request '", op.id.value(), "' belongs to another worker"));
    return r;
  }
  switch (op.kind) {
    case StepOpKind::kGrow: {
      absl::StatusOr<std::vector<BlockIndex>> grown =
          GrowLocked(op.id, op.tokens, op.credit_blocks, op.computed_tokens, &r.group_tables, op.credit_groups);
      if (grown.ok()) r.blocks = *std::move(grown);
      else r.status = grown.status();
      break;
    }
    case StepOpKind::kPublish: {
      if (op.num_blocks < 0 || op.num_blocks > static_cast<int64_t>(req.table.size())) {
        r.status = absl::InvalidArgumentError(absl::StrCat("publish of ", op.num_blocks, " blocks; request '",
                                                           op.id.value(), "' holds ", req.table.size()));
        break;
      }
      const std::vector<BlockIndex> blocks(req.table.begin(), req.table.begin() + op.num_blocks);
      absl::StatusOr<PublishResult> p = PublishLocked(op.id, op.token_ids, blocks, /*by_pull=*/false, op.state_checkpoints);
      if (p.ok()) r.publish = *std::move(p);
      else r.status = p.status();
      break;
    }
    case StepOpKind::kCheckpoint:
      r.status = CheckpointLocked(op.id, op.token_ids, std::move(op.engine_state), op.state_checkpoints,
                                  /*ending=*/false, &r.publish.fresh_slots);
      break;
    case StepOpKind::kEnd: {
      absl::StatusOr<PublishResult> p = EndLocked(op.id, op.num_blocks, op.token_ids, op.completed, op.state_checkpoints);
      if (p.ok()) r.publish = *std::move(p);
      else r.status = p.status();
      break;
    }
    case StepOpKind::kPreempt:
      // The checkpoint first: when it fails, the request is still live and unchanged. On a hybrid
      // pool its state slots pass to the record (no fresh spare: the request ends), and the
      // release returns every group's reservation before the record is charged its units.
      if (!op.token_ids.empty()) {
        r.status = CheckpointLocked(op.id, op.token_ids, std::move(op.engine_state), op.state_checkpoints,
                                    /*ending=*/true, &r.publish.fresh_slots);
      } else if (!op.state_checkpoints.empty()) {
        r.status = absl::InvalidArgumentError("state_checkpoints: a preempt without tokens keeps no checkpoint");
      }
      if (r.status.ok()) {
        ReleaseLocked(req, /*completed=*/false);
        requests_.erase(op.id);
      }
      break;
  }
  return r;
}

absl::StatusOr<std::vector<BlockIndex>> KvCache::GrowLocked(const RequestId& id, int64_t additional_tokens,
                                                           absl::Span<const BlockIndex> credit,
                                                           int64_t computed_tokens, std::vector<GroupTable>* groups,
                                                           absl::Span<const int> credit_groups) {
  KVD_ASSIGN_OR_RETURN(Request * req, FindRequestLocked(id));
  if (additional_tokens < 0) return absl::InvalidArgumentError("additional_tokens must be >= 0");
  if (!req->acquired) {
    return absl::FailedPreconditionError(
        absl::StrCat("request '", id.value(), "' must Acquire before Extend"));
  }
  Pool& pool = *pools_[req->pool];
  // Compared before adding: a wire value near INT64_MAX must not wrap the sum.
  if (additional_tokens > pool.geometry.max_model_len - req->num_tokens) {
    return absl::OutOfRangeError(absl::StrCat("request has ", req->num_tokens, " tokens; ",
                                              additional_tokens, " more would pass max_model_len ",
                                              pool.geometry.max_model_len));
  }
  if (pool.geometry.hybrid()) {
    KVD_ASSIGN_OR_RETURN(std::vector<GroupTable> tables,
                         GrowGroupsLocked(*req, additional_tokens, computed_tokens, credit, credit_groups));
    std::vector<BlockIndex> spine;
    if (pool.spine_group >= 0) spine = tables[pool.spine_group].blocks;
    if (groups != nullptr) *groups = std::move(tables);
    return spine;
  }
  if (!credit_groups.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("credit: pool '", pool.geometry.name,
                                                   "' has no KV groups; a grow names credit_blocks"));
  }
  const int64_t new_tokens = req->num_tokens + additional_tokens;
  const int64_t have = static_cast<int64_t>(req->table.size());
  const int64_t needed = std::max<int64_t>(0, pool.geometry.BlocksFor(new_tokens) - have);
  const int64_t given = static_cast<int64_t>(credit.size());
  if (given > needed) {
    return absl::InvalidArgumentError(absl::StrCat("growing request '", id.value(), "' by ", additional_tokens,
                                                   " positions takes ", needed, " new blocks, not the ", given,
                                                   " credit blocks named"));
  }
  const cache_state::PoolCredit* pc = given > 0 ? FindCreditLocked(req->spec.owner, req->pool) : nullptr;
  if (given > 0) {
    const absl::flat_hash_set<BlockIndex>* mine = pc != nullptr ? &owners_.BlocksOf(pc->serial) : nullptr;
    for (int64_t i = 0; i < given; ++i) {
      const BlockIndex b = credit[i];
      const bool held = mine != nullptr && mine->contains(b);
      if (!held || std::find(credit.begin(), credit.begin() + i, b) != credit.begin() + i) {
        return absl::InvalidArgumentError(absl::StrCat("block ", b, " is not in this worker's credit in pool '",
                                                       pool.geometry.name, "' (used twice, or never granted)"));
      }
    }
  }
  // The reservation grows by `grow` blocks; each credit block is charged already and pays for one.
  // It covers the request's own copies of duplicates too (kv_cache_publish.cc).
  const int64_t copies = static_cast<int64_t>(req->own_copies.size());
  const int64_t grow = std::max<int64_t>(0, have + copies + needed - req->reserved_blocks);
  const int64_t from_credit = std::min(grow, given);
  const int64_t extra = grow - from_credit;
  const WorkerId principal = pc != nullptr ? credit_[req->spec.owner].principal : req->spec.limit_key();
  const int64_t moved = principal == req->spec.limit_key() ? 0 : from_credit;
  if (!ledger_.CanReserve(req->pool, extra)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "request '", id.value(), "' needs ", extra, " blocks past its reservation; the budget is full"));
  }
  KVD_RETURN_IF_ERROR(CheckWorkerLimitsLocked(req->spec.limit_key(), 0, ledger_.BytesOf(req->pool, extra + moved)));
  const Owner writer = WriterOf(*req);
  KVD_ASSIGN_OR_RETURN(std::vector<BlockIndex> owned,
                       AllocateOwnedLocked(req->pool, needed - given, req->serial, &writer));
  std::vector<BlockIndex> appended(credit.begin(), credit.end());
  if (given > 0) {
    // The worker named them: its credit gives them to its request (one reference, from the credit
    // to the table; one writer, the same worker, now under the request's epoch).
    const Owner from{OwnerKind::kCredit, req->spec.owner, pc->serial};
    for (BlockIndex b : credit) {
      KVD_CHECK(owners_.Transfer(req->pool, b, from, writer).ok());
      pool.blocks[b].owner = req->serial;
    }
    cache_state::WorkerCredit& wc = credit_[req->spec.owner];
    if (owners_.BlocksOf(pc->serial).empty()) wc.pools.erase(req->pool);
    if (wc.pools.empty()) credit_.erase(req->spec.owner);
  }
  ledger_.Unreserve(req->pool, given - from_credit);
  KVD_CHECK(ledger_.Reserve(req->pool, extra).ok());
  workers_.AddUsage(principal, 0, -ledger_.BytesOf(req->pool, given));
  workers_.AddUsage(req->spec.limit_key(), 0, ledger_.BytesOf(req->pool, grow));
  req->reserved_blocks += grow;
  req->num_tokens = new_tokens;
  appended.insert(appended.end(), owned.begin(), owned.end());
  req->table.insert(req->table.end(), appended.begin(), appended.end());
  UpdatePressureLocked();
  return appended;
}

int64_t KvCache::SetCreditLocked(const WorkerId& worker, const WorkerId& principal, const CreditWant& want) {
  if (want.pool >= pools_.size()) return 0;
  Pool& pool = *pools_[want.pool];
  // A hybrid pool's credit is per (pool, group): blocks of group g's range, charged as g's units
  // (docs/hybrid.md §2.4-2.5). Elsewhere the pool is one group, 0.
  const bool hybrid = pool.geometry.hybrid();
  const int g = want.group;
  if (g < 0 || g >= (hybrid ? static_cast<int>(pool.geometry.groups.size()) : 1)) return 0;
  const int64_t capacity = hybrid ? pool.geometry.groups[g].capacity : pool.geometry.capacity_blocks;
  const auto units = [&](int64_t n) {
    std::vector<int64_t> u(pool.geometry.groups.size(), 0);
    u[g] = n;
    return u;
  };
  const auto bytes = [&](int64_t n) {
    mu_.AssertHeld();
    return hybrid ? ledger_.BytesOfUnits(want.pool, units(n)) : ledger_.BytesOf(want.pool, n);
  };
  const auto can_reserve = [&](int64_t n) {
    mu_.AssertHeld();
    return hybrid ? ledger_.CanReserveUnits(want.pool, units(n)) : ledger_.CanReserve(want.pool, n);
  };
  // A worker's credit never takes more than an eighth of a pool (of a group): it is budget no
  // request holds.
  int64_t target = std::clamp<int64_t>(want.blocks, 0, std::min(options_.step_credit_blocks, capacity / 8));
  if (pressure_.level() == PressureLevel::kCritical) target = 0;
  else if (pressure_.level() == PressureLevel::kHigh) target /= 4;
  cache_state::WorkerCredit& wc = credit_[worker];
  if (wc.principal.empty()) wc.principal = principal;
  cache_state::PoolCredit& pc = wc.pools[want.pool];
  if (pc.serial == 0) pc.serial = next_serial_++;
  const Owner me{OwnerKind::kCredit, worker, pc.serial};
  // Returned by name: the worker says it placed none of them. A block it does not hold (adopted by
  // a grow, named twice, never granted) is skipped; the answer lists what it holds.
  int64_t back = 0;
  for (BlockIndex b : want.returned) {
    if (b >= pool.blocks.size() || (hybrid && pool.allocator.GroupOf(b) != g)) continue;
    if (!owners_.Release(want.pool, b, me).ok()) continue;
    UnrefLocked(want.pool, b);
    ++back;
  }
  if (back > 0) {
    if (hybrid) ledger_.UnreserveUnits(want.pool, units(back));
    else ledger_.Unreserve(want.pool, back);
    workers_.AddUsage(wc.principal, 0, -bytes(back));
  }
  int64_t have = 0;
  if (!hybrid) {
    have = static_cast<int64_t>(owners_.BlocksOf(pc.serial).size());
  } else {
    for (BlockIndex b : owners_.BlocksOf(pc.serial)) have += pool.allocator.GroupOf(b) == g ? 1 : 0;
  }
  int64_t wanted = 0;
  if (have > target) {
    // Never taken here: the worker may be placing any of them into a request at this moment
    // (client/client_step.cc places credit with no round trip). Asked back instead.
    wanted = have - target;
  } else if (have < target) {
    int64_t n = target - have;
    // As much as fits now: the budget (so every admitted request still gets its blocks), the
    // worker's limits, and the blocks free or reclaimable.
    const int64_t reclaimable = hybrid ? pool.allocator.num_free(g) + pool.EvictableIn(g)
                                       : pool.allocator.num_free() + pool.num_cached_unreferenced;
    while (n > 0 && (!can_reserve(n) || !CheckWorkerLimitsLocked(wc.principal, 0, bytes(n)).ok() || n > reclaimable)) {
      n /= 2;
    }
    if (n > 0) {
      absl::StatusOr<std::vector<BlockIndex>> got = AllocateOwnedLocked(want.pool, n, pc.serial, &me, g);
      KVD_CHECK(got.ok());
      if (hybrid) KVD_CHECK(ledger_.ReserveUnits(want.pool, units(n)).ok());
      else KVD_CHECK(ledger_.Reserve(want.pool, n).ok());
      workers_.AddUsage(wc.principal, 0, bytes(n));
    }
  }
  if (owners_.BlocksOf(pc.serial).empty()) wc.pools.erase(want.pool);
  if (wc.pools.empty()) credit_.erase(worker);
  return wanted;
}

void KvCache::DropCreditLocked(const WorkerId& worker, std::vector<CreditHeld>* taken) {
  auto it = credit_.find(worker);
  if (it == credit_.end()) return;
  for (auto& [pool, pc] : it->second.pools) {
    const Owner me{OwnerKind::kCredit, worker, pc.serial};
    const absl::flat_hash_set<BlockIndex>& mine = owners_.BlocksOf(pc.serial);
    std::vector<BlockIndex> blocks(mine.begin(), mine.end());
    const int64_t n = static_cast<int64_t>(blocks.size());
    for (BlockIndex b : blocks) {
      KVD_CHECK(owners_.Release(pool, b, me).ok());
      UnrefLocked(pool, b);
    }
    if (pools_[pool]->geometry.hybrid()) {  // each group's units
      const std::vector<int64_t> units = UnitsOfLocked(pool, blocks);
      ledger_.UnreserveUnits(pool, units);
      workers_.AddUsage(it->second.principal, 0, -ledger_.BytesOfUnits(pool, units));
    } else {
      ledger_.Unreserve(pool, n);
      workers_.AddUsage(it->second.principal, 0, -ledger_.BytesOf(pool, n));
    }
    if (taken != nullptr) taken->push_back(CreditHeld{pool, std::move(blocks)});
  }
  credit_.erase(it);
}

}  // namespace kvd
