// KvCache: the hooks that lower tiers (server/store) use — demotion on eviction, adoption of
// promoted blocks, snapshots for flush, and events from a warm restart.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/container/flat_hash_set.h"
#include "server/core/kv_cache.h"
#include "proto/vocab/status_macros.h"

namespace kvd {

CachedBlockView ViewOf(const PrefixIndex& index, const CachedBlock& block) {
  CachedBlockView v;
  v.pool = block.address.pool;
  v.index = block.address.index;
  v.ns = &block.root->ns;
  v.root_key = block.root->key;
  v.key = block.key;
  v.has_parent = block.parent != nullptr;
  if (block.parent != nullptr) v.parent_key = block.parent->key;
  v.tokens = index.TokensOf(block);
  return v;
}

namespace cache_state {
std::vector<PendingDemotion>& ThreadDemotions() {
  thread_local std::vector<PendingDemotion> pending;
  return pending;
}
}  // namespace cache_state

void KvCache::SetEvictionSink(EvictionSink* sink) {
  absl::MutexLock lock(&mu_);
  // A demotion running now uses the old sink: it must be done before the caller may destroy it.
  mu_.Await(absl::Condition(
      +[](int* in_flight) { return *in_flight == 0; }, &demotions_in_flight_));
  sink_ = sink;
}

void KvCache::SetMoverWake(std::function<void()> wake) {
  absl::MutexLock deliver_lock(&deliver_mu_);
  absl::MutexLock lock(&mu_);
  mover_wake_ = std::move(wake);
}

int64_t KvCache::DemoteAhead(int64_t max_blocks) {
  int64_t demoted = 0;
  {
    absl::MutexLock lock(&mu_);
    if (sink_ == nullptr) return 0;
    ExpireLocked(nullptr);
    for (auto& p : pools_) {
      Pool& pool = *p;
      // This call's victims stay held until their copies are done (Deliver, below): count them.
      int64_t taken = 0;
      while (demoted < max_blocks && pool.allocator.num_free() + taken < pool.reserve_blocks) {
        CachedBlock* victim = pool.queue.PeekUnprotected();
        if (victim == nullptr) break;
        EvictOneLocked(pool, victim, EvictReason::kCapacity);
        ++taken;
        ++demoted;
      }
    }
    if (demoted > 0) UpdatePressureLocked();
  }
  Deliver();  // the copies (RunDemotions), on this thread; then the events
  return demoted;
}

void KvCache::RunDemotions() {
  std::vector<cache_state::PendingDemotion>& all = cache_state::ThreadDemotions();
  std::vector<HeldBlock> mine;
  for (auto it = all.begin(); it != all.end();) {
    if (it->cache == this) {
      mine.push_back(std::move(it->block));
      it = all.erase(it);
    } else {
      ++it;
    }
  }
  if (mine.empty()) return;
  EvictionSink* sink;
  {
    absl::MutexLock lock(&mu_);
    sink = sink_;
    ++demotions_in_flight_;
  }
  if (sink != nullptr) {
    for (const HeldBlock& b : mine) sink->OnEvict(b.view(), b.reason);  // copies, without mu_
  }
  {
    absl::MutexLock lock(&mu_);
    for (const HeldBlock& b : mine) {
      for (const UnitComponent& part : b.parts) UnholdLocked(b.pool, part.index);
      UnholdLocked(b.pool, b.index);
    }
    --demotions_in_flight_;
    demotions_pending_ -= static_cast<int64_t>(mine.size());
    UpdatePressureLocked();
  }
}

bool KvCache::WaitForDemotions(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  return mu_.AwaitWithTimeout(
      absl::Condition(+[](int64_t* pending) { return *pending == 0; }, &demotions_pending_), timeout);
}

absl::Status KvCache::AdoptPromoted(const RequestId& id, int64_t new_cached_tokens) {
  absl::Status status;
  {
    absl::MutexLock lock(&mu_);
    ExpireLocked(nullptr);
    status = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> absl::Status {
      KVD_ASSIGN_OR_RETURN(Request * req, FindRequestLocked(id));
      const int32_t bt = pools_[req->pool]->geometry.block_tokens;
      const int64_t prompt_len = static_cast<int64_t>(req->spec.prompt.size());
      if (!req->acquired || !req->spec.resume_from.empty()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "request '", id.value(), "' is not a freshly acquired prefix lookup"));
      }
      if (new_cached_tokens <= req->cached_tokens || new_cached_tokens % bt != 0 ||
          new_cached_tokens >= prompt_len) {
        return absl::FailedPreconditionError(absl::StrCat(
            "promoted prefix of ", new_cached_tokens, " tokens does not extend the request's ",
            req->cached_tokens, " cached tokens within its ", prompt_len, "-token prompt"));
      }
      const int64_t nblocks = new_cached_tokens / bt;
      const std::vector<BlockIndex> blocks(req->table.begin(), req->table.begin() + nblocks);
      const uint64_t published_before = counters_.published_blocks;
      KVD_ASSIGN_OR_RETURN(
          PublishResult r,
          PublishLocked(id, absl::MakeConstSpan(req->spec.prompt).first(new_cached_tokens), blocks,
                        /*by_pull=*/true));
      (void)r;  // kDuplicate/kNoParent positions stay private to the request; their bytes are valid
      counters_.published_blocks = published_before;  // promotion is not a new publish
      const int64_t delta = new_cached_tokens - req->cached_tokens;
      req->cached_tokens = new_cached_tokens;
      counters_.hit_tokens += delta;
      counters_.miss_tokens -= delta;
      return absl::OkStatus();
    }();
  }
  Deliver();
  return status;
}

