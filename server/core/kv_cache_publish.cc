// KvCache: publish, keeps and checkpoints.
#include <algorithm>
#include <optional>

#include "absl/strings/str_cat.h"
#include "server/core/kv_cache.h"
#include "proto/vocab/status_macros.h"

namespace kvd {
namespace {

// A request's own copies of duplicates are charged as blocks, or on a hybrid pool as units of its
// spine group (the full group whose blocks its table holds).
std::vector<int64_t> CopyUnits(const PoolGeometry& geo, int spine_group, int64_t copies) {
  std::vector<int64_t> units(geo.groups.size(), 0);
  units[spine_group] = copies;
  return units;
}

bool CanReserveCopies(const BudgetLedger& ledger, const PoolGeometry& geo, int spine_group, PoolId pool,
                      int64_t copies) {
  return geo.hybrid() ? ledger.CanReserveUnits(pool, CopyUnits(geo, spine_group, copies))
                      : ledger.CanReserve(pool, copies);
}

int64_t CopiesBytes(const BudgetLedger& ledger, const PoolGeometry& geo, int spine_group, PoolId pool,
                    int64_t copies) {
  return geo.hybrid() ? ledger.BytesOfUnits(pool, CopyUnits(geo, spine_group, copies)) : ledger.BytesOf(pool, copies);
}

}  // namespace

absl::Status KvCache::CheckKnownTokensLocked(const Request& req,
                                             absl::Span<const Token> tokens) const {
  const size_t n = std::min(tokens.size(), req.known_tokens.size());
  auto mismatch = std::mismatch(tokens.begin(), tokens.begin() + n, req.known_tokens.begin());
  if (mismatch.first != tokens.begin() + n) {
    return absl::InvalidArgumentError(
        absl::StrCat("tokens differ from the request's tokens at position ",
                     mismatch.first - tokens.begin()));
  }
  return absl::OkStatus();
}

void KvCache::LearnTokensLocked(Request& req, absl::Span<const Token> tokens) {
  if (tokens.size() > req.known_tokens.size()) {
    req.known_tokens.insert(req.known_tokens.end(), tokens.begin() + req.known_tokens.size(),
                            tokens.end());
  }
}

absl::StatusOr<PublishResult> KvCache::PlanPublishLocked(const Request& req,
                                                         absl::Span<const Token> tokens,
                                                         absl::Span<const BlockIndex> blocks,
                                                         bool by_pull, bool end, bool* continues) const {
  if (!req.acquired) {
    return absl::FailedPreconditionError(
        absl::StrCat("request '", req.spec.id.value(), "' must Acquire before Publish"));
  }
  const Pool& pool = *pools_[req.pool];
  const int32_t bt = pool.geometry.block_tokens;
  if (blocks.size() > req.table.size()) {
    return absl::InvalidArgumentError(absl::StrCat("publish names ", blocks.size(),
                                                   " blocks; the request holds ", req.table.size()));
  }
  // Where the table holds a cached duplicate, the request may name its own copy (its engine's
  // table still does).
  auto copy = req.own_copies.begin();
  for (size_t i = 0; i < blocks.size(); ++i) {
    while (copy != req.own_copies.end() && copy->position < static_cast<int64_t>(i)) ++copy;
    const bool own_copy = copy != req.own_copies.end() && copy->position == static_cast<int64_t>(i) &&
                          copy->block == blocks[i];
    if (blocks[i] != req.table[i] && !own_copy) {
      return absl::InvalidArgumentError(absl::StrCat("block ", blocks[i], " at position ", i,
                                                     " is not the request's (expected ",
                                                     req.table[i], ")"));
    }
  }
  if (static_cast<int64_t>(tokens.size()) > req.num_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("tokens (", tokens.size(),
                                                   ") go past the request's positions (",
                                                   req.num_tokens, "); Extend first"));
  }
  if (tokens.size() < blocks.size() * bt) {
    return absl::InvalidArgumentError(absl::StrCat("only full blocks are published: ", blocks.size(),
                                                   " blocks need ", blocks.size() * bt,
                                                   " tokens, got ", tokens.size()));
  }
  KVD_RETURN_IF_ERROR(CheckKnownTokensLocked(req, tokens));

