// KvCache: publish, keeps and checkpoints.
#include <algorithm>
#include <optional>

#include "absl/strings/str_cat.h"
#include "server/core/kv_cache.h"
#include "proto/vocab/status_macros.h"

namespace kvd {

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
                                                         bool by_pull) const {
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
  for (size_t i = 0; i < blocks.size(); ++i) {
    if (blocks[i] != req.table[i]) {
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

  PublishResult plan;
  const NamespaceRoot* root = index_.FindRoot(req.spec.ns);
  const CachedBlock* parent = nullptr;
  bool chain_ok = true;       // every earlier position is cached and held by this request
  bool parent_is_new = false;  // the parent is itself about to be kept: no child can exist yet
  for (size_t i = 0; i < blocks.size(); ++i) {
    const BlockState& s = pool.blocks[blocks[i]];
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
    const Owner* w = owners_.OwnerOf(req.pool, blocks[i]);
    KVD_CHECK(w != nullptr);
    if (w->kind != OwnerKind::kRequest && !(by_pull && w->kind == OwnerKind::kPull)) {
      return absl::FailedPreconditionError(absl::StrCat("block ", blocks[i], " at position ", i,
                                                        " is being written by a ", OwnerKindName(w->kind),
                                                        "; it is published when that is done"));
    }
    if (!chain_ok) {
      plan.outcomes.push_back(PublishOutcome::kNoParent);
    } else if (!parent_is_new && root != nullptr &&
               index_.FindChild(*root, parent, block_tokens) != nullptr) {
      plan.outcomes.push_back(PublishOutcome::kDuplicate);
      chain_ok = false;
    } else {
      plan.outcomes.push_back(PublishOutcome::kKept);
      parent_is_new = true;
      ++plan.kept;
    }
  }
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
  KVD_ASSIGN_OR_RETURN(PublishResult plan, PlanPublishLocked(*req, tokens, blocks, by_pull));
  KVD_RETURN_IF_ERROR(CheckStateCheckpointsLocked(*req, checkpoints));
  Pool& pool = *pools_[req->pool];
  const int32_t bt = pool.geometry.block_tokens;
  NamespaceRoot* root = plan.kept > 0 ? index_.GetOrCreateRoot(req->spec.ns, req->pool) : nullptr;
  CachedBlock* parent = nullptr;
  bool chain_ok = true;
  const uint32_t publisher = plan.kept > 0 ? workers_.Index(req->spec.owner) : 0;
  // The table slots, nodes and token slab lines of the blocks to come are loaded ahead, so their
  // misses overlap.
  constexpr size_t kAhead = 8;
  const size_t ahead = std::min(req->keys.size(), plan.outcomes.size());
  for (size_t i = 0; i < std::min(kAhead, ahead); ++i) index_.Prefetch({req->pool, blocks[i]}, req->keys[i]);
  for (size_t i = 0; i < plan.outcomes.size(); ++i) {
    if (i + kAhead < ahead) index_.Prefetch({req->pool, blocks[i + kAhead]}, req->keys[i + kAhead]);
    PublishOutcome& outcome = plan.outcomes[i];
    if (outcome == PublishOutcome::kAlreadyCached) {
      parent = pool.blocks[blocks[i]].node;
    } else if (outcome == PublishOutcome::kKept && chain_ok) {
      // The prompt's blocks were keyed before the lock (Admit); generated ones are keyed here.
      parent = CacheBlockLocked(req->pool, root, parent, blocks[i], tokens.subspan(i * bt, bt),
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
    if (outcome == PublishOutcome::kDuplicate) ++counters_.duplicate_blocks;
  }
  counters_.published_blocks += plan.kept;
  LearnTokensLocked(*req, tokens);
  if (pool.geometry.hybrid()) PublishSideLocked(*req, checkpoints, end, plan);
  return plan;
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