absl::StatusOr<TierPort::PinnedPrefix> KvCache::PinPrefix(const Namespace& ns, absl::Span<const Token> tokens,
                                                         int64_t skip_blocks, int64_t max_blocks) {
  KVD_ASSIGN_OR_RETURN(PoolId id, FindPool(ns.pool));
  const int32_t bt = pool_geometries_[id].block_tokens;
  const int64_t len = std::min<int64_t>(static_cast<int64_t>(tokens.size()), pool_geometries_[id].max_model_len);
  const std::vector<BlockKey> keys = ChainKeys(ns, tokens.first(static_cast<size_t>(len)), bt, len / bt);
  PinnedPrefix out;
  out.pool = id;
  {
    absl::MutexLock lock(&mu_);
    ExpireLocked(nullptr);
    Pool& pool = *pools_[id];
    const std::vector<CachedBlock*> hit =
        index_.Match(index_.FindRoot(ns), tokens.first(static_cast<size_t>(len)), bt, MaxHitBlocks(pool, len), keys);
    for (int64_t i = std::max<int64_t>(skip_blocks, 0); i < static_cast<int64_t>(hit.size()); ++i) {
      if (max_blocks > 0 && static_cast<int64_t>(out.blocks.size()) >= max_blocks) break;
      const BlockIndex b = hit[static_cast<size_t>(i)]->address.index;
      RefLocked(id, b);  // a peer's read is a use
      ++pool.pins[b];
      out.blocks.push_back(b);
      out.serials.push_back(hit[static_cast<size_t>(i)]->serial);
    }
  }
  return out;
}

absl::StatusOr<RequestSpec> KvCache::SpecOf(const RequestId& id) const {
  absl::MutexLock lock(&mu_);
  KVD_ASSIGN_OR_RETURN(Request * req, FindRequestLocked(id));
  return req->spec;
}

absl::Status KvCache::PinBlocks(const RequestId& id, absl::Span<const BlockIndex> blocks) {
  absl::MutexLock lock(&mu_);
  KVD_ASSIGN_OR_RETURN(Request * req, FindRequestLocked(id));
  for (BlockIndex b : blocks) {
    if (std::find(req->table.begin(), req->table.end(), b) == req->table.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("block ", b, " is not in request '", id.value(), "''s table"));
    }
  }
  // The pull becomes the writer of every block the request writes among them, so each must be
  // the request's to give: not another pull's (nor named twice).
  Pool& pool = *pools_[req->pool];
  const Owner writer = WriterOf(*req);
  absl::flat_hash_set<BlockIndex> taken;
  for (BlockIndex b : blocks) {
    if (pool.blocks[b].kind != BlockState::Kind::kOwned) continue;  // cached: read, never written
    const Owner* w = owners_.OwnerOf(req->pool, b);
    if (w == nullptr || !(*w == writer)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "block ", b, " of request '", id.value(), "' is written by ",
          w == nullptr ? std::string("nobody") : absl::StrCat(OwnerKindName(w->kind), " (epoch ", w->epoch, ")"),
          ", not by the request: a pull cannot take it"));
    }
    if (!taken.insert(b).second) return absl::InvalidArgumentError(absl::StrCat("block ", b, " is named twice"));
  }
  const uint64_t epoch = next_serial_++;
  const Owner pull{OwnerKind::kPull, req->spec.owner, epoch};
  for (BlockIndex b : blocks) {
    RefLocked(req->pool, b);
    ++pool.pins[b];
    if (taken.contains(b)) KVD_CHECK(owners_.Transfer(req->pool, b, writer, pull).ok());
  }
  if (!taken.empty()) {
    pulls_.emplace(epoch, PullRecord{id, req->serial, req->spec.owner, req->pool,
                                     std::vector<BlockIndex>(blocks.begin(), blocks.end())});
  }
  return absl::OkStatus();
}