  const NamespaceRoot* root = index_.FindRoot(req.spec.ns);
  // One pass over the positions. `cont`: a duplicate's cached block becomes the parent of the
  // positions after it (the request will hold it in its table); else the chain stops there and
  // the positions after it are no_parent (the old rule, kept for hybrid pools and for a publish
  // the budget has no room to continue).
  auto plan_with = [&](bool cont, PublishResult& plan, int64_t& copies) -> absl::Status {
    mu_.AssertHeld();
    const CachedBlock* parent = nullptr;
    bool chain_ok = true;       // every earlier position is cached and held by this request
    bool parent_is_new = false;  // the parent is itself about to be kept: no child can exist yet
    for (size_t i = 0; i < blocks.size(); ++i) {
      const BlockIndex b = req.table[i];
      const BlockState& s = pool.blocks[b];
      absl::Span<const Token> block_tokens = tokens.subspan(i * bt, bt);
      if (s.kind == BlockState::Kind::kCached) {
        if (!std::ranges::equal(block_tokens, index_.TokensOf(*s.node))) {
          return absl::InvalidArgumentError(
              absl::StrCat("tokens of position ", i, " differ from its cached block"));
        }
        plan.outcomes.push_back(PublishOutcome::kAlreadyCached);
        parent = s.node;
        continue;
      }
      KVD_CHECK(s.kind == BlockState::Kind::kOwned && s.owner == req.serial);
      // Its writer says whether its bytes are final: the request's own, or (for the pull's own
      // publish) the pull's; never a pull's while the worker publishes.
      const Owner* w = owners_.OwnerOf(req.pool, b);
      KVD_CHECK(w != nullptr);
      if (w->kind != OwnerKind::kRequest && !(by_pull && w->kind == OwnerKind::kPull)) {
        return absl::FailedPreconditionError(absl::StrCat("block ", b, " at position ", i,
                                                          " is being written by a ", OwnerKindName(w->kind),
                                                          "; it is published when that is done"));
      }
      const CachedBlock* dup = chain_ok && !parent_is_new && root != nullptr
                                   ? index_.FindChild(*root, parent, block_tokens)
                                   : nullptr;
      if (!chain_ok) {
        plan.outcomes.push_back(PublishOutcome::kNoParent);
      } else if (dup != nullptr) {
        plan.outcomes.push_back(PublishOutcome::kDuplicate);
        if (cont) {
          parent = dup;
          ++copies;
        } else {
          chain_ok = false;
        }
      } else {
        plan.outcomes.push_back(PublishOutcome::kKept);
        parent_is_new = true;
        ++plan.kept;
      }
    }
    return absl::OkStatus();
  };
  // Hybrid pools with a spine continue too: the cached node takes the position, and the request's
  // window blocks and checkpoints at later positions attach to the continued chain; at the
  // duplicate's own position they fill what the cached node lacks (PublishSideLocked).
  bool cont = !pool.geometry.hybrid() || pool.spine != nullptr;
  PublishResult plan;
  int64_t copies = 0;
  KVD_RETURN_IF_ERROR(plan_with(cont, plan, copies));
  // Before End, each own copy stays while the request runs: its reservation grows by one block
  // (a hybrid pool: one unit of its spine group) per copy, when the budget and the worker's limits
  // allow; else the chain stops (End continues it).
  if (cont && copies > 0 && !end &&
      (!CanReserveCopies(ledger_, pool.geometry, pool.spine_group, req.pool, copies) ||
       !CheckWorkerLimitsLocked(req.spec.limit_key(), 0,
                                CopiesBytes(ledger_, pool.geometry, pool.spine_group, req.pool, copies))
            .ok())) {
    cont = false;
    plan = PublishResult();
    KVD_RETURN_IF_ERROR(plan_with(cont, plan, copies));
  }
  if (continues != nullptr) *continues = cont;
  return plan;
}

absl::StatusOr<PublishResult> KvCache::Keeps(const RequestId& id, absl::Span<const Token> tokens,
                                             absl::Span<const BlockIndex> blocks) const {
  absl::MutexLock lock(&mu_);
  KVD_ASSIGN_OR_RETURN(Request * req, FindRequestLocked(id));
  return PlanPublishLocked(*req, tokens, blocks, /*by_pull=*/false);
}

absl::StatusOr<PublishResult> KvCache::Publish(const RequestId& id, absl::Span<const Token> tokens,
                                               absl::Span<const BlockIndex> blocks,
                                               absl::Span<const StateCheckpoint> checkpoints) {
  absl::StatusOr<PublishResult> result;
  {
    absl::MutexLock lock(&mu_);
    ExpireLocked(nullptr);
    result = PublishLocked(id, tokens, blocks, /*by_pull=*/false, checkpoints);
  }
  Deliver();
  return result;
}

absl::StatusOr<PublishResult> KvCache::End(const RequestId& id, int64_t publish_blocks,
                                           absl::Span<const Token> more_tokens, bool completed,
                                           absl::Span<const StateCheckpoint> checkpoints) {
  absl::StatusOr<PublishResult> result;
  {
    absl::MutexLock lock(&mu_);
    ExpireLocked(nullptr);
    result = EndLocked(id, publish_blocks, more_tokens, completed, checkpoints);
  }
  Deliver();  // also what expiry queued when End failed
  return result;
}

absl::StatusOr<PublishResult> KvCache::EndLocked(const RequestId& id, int64_t publish_blocks,
                                                 absl::Span<const Token> more_tokens, bool completed,
                                                 absl::Span<const StateCheckpoint> checkpoints) {
  KVD_ASSIGN_OR_RETURN(Request * req, FindRequestLocked(id));
  if (publish_blocks < 0 || publish_blocks > static_cast<int64_t>(req->table.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("publish_blocks is ", publish_blocks, "; the request holds ", req->table.size(), " blocks"));
  }
  PublishResult published;
  if (publish_blocks > 0 || !checkpoints.empty()) {
    // The request's own tokens; copied only when the caller adds some (decode past the prompt).
    std::vector<Token> joined;
    absl::Span<const Token> tokens = req->known_tokens;
    if (!more_tokens.empty()) {
      joined.reserve(req->known_tokens.size() + more_tokens.size());
      joined.assign(req->known_tokens.begin(), req->known_tokens.end());
      joined.insert(joined.end(), more_tokens.begin(), more_tokens.end());
      tokens = joined;
    }
    const std::vector<BlockIndex> blocks(req->table.begin(), req->table.begin() + publish_blocks);
    KVD_ASSIGN_OR_RETURN(published, PublishLocked(id, tokens, blocks, /*by_pull=*/false, checkpoints, /*end=*/true));
  }
  ReleaseLocked(*req, completed);
  requests_.erase(id);
  return published;
}