void KvCache::UnpinBlocks(PoolId pool_id, absl::Span<const BlockIndex> blocks) {
  {
    absl::MutexLock lock(&mu_);
    ExpireLocked(nullptr);
    Pool& pool = *pools_[pool_id];
    // The pull that pinned exactly these blocks, if one did, is done writing them. Other pins of
    // the same blocks (a checkpoint's flush) name other lists.
    for (auto it = pulls_.begin(); it != pulls_.end(); ++it) {
      if (it->second.pool == pool_id && absl::MakeConstSpan(it->second.blocks) == blocks) {
        EndPullLocked(it);
        break;
      }
    }
    for (BlockIndex b : blocks) {
      auto it = pool.pins.find(b);
      KVD_CHECK(it != pool.pins.end());
      if (--it->second == 0) pool.pins.erase(it);
      UnrefLocked(pool_id, b);
    }
    UpdatePressureLocked();
  }
  Deliver();
}

std::vector<CachedBlockRef> KvCache::SnapshotCached() const {
  // In slices of the block arrays, the lock taken per slice: a million cached blocks never hold
  // the engine for the whole listing (each slice is a few microseconds). Blocks cached or evicted
  // between slices may be missed or stale; users revalidate by key (VisitCached).
  constexpr BlockIndex kSlice = 4096;
  std::vector<CachedBlockRef> out;
  for (PoolId p = 0; p < pool_geometries_.size(); ++p) {
    const BlockIndex capacity = static_cast<BlockIndex>(pool_geometries_[p].capacity_blocks);
    for (BlockIndex start = 0; start < capacity; start += std::min(kSlice, capacity - start)) {
      absl::MutexLock lock(&mu_);
      const Pool& pool = *pools_[p];
      const BlockIndex end = start + std::min(kSlice, capacity - start);
      for (BlockIndex b = start; b < end; ++b) {
        const BlockState& s = pool.blocks[b];
        // A hybrid pool's side block (s.node null) travels with its spine node (VisitCached).
        if (s.kind == BlockState::Kind::kCached && s.node != nullptr) out.push_back(CachedBlockRef{p, b, s.node->key});
      }
    }
  }
  return out;
}

int64_t KvCache::VisitCached(absl::Span<const CachedBlockRef> refs,
                             const std::function<void(const CachedBlockView&)>& fn) {
  std::vector<HeldBlock> visits;
  std::vector<std::pair<PoolId, BlockIndex>> holds;  // the visited blocks and their prefixes
  absl::flat_hash_set<std::pair<PoolId, BlockIndex>> held;
  {
    absl::MutexLock lock(&mu_);
    for (const CachedBlockRef& ref : refs) {
      if (ref.pool >= pools_.size()) continue;
      const Pool& pool = *pools_[ref.pool];
      if (ref.index >= pool.blocks.size()) continue;
      const BlockState& s = pool.blocks[ref.index];
      if (s.kind != BlockState::Kind::kCached || s.node == nullptr || s.node->key != ref.key) continue;
      visits.emplace_back(ViewOf(index_, *s.node));
      // A hybrid unit's components travel with it, held like the prefix (before it: a held
      // component's node is held, U5).
      visits.back().parts = UnitPartsLocked(pool, *s.node);
      // A referenced block's prefix must be referenced too (eviction goes leaf first).
      // Each block once, up to the first already held.
      for (const CachedBlock* n = s.node; n != nullptr && held.insert({ref.pool, n->address.index}).second;
           n = n->parent) {
        HoldLocked(ref.pool, n->address.index);
        holds.emplace_back(ref.pool, n->address.index);
      }
      for (const UnitComponent& part : visits.back().parts) {
        if (!held.insert({ref.pool, part.index}).second) continue;
        HoldLocked(ref.pool, part.index);
        holds.emplace_back(ref.pool, part.index);
      }
    }
  }
  for (const HeldBlock& v : visits) fn(v.view());  // copies, without mu_
  if (!holds.empty()) {
    absl::MutexLock lock(&mu_);
    for (auto it = holds.rbegin(); it != holds.rend(); ++it) UnholdLocked(it->first, it->second);
    UpdatePressureLocked();
  }
  Deliver();
  return static_cast<int64_t>(visits.size());
}