absl::StatusOr<PublishResult> KvCache::PublishLocked(const RequestId& id,
                                                     absl::Span<const Token> tokens,
                                                     absl::Span<const BlockIndex> blocks, bool by_pull,
                                                     absl::Span<const StateCheckpoint> checkpoints, bool end) {
  KVD_ASSIGN_OR_RETURN(Request * req, FindRequestLocked(id));
  bool continues = false;
  KVD_ASSIGN_OR_RETURN(PublishResult plan, PlanPublishLocked(*req, tokens, blocks, by_pull, end, &continues));
  KVD_RETURN_IF_ERROR(CheckStateCheckpointsLocked(*req, checkpoints));
  Pool& pool = *pools_[req->pool];
  const int32_t bt = pool.geometry.block_tokens;
  NamespaceRoot* root = plan.kept > 0 ? index_.GetOrCreateRoot(req->spec.ns, req->pool) : index_.FindRoot(req->spec.ns);
  CachedBlock* parent = nullptr;
  bool chain_ok = true;
  int64_t copies = 0;
  const uint32_t publisher = plan.kept > 0 ? workers_.Index(req->spec.owner) : 0;
  // The table slots, nodes and token slab lines of the blocks to come are loaded ahead, so their
  // misses overlap.
  constexpr size_t kAhead = 8;
  const size_t ahead = std::min(req->keys.size(), plan.outcomes.size());
  for (size_t i = 0; i < std::min(kAhead, ahead); ++i) index_.Prefetch({req->pool, req->table[i]}, req->keys[i]);
  for (size_t i = 0; i < plan.outcomes.size(); ++i) {
    if (i + kAhead < ahead) index_.Prefetch({req->pool, req->table[i + kAhead]}, req->keys[i + kAhead]);
    PublishOutcome& outcome = plan.outcomes[i];
    absl::Span<const Token> block_tokens = tokens.subspan(i * bt, bt);
    if (outcome == PublishOutcome::kAlreadyCached) {
      parent = pool.blocks[req->table[i]].node;
    } else if (outcome == PublishOutcome::kDuplicate && continues && chain_ok) {
      CachedBlock* dup = index_.FindChild(*root, parent, block_tokens);
      KVD_CHECK(dup != nullptr);  // as planned, under the same lock
      ContinuePastDuplicateLocked(*req, static_cast<int64_t>(i), dup);
      parent = dup;
      ++copies;
    } else if (outcome == PublishOutcome::kDuplicate) {
      chain_ok = false;
    } else if (outcome == PublishOutcome::kKept && chain_ok) {
      // The prompt's blocks were keyed before the lock (Admit); generated ones are keyed here.
      parent = CacheBlockLocked(req->pool, root, parent, req->table[i], block_tokens,
                                i < req->keys.size() ? &req->keys[i] : nullptr);
      if (parent != nullptr) parent->publisher = publisher;
      if (parent == nullptr) {  // a 128-bit key collision with a different block
        outcome = PublishOutcome::kDuplicate;
        --plan.kept;
        chain_ok = false;
      }
    } else if (outcome == PublishOutcome::kKept) {
      outcome = PublishOutcome::kNoParent;
      --plan.kept;
    }
    // What happened at a position is counted once: a repeat publish of it counts nothing.
    if (static_cast<int64_t>(i) >= req->counted) {
      if (outcome == PublishOutcome::kDuplicate) ++counters_.duplicate_blocks;
      if (outcome == PublishOutcome::kNoParent) ++counters_.no_parent_blocks;
    }
  }
  req->counted = std::max(req->counted, static_cast<int64_t>(plan.outcomes.size()));
  InflightPublishedLocked(*req, static_cast<int64_t>(plan.outcomes.size()));  // kv_cache_inflight.cc
  if (copies > 0 && !end) {
    // The own copies stay while the request runs: its reservation covers them (checked by the plan).
    if (pool.geometry.hybrid()) {
      KVD_CHECK(ledger_.ReserveUnits(req->pool, CopyUnits(pool.geometry, pool.spine_group, copies)).ok());
      req->reserved_units[pool.spine_group] += copies;
    } else {
      KVD_CHECK(ledger_.Reserve(req->pool, copies).ok());
    }
    req->reserved_blocks += copies;
    workers_.AddUsage(req->spec.limit_key(), 0, CopiesBytes(ledger_, pool.geometry, pool.spine_group, req->pool, copies));
  }
  counters_.published_blocks += plan.kept;
  LearnTokensLocked(*req, tokens);
  if (pool.geometry.hybrid()) PublishSideLocked(*req, checkpoints, end, plan);
  return plan;
}

void KvCache::ContinuePastDuplicateLocked(Request& req, int64_t position, CachedBlock* node) {
  const BlockIndex own = req.table[position];
  const BlockIndex cached = node->address.index;
  RefLocked(req.pool, cached);  // a use of the cached block, like a hit
  req.table[position] = cached;
  KVD_CHECK(req.own_copies.empty() || req.own_copies.back().position < position);
  req.own_copies.push_back({position, own});
  // The request's own checkpoint holding the copy there holds the cached block instead (the same
  // bytes), so that what it holds after the position keeps a referenced parent once the request
  // has gone; the copy stays the request's.
  auto c = checkpoints_.find(req.spec.id);
  if (c != checkpoints_.end() && c->second->serial == req.serial &&
      position < static_cast<int64_t>(c->second->blocks.size()) && c->second->blocks[position] == own) {
    RefLocked(req.pool, cached, /*touch=*/false);
    c->second->blocks[position] = cached;
    UnrefLocked(req.pool, own);
  }
}

absl::Status KvCache::Checkpoint(const RequestId& id, absl::Span<const Token> tokens, std::string engine_state,
                                 absl::Span<const StateCheckpoint> state, std::vector<int64_t>* fresh_slots) {
  absl::Status status;
  {
    absl::MutexLock lock(&mu_);
    ExpireLocked(nullptr);
    status = CheckpointLocked(id, tokens, std::move(engine_state), state, /*ending=*/false, fresh_slots);
  }
  Deliver();  // a fresh spare may have evicted
  return status;
}