std::vector<CheckpointSnapshot> KvCache::SnapshotCheckpoints(bool pin) {
  absl::MutexLock lock(&mu_);
  std::vector<CheckpointSnapshot> out;
  for (const auto& [id, ckpt] : checkpoints_) {
    CheckpointSnapshot s;
    s.id = id;
    s.pool = ckpt->pool;
    s.ns = ckpt->ns;
    s.tokens = ckpt->tokens;
    s.blocks = ckpt->blocks;
    s.engine_state = ckpt->engine_state;
    s.orphaned = ckpt->orphaned;
    s.version = ckpt->version;
    s.durable = ckpt->durable;
    for (const CheckpointRecord::Group& g : ckpt->groups) {
      s.groups.push_back(CheckpointSnapshot::Group{
          g.first, g.blocks, g.slot == HybridSpine::kNone ? CheckpointSnapshot::kNoSlot : g.slot});
    }
    if (pin) {
      Pool& pool = *pools_[ckpt->pool];
      for (BlockIndex b : AllBlocksOf(*ckpt)) {
        RefLocked(ckpt->pool, b);
        ++pool.pins[b];
      }
    }
    out.push_back(std::move(s));
  }
  return out;
}

void KvCache::SetCheckpointDurable(const RequestId& id, uint64_t version, bool durable) {
  absl::MutexLock lock(&mu_);
  auto it = checkpoints_.find(id);
  if (it == checkpoints_.end()) return;
  CheckpointRecord& ckpt = *it->second;
  if (ckpt.durable == durable || (durable && ckpt.version != version)) return;
  ckpt.durable = durable;
  checkpoints_not_durable_ += durable ? -1 : 1;
}

int64_t KvCache::cached_blocks() const {
  absl::MutexLock lock(&mu_);
  int64_t n = 0;
  // A hybrid pool's index holds its spine nodes; the other groups' cached blocks travel with them.
  for (const auto& pool : pools_) n += pool->side.empty() ? pool->num_cached : pool->spine_group < 0 ? 0 : pool->CachedIn(pool->spine_group);
  return n;
}

int64_t KvCache::checkpoints_not_durable() const {
  absl::MutexLock lock(&mu_);
  return checkpoints_not_durable_;
}