absl::Status KvCache::CheckpointLocked(const RequestId& id, absl::Span<const Token> tokens,
                                       std::string engine_state, absl::Span<const StateCheckpoint> state,
                                       bool ending, std::vector<int64_t>* fresh_slots) {
  KVD_ASSIGN_OR_RETURN(Request * req, FindRequestLocked(id));
  if (!req->acquired) {
    return absl::FailedPreconditionError(
        absl::StrCat("request '", id.value(), "' must Acquire before Checkpoint"));
  }
  const bool hybrid = pools_[req->pool]->geometry.hybrid();
  if (!hybrid && !state.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("state_checkpoints: pool '", pools_[req->pool]->geometry.name,
                                                   "' has no KV groups (no state to checkpoint)"));
  }
  if (tokens.empty()) return absl::InvalidArgumentError("checkpoint tokens are empty");
  if (static_cast<int64_t>(tokens.size()) > req->num_tokens) {
    return absl::OutOfRangeError(absl::StrCat("checkpoint covers ", tokens.size(),
                                              " tokens; the request has ", req->num_tokens,
                                              " positions"));
  }
  if (static_cast<int64_t>(engine_state.size()) > options_.max_engine_state_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("engine state of ", engine_state.size(),
                                                   " bytes exceeds the limit of ",
                                                   options_.max_engine_state_bytes));
  }
  KVD_RETURN_IF_ERROR(CheckKnownTokensLocked(*req, tokens));
  std::optional<GroupCheckpointPlan> groups;
  if (hybrid) {
    KVD_ASSIGN_OR_RETURN(groups, PlanGroupCheckpointLocked(*req, static_cast<int64_t>(tokens.size()), state, ending));
  }
  auto existing = checkpoints_.find(id);
  if (existing != checkpoints_.end() && existing->second->serial != req->serial) {
    return absl::FailedPreconditionError(
        absl::StrCat("an interrupted generation's checkpoint already uses id '", id.value(), "'"));
  }
  const int64_t state_bytes =
      static_cast<int64_t>(engine_state.size() + tokens.size() * sizeof(Token));
  KVD_RETURN_IF_ERROR(MakeCheckpointStateRoomLocked(
      req->spec.limit_key(), state_bytes, existing != checkpoints_.end() ? existing->second.get() : nullptr));
  existing = checkpoints_.find(id);  // making room drops orphans only, never this one
  auto rec = std::make_unique<CheckpointRecord>();
  rec->serial = req->serial;
  rec->version = next_serial_++;
  rec->id = id;
  rec->pool = req->pool;
  rec->ns = req->spec.ns;
  rec->tokens.assign(tokens.begin(), tokens.end());
  const int64_t n = pools_[req->pool]->geometry.BlocksFor(static_cast<int64_t>(tokens.size()));
  rec->blocks.assign(req->table.begin(), req->table.begin() + n);
  rec->engine_state = std::move(engine_state);
  rec->state_bytes = state_bytes;
  rec->owner = req->spec.limit_key();
  for (BlockIndex b : rec->blocks) RefLocked(req->pool, b);
  if (groups.has_value()) ApplyGroupCheckpointLocked(*req, *rec, *std::move(groups), ending, fresh_slots);
  if (existing != checkpoints_.end()) DropCheckpointLocked(id);
  ChargeCheckpointStateLocked(*rec, +1);
  checkpoints_.emplace(id, std::move(rec));
  LearnTokensLocked(*req, tokens);
  return absl::OkStatus();
}

void KvCache::ChargeCheckpointStateLocked(const CheckpointRecord& ckpt, int sign) {
  checkpoint_state_bytes_ += sign * ckpt.state_bytes;
  if (!ckpt.durable) checkpoints_not_durable_ += sign;
  if (ckpt.owner.empty()) return;
  int64_t& w = checkpoint_state_by_worker_[ckpt.owner];
  w += sign * ckpt.state_bytes;
  if (w == 0) checkpoint_state_by_worker_.erase(ckpt.owner);
}

absl::Status KvCache::MakeCheckpointStateRoomLocked(const WorkerId& owner, int64_t bytes,
                                                    const CheckpointRecord* replacing) {
  const int64_t freed = replacing != nullptr ? replacing->state_bytes : 0;
  if (!owner.empty()) {
    const int64_t per_worker = options_.max_checkpoint_state_bytes_per_worker > 0
                                   ? options_.max_checkpoint_state_bytes_per_worker
                                   : options_.checkpoint_state_bytes / 4;
    const auto held_now = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      auto it = checkpoint_state_by_worker_.find(owner);
      return (it == checkpoint_state_by_worker_.end() ? 0 : it->second) -
             (replacing != nullptr && replacing->owner == owner ? freed : 0);
    };
    // Over its own limit, a worker gives up its own oldest interrupted checkpoints first. A scan
    // of the orphans, only when a worker is at its limit; they are bounded by the state budget.
    while (held_now() + bytes > per_worker) {
      const RequestId* oldest = nullptr;
      for (const auto& [when, id] : orphans_) {
        const CheckpointRecord& c = *checkpoints_.at(id);
        if (c.owner == owner && &c != replacing) {
          oldest = &id;
          break;
        }
      }
      if (oldest == nullptr) break;
      DropCheckpointLocked(RequestId(*oldest));
    }
    const int64_t held = held_now();
    if (held + bytes > per_worker) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "worker '", owner.value(), "' holds ", held, " bytes of checkpoint state; ", bytes,
          " more would pass max_checkpoint_state_bytes_per_worker (", per_worker, ")"));
    }
  }
  while (checkpoint_state_bytes_ - freed + bytes > options_.checkpoint_state_bytes && !orphans_.empty()) {
    DropCheckpointLocked(orphans_.begin()->second);  // oldest first
  }
  if (checkpoint_state_bytes_ - freed + bytes > options_.checkpoint_state_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "checkpoints hold ", checkpoint_state_bytes_, " bytes of state; ", bytes,
        " more would pass checkpoint_state_bytes (", options_.checkpoint_state_bytes, ")"));
  }
  return absl::OkStatus();
}

void KvCache::OrphanCheckpointLocked(CheckpointRecord& ckpt) {
  // Its state still counts against its worker (CheckpointRecord::owner).
  const bool hybrid = !ckpt.groups.empty();
  const std::vector<int64_t> units = hybrid ? UnitsOfLocked(ckpt.pool, AllBlocksOf(ckpt)) : std::vector<int64_t>{};
  int64_t charge = static_cast<int64_t>(ckpt.blocks.size());
  if (hybrid) {
    charge = 0;
    for (int64_t u : units) charge += u;
  }
  const int64_t charge_bytes = hybrid ? ledger_.BytesOfUnits(ckpt.pool, units) : ledger_.BytesOf(ckpt.pool, charge);
  if (charge_bytes > options_.checkpoint_budget_bytes) {
    DropCheckpointLocked(ckpt.id);
    return;
  }
  while (orphan_blocks_bytes_ + charge_bytes > options_.checkpoint_budget_bytes && !orphans_.empty()) {
    DropCheckpointLocked(orphans_.begin()->second);  // oldest first
  }
  // The request's reservation covered these units and was just returned, so this always fits.
  if (hybrid) {
    KVD_CHECK(ledger_.ReserveUnits(ckpt.pool, units).ok());
    ckpt.charged_units = units;
  } else {
    KVD_CHECK(ledger_.Reserve(ckpt.pool, charge).ok());
  }
  ckpt.orphaned = true;
  ckpt.charged_blocks = charge;
  ckpt.expires_at = clock_->Now() + options_.checkpoint_ttl;
  orphans_.emplace(std::make_pair(ckpt.expires_at, ckpt.serial), ckpt.id);
  orphan_blocks_bytes_ += charge_bytes;
}

void KvCache::DropCheckpointLocked(const RequestId& id) {
  auto it = checkpoints_.find(id);
  KVD_CHECK(it != checkpoints_.end());
  CheckpointRecord& ckpt = *it->second;
  if (ckpt.orphaned) {
    orphan_blocks_bytes_ -= ChargedBytesLocked(ckpt);
    if (!ckpt.charged_units.empty()) ledger_.UnreserveUnits(ckpt.pool, ckpt.charged_units);
    else ledger_.Unreserve(ckpt.pool, ckpt.charged_blocks);
    orphans_.erase({ckpt.expires_at, ckpt.serial});
  }
  for (auto g = ckpt.groups.rbegin(); g != ckpt.groups.rend(); ++g) {
    if (g->slot != HybridSpine::kNone) UnrefLocked(ckpt.pool, g->slot);
    UnrefTableLocked(ckpt.pool, g->blocks);
  }
  UnrefTableLocked(ckpt.pool, ckpt.blocks);
  ChargeCheckpointStateLocked(ckpt, -1);
  checkpoints_.erase(it);
}

}  // namespace kvd