absl::StatusOr<std::vector<BlockIndex>> KvCache::RestoreCheckpoint(const RequestId& id,
                                                                   const Namespace& ns,
                                                                   std::vector<Token> tokens,
                                                                   std::string engine_state,
                                                                   absl::Span<const int64_t> group_units) {
  absl::StatusOr<std::vector<BlockIndex>> result;
  {
    absl::MutexLock lock(&mu_);
    ExpireLocked(nullptr);
    result = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> absl::StatusOr<std::vector<BlockIndex>> {
      KVD_ASSIGN_OR_RETURN(PoolId pool_id, FindPool(ns.pool));
      const PoolGeometry& g = pools_[pool_id]->geometry;
      if (tokens.empty()) return absl::InvalidArgumentError("checkpoint tokens are empty");
      if (static_cast<int64_t>(tokens.size()) > g.max_model_len) {
        return absl::InvalidArgumentError("checkpoint is longer than the pool's max_model_len");
      }
      if (static_cast<int64_t>(engine_state.size()) > options_.max_engine_state_bytes) {
        return absl::InvalidArgumentError("checkpoint engine state exceeds max_engine_state_bytes");
      }
      if (g.hybrid() == group_units.empty()) {
        return absl::InvalidArgumentError(absl::StrCat("group_units: ", group_units.size(), " groups for pool '",
                                                       g.name, "', which has ", g.groups.size()));
      }
      if (checkpoints_.contains(id) || requests_.contains(id)) {
        return absl::AlreadyExistsError(absl::StrCat("id '", id.value(), "' is in use"));
      }
      const bool hybrid = g.hybrid();
      const int64_t n = g.BlocksFor(static_cast<int64_t>(tokens.size()));
      std::vector<int64_t> units;  // a hybrid pool's: per group
      int64_t charged = n;
      if (hybrid) {
        units = CheckpointUnitsLocked(pool_id, static_cast<int64_t>(tokens.size()));
        if (!std::equal(units.begin(), units.end(), group_units.begin(), group_units.end())) {
          return absl::FailedPreconditionError(absl::StrCat(
              "group_units: the record holds other units per group than a checkpoint at ", tokens.size(),
              " tokens of pool '", g.name, "' does (another KV grouping)"));
        }
        charged = 0;
        for (int64_t u : units) charged += u;
      }
      const int64_t charge_bytes = hybrid ? ledger_.BytesOfUnits(pool_id, units) : ledger_.BytesOf(pool_id, n);
      if (orphan_blocks_bytes_ + charge_bytes > options_.checkpoint_budget_bytes) {
        return absl::ResourceExhaustedError("the checkpoint budget has no room for it");
      }
      const int64_t state_bytes =
          static_cast<int64_t>(engine_state.size() + tokens.size() * sizeof(Token));
      if (checkpoint_state_bytes_ + state_bytes > options_.checkpoint_state_bytes) {
        return absl::ResourceExhaustedError("checkpoint_state_bytes has no room for it");
      }
      KVD_RETURN_IF_ERROR(hybrid ? ledger_.ReserveUnits(pool_id, units) : ledger_.Reserve(pool_id, n));
      const uint64_t serial = next_serial_++;
      auto rec = std::make_unique<CheckpointRecord>();
      // Written by the tier's copy before anyone can resume it; no worker writes an orphan's blocks.
      if (hybrid) {
        if (absl::Status s = AllocateCheckpointUnitsLocked(pool_id, static_cast<int64_t>(tokens.size()), serial, *rec);
            !s.ok()) {
          ledger_.UnreserveUnits(pool_id, units);
          return s;
        }
        rec->charged_units = units;
      } else {
        absl::StatusOr<std::vector<BlockIndex>> blocks = AllocateOwnedLocked(pool_id, n, serial, /*writer=*/nullptr);
        if (!blocks.ok()) {
          ledger_.Unreserve(pool_id, n);
          return blocks.status();
        }
        rec->blocks = *std::move(blocks);
      }
      rec->serial = serial;
      rec->version = next_serial_++;
      rec->durable = true;  // restored from G3
      rec->id = id;
      rec->pool = pool_id;
      rec->ns = ns;
      rec->tokens = std::move(tokens);
      rec->engine_state = std::move(engine_state);
      rec->state_bytes = state_bytes;
      ChargeCheckpointStateLocked(*rec, +1);
      rec->orphaned = true;
      rec->charged_blocks = charged;
      rec->expires_at = clock_->Now() + options_.checkpoint_ttl;
      orphans_.emplace(std::make_pair(rec->expires_at, rec->serial), id);
      orphan_blocks_bytes_ += charge_bytes;
      std::vector<BlockIndex> all = AllBlocksOf(*rec);
      checkpoints_.emplace(id, std::move(rec));
      UpdatePressureLocked();
      return all;
    }();
  }
  Deliver();
  return result;
}

void KvCache::DropRestoredCheckpoint(const RequestId& id) {
  {
    absl::MutexLock lock(&mu_);
    auto it = checkpoints_.find(id);
    if (it == checkpoints_.end() || !it->second->orphaned) return;  // not restored, or resumed since
    DropCheckpointLocked(id);
    UpdatePressureLocked();
  }
  Deliver();
}

void KvCache::EmitExternal(const std::vector<CacheEvent>& events) {
  {
    absl::MutexLock lock(&mu_);
    ExpireLocked(nullptr);
    for (const CacheEvent& e : events) {
      scratch_event_ = e;
      EmitLocked();
    }
  }
  Deliver();
}

}  // namespace kvd
