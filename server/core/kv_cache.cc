#include "server/core/kv_cache.h"

#include <algorithm>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "proto/vocab/status_macros.h"

namespace kvd {
namespace {

constexpr size_t kMaxIdBytes = 256;

absl::Status CheckId(absl::string_view what, const std::string& id, bool required) {
  if (required && id.empty()) return absl::InvalidArgumentError(absl::StrCat(what, " is empty"));
  if (id.size() > kMaxIdBytes) {
    return absl::InvalidArgumentError(absl::StrCat(what, " is longer than ", kMaxIdBytes, " bytes"));
  }
  return absl::OkStatus();
}

}  // namespace

int64_t CacheOptions::CapacityBytes() const {
  int64_t bytes = 0;
  for (const auto& p : pools) {
    if (!p.hybrid()) {
      bytes += p.capacity_blocks * p.block_bytes_all_shards();
      continue;
    }
    for (size_t g = 0; g < p.groups.size(); ++g) {
      bytes += p.groups[g].capacity * p.GroupUnitBytes(static_cast<int>(g)) * p.num_shards;
    }
  }
  return bytes;
}

absl::Status CacheOptions::Validate() const {
  if (pools.empty()) return absl::InvalidArgumentError("at least one pool is required");
  absl::flat_hash_set<std::string> names;
  for (const auto& p : pools) {
    KVD_RETURN_IF_ERROR(p.Validate());
    if (!names.insert(p.name).second) {
      return absl::InvalidArgumentError(absl::StrCat("duplicate pool name '", p.name, "'"));
    }
  }
  // The budget bounds what the pools may hold together; one beyond their capacity bounds nothing
  // and reads as if it did.
  const int64_t capacity_bytes = CapacityBytes();
  if (budget_bytes > capacity_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "budget_bytes ", budget_bytes, " is more than the pools hold together (", capacity_bytes,
        " bytes): raise the pools' capacity_blocks, or set budget_bytes to at most that (0: exactly that)"));
  }
  if (budget_bytes < 0) return absl::InvalidArgumentError(absl::StrCat("budget_bytes must be >= 0, not ", budget_bytes));
  if (checkpoint_budget_bytes < 0) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint_budget_bytes must be >= 0, not ", checkpoint_budget_bytes));
  }
  if (session_ttl < absl::ZeroDuration()) return absl::InvalidArgumentError(absl::StrCat("session_ttl_s must be >= 0, not ", absl::FormatDuration(session_ttl)));
  if (checkpoint_ttl < absl::ZeroDuration()) return absl::InvalidArgumentError(absl::StrCat("checkpoint_ttl_s must be >= 0, not ", absl::FormatDuration(checkpoint_ttl)));
  if (session_max_protected_blocks < 0) {
    return absl::InvalidArgumentError(absl::StrCat("session_max_protected_blocks must be >= 0, not ", session_max_protected_blocks));
  }
  if (max_engine_state_bytes < 0) return absl::InvalidArgumentError(absl::StrCat("max_engine_state_bytes must be >= 0, not ", max_engine_state_bytes));
  if (checkpoint_state_bytes < 0) return absl::InvalidArgumentError(absl::StrCat("checkpoint_state_bytes must be >= 0, not ", checkpoint_state_bytes));
  if (max_checkpoint_state_bytes_per_worker < 0) {
    return absl::InvalidArgumentError("max_checkpoint_state_bytes_per_worker must be >= 0");
  }
  if (!(0 < boundary_low_watermark && boundary_low_watermark <= boundary_high_watermark &&
        boundary_high_watermark <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "boundary_low_watermark and boundary_high_watermark must satisfy 0 < low <= high <= 1, not low ",
        boundary_low_watermark, ", high ", boundary_high_watermark));
  }
  if (!(0 <= demote_reserve && demote_reserve <= 0.5)) {
    return absl::InvalidArgumentError(absl::StrCat("demote_reserve must be in [0, 0.5], not ", demote_reserve));
  }
  if (event_buffer <= 0) return absl::InvalidArgumentError(absl::StrCat("event_buffer must be > 0, not ", event_buffer));
  if (step_credit_blocks < 0 || step_credit_blocks > 65536) {
    return absl::InvalidArgumentError(absl::StrCat("step_credit_blocks must be between 0 and 65536, not ", step_credit_blocks));
  }
  if (max_requests_per_worker < 0) return absl::InvalidArgumentError(absl::StrCat("max_requests_per_worker must be >= 0, not ", max_requests_per_worker));
  if (max_bytes_per_worker < 0) return absl::InvalidArgumentError(absl::StrCat("max_bytes_per_worker must be >= 0, not ", max_bytes_per_worker));
  if (!(0 < slru_main_fraction && slru_main_fraction < 1)) {
    return absl::InvalidArgumentError(absl::StrCat("slru_main_fraction must be in (0, 1), not ", slru_main_fraction));
  }
  if (!(0 <= slru_ghost_fraction && slru_ghost_fraction <= 16)) {
    return absl::InvalidArgumentError(absl::StrCat("slru_ghost_fraction must be in [0, 16], not ", slru_ghost_fraction));
  }
  if (!(0 < horizon_probation && horizon_probation <= 64) || !(0 < horizon_main && horizon_main <= 64)) {
    return absl::InvalidArgumentError(absl::StrCat("horizon_probation and horizon_main must be in (0, 64], not ",
                                                   horizon_probation, " and ", horizon_main));
  }
  if (!(0 <= horizon_sample_every && horizon_sample_every <= 1024)) {
    return absl::InvalidArgumentError(absl::StrCat("horizon_sample_every must be in [0, 1024], not ", horizon_sample_every));
  }
  if (!(1 <= horizon_margin && horizon_margin <= 10)) {
    return absl::InvalidArgumentError(absl::StrCat("horizon_margin must be in [1, 10], not ", horizon_margin));
  }
  return pressure.Validate();
}

absl::string_view EvictionPolicyName(EvictionPolicy policy) {
  switch (policy) {
    case EvictionPolicy::kLru: return "lru";
    case EvictionPolicy::kSlru: return "slru";
    case EvictionPolicy::kHorizon: return "horizon";
  }
  return "unknown";
}

bool ParseEvictionPolicy(absl::string_view name, EvictionPolicy* policy) {
  for (EvictionPolicy p : {EvictionPolicy::kLru, EvictionPolicy::kSlru, EvictionPolicy::kHorizon}) {
    if (name == EvictionPolicyName(p)) {
      *policy = p;
      return true;
    }
  }
  return false;
}

std::string PublishOutcomeName(PublishOutcome outcome) {
  switch (outcome) {
    case PublishOutcome::kKept: return "kept";
    case PublishOutcome::kAlreadyCached: return "already_cached";
    case PublishOutcome::kDuplicate: return "duplicate";
    case PublishOutcome::kNoParent: return "no_parent";
  }
  return "unknown";
}

absl::StatusOr<std::unique_ptr<KvCache>> KvCache::Create(CacheOptions options, const Clock* clock) {
  KVD_RETURN_IF_ERROR(options.Validate());
  int64_t budget = options.budget_bytes == 0 ? options.CapacityBytes() : options.budget_bytes;
  if (options.checkpoint_budget_bytes == 0) options.checkpoint_budget_bytes = budget / 4;
  return std::unique_ptr<KvCache>(new KvCache(std::move(options), clock, budget));
}

KvCache::KvCache(CacheOptions options, const Clock* clock, int64_t budget_bytes)
    : options_(std::move(options)),
      clock_(clock),
      pool_geometries_(options_.pools),
      events_(static_cast<size_t>(options_.event_buffer)),
      index_(pool_geometries_,
             [this] {
               // SLRU remembers the keys of evicted probation blocks (ghosts); LRU none.
               std::vector<int64_t> ghosts;
               for (const auto& p : options_.pools) {
                 ghosts.push_back(options_.eviction_policy != EvictionPolicy::kLru
                                      ? static_cast<int64_t>(options_.slru_ghost_fraction * p.capacity_blocks)
                                      : 0);
               }
               return ghosts;
             }()),
      ledger_(budget_bytes,
              [this] {
                std::vector<BudgetLedger::PoolLimit> limits;
                for (const auto& p : options_.pools) {
                  BudgetLedger::PoolLimit limit{p.capacity_blocks, p.block_bytes_all_shards(), {}};
                  // A hybrid pool charges each unit its group's bytes on every shard (§2.5).
                  for (size_t g = 0; g < p.groups.size(); ++g) {
                    limit.groups.push_back({p.groups[g].capacity, p.GroupUnitBytes(static_cast<int>(g)) * p.num_shards});
                  }
                  limits.push_back(std::move(limit));
                }
                return limits;
              }()),
      pressure_(options_.pressure) {
  for (const auto& g : options_.pools) {
    auto pool = std::make_unique<Pool>(g);
    pool->reserve_blocks = static_cast<int64_t>(options_.demote_reserve * static_cast<double>(g.capacity_blocks));
    if (options_.eviction_policy == EvictionPolicy::kSlru) {
      pool->queue.set_main_limits(options_.slru_main_fraction,
                                  static_cast<int64_t>(options_.slru_main_fraction * g.capacity_blocks));
    } else if (options_.eviction_policy == EvictionPolicy::kHorizon) {
      PolicyDuel::Options d;
      d.capacity_blocks = g.capacity_blocks;
      d.probation_horizon = static_cast<int64_t>(options_.horizon_probation * g.capacity_blocks);
      d.main_horizon = static_cast<int64_t>(options_.horizon_main * g.capacity_blocks);
      d.main_share = options_.slru_main_fraction;
      d.sample_every = options_.horizon_sample_every;
      d.margin = options_.horizon_margin;
      if (d.sample_every > 0) pool->duel = std::make_unique<PolicyDuel>(d);
      pool->queue.set_order(EvictionQueue::Order::kHorizon);  // without shadows; else the duel sets it per use
      pool->queue.set_main_limits(options_.slru_main_fraction, std::numeric_limits<int64_t>::max());
      pool->queue.set_horizons(d.probation_horizon, d.main_horizon);
    }
    if (pool->spine_group >= 0 && g.hybrid()) {
      absl::StatusOr<HybridSpine> spine = HybridSpine::Create(g, static_cast<PoolId>(pools_.size()));
      KVD_CHECK(spine.ok());  // Validate accepted the groups
      pool->spine = std::make_unique<HybridSpine>(*std::move(spine));
      pool->component_node.assign(static_cast<size_t>(g.capacity_blocks), nullptr);
    }
    owners_.AddPool(g.capacity_blocks);
    pools_.push_back(std::move(pool));
  }
}

KvCache::~KvCache() = default;

absl::StatusOr<PoolId> KvCache::FindPool(absl::string_view name) const {
  for (PoolId i = 0; i < pool_geometries_.size(); ++i) {
    if (pool_geometries_[i].name == name) return i;
  }
  std::vector<absl::string_view> names;
  for (const PoolGeometry& g : pool_geometries_) names.push_back(g.name);
  return absl::NotFoundError(
      absl::StrCat("unknown pool '", name, "' (this kvd has: ", absl::StrJoin(names, ", "), ")"));
}

int64_t KvCache::MaxHitBlocks(const Pool& pool, int64_t prompt_tokens) const {
  // A pool with KV groups hits only through its spine's lookup, which serves every group
  // (docs/hybrid.md §2.6): a block chain alone says nothing of the window or the state at its end.
  // A hybrid pool without a full group has no spine yet and hits nothing.
  if (pool.geometry.hybrid() && pool.spine == nullptr) return 0;
  // At least one prompt token is left to compute: the engine needs its logits.
  return prompt_tokens <= 0 ? 0 : (prompt_tokens - 1) / pool.geometry.block_tokens;
}

absl::Status KvCache::CheckWorkerLimitsLocked(const WorkerId& worker, int64_t requests,
                                              int64_t bytes) const {
  const WorkerTable::Usage usage = workers_.usage(worker);
  if (options_.max_requests_per_worker > 0 &&
      usage.requests + requests > options_.max_requests_per_worker) {
    return absl::ResourceExhaustedError(
        absl::StrCat("worker '", worker.value(), "' holds ", usage.requests,
                     " live requests; max_requests_per_worker is ", options_.max_requests_per_worker));
  }
  if (options_.max_bytes_per_worker > 0 && usage.reserved_bytes + bytes > options_.max_bytes_per_worker) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "worker '", worker.value(), "' would reserve ", usage.reserved_bytes + bytes,
        " KV bytes; max_bytes_per_worker is ", options_.max_bytes_per_worker));
  }
  return absl::OkStatus();
}

absl::StatusOr<KvCache::Request*> KvCache::FindRequestLocked(const RequestId& id) const {
  auto it = requests_.find(id);
  if (it == requests_.end()) {
    return absl::NotFoundError(
        absl::StrCat("request '", id.value(), "' is not live (never admitted, or already released)"));
  }
  return it->second.get();
}

absl::StatusOr<PoolId> KvCache::ValidateSpecLocked(const RequestSpec& spec) const {
  KVD_RETURN_IF_ERROR(CheckId("request id", spec.id.value(), /*required=*/true));
  KVD_RETURN_IF_ERROR(CheckId("session id", spec.session.value(), false));
  KVD_RETURN_IF_ERROR(CheckId("resume_from", spec.resume_from.value(), false));
  if (!spec.session.empty()) {
    auto session = sessions_.find(spec.session);
    if (session != sessions_.end() && session->second.salt.has_value() &&
        *session->second.salt != spec.ns.cache_salt) {
      return absl::PermissionDeniedError(
          absl::StrCat("session '", spec.session.value(), "' belongs to another tenant (another cache_salt)"));
    }
  }
  KVD_ASSIGN_OR_RETURN(PoolId pool, FindPool(spec.ns.pool));
  if (spec.prompt.empty()) return absl::InvalidArgumentError("prompt is empty");
  if (spec.max_new_tokens < 0) return absl::InvalidArgumentError("max_new_tokens must be >= 0");
  const PoolGeometry& g = pool_geometries_[pool];
  const int64_t prompt_len = static_cast<int64_t>(spec.prompt.size());
  // Compared before adding: a wire value near INT64_MAX must not wrap the sum.
  if (prompt_len > g.max_model_len || spec.max_new_tokens > g.max_model_len - prompt_len) {
    return absl::OutOfRangeError(absl::StrCat("prompt (", spec.prompt.size(), ") + max_new_tokens (",
                                              spec.max_new_tokens, ") exceeds max_model_len ",
                                              g.max_model_len, " of pool '", g.name, "'"));
  }
  if (g.hybrid()) {
    KVD_RETURN_IF_ERROR(CheckGroupsFitLocked(pool, spec));
    return pool;
  }
  const int64_t blocks = g.BlocksFor(prompt_len + spec.max_new_tokens);
  if (blocks > g.capacity_blocks || ledger_.BytesOf(pool, blocks) > ledger_.budget_bytes()) {
    return absl::OutOfRangeError(absl::StrCat("request needs ", blocks, " blocks (",
                                              ledger_.BytesOf(pool, blocks),
                                              " bytes): larger than the pool or the whole budget"));
  }
  return pool;
}

absl::StatusOr<AdmitResult> KvCache::DecideLocked(const RequestSpec& spec, PoolId pool) const {
  if (requests_.contains(spec.id)) {
    return absl::AlreadyExistsError(absl::StrCat("request '", spec.id.value(), "' is already live"));
  }
  auto ckpt = checkpoints_.find(spec.id);
  if (ckpt != checkpoints_.end() && spec.resume_from != spec.id) {
    return absl::AlreadyExistsError(absl::StrCat(
        "request id '", spec.id.value(), "' names a checkpoint; pass resume_from to resume it"));
  }
  const PoolGeometry& g = pool_geometries_[pool];
  if (g.hybrid()) {
    const std::vector<int64_t> units = UnitsFor(g, static_cast<int64_t>(spec.prompt.size()) + spec.max_new_tokens);
    KVD_RETURN_IF_ERROR(CheckWorkerLimitsLocked(spec.limit_key(), 1, ledger_.BytesOfUnits(pool, units)));
    AdmitResult out;
    out.projected_bytes = ledger_.BytesOfUnits(pool, units);
    out.available_bytes = ledger_.budget_bytes() - ledger_.reserved_bytes();
    out.decision = ledger_.CanReserveUnits(pool, units) ? AdmitDecision::kAdmitted : AdmitDecision::kWait;
    return out;
  }
  const int64_t blocks =
      g.BlocksFor(static_cast<int64_t>(spec.prompt.size()) + spec.max_new_tokens);
  KVD_RETURN_IF_ERROR(CheckWorkerLimitsLocked(spec.limit_key(), 1, ledger_.BytesOf(pool, blocks)));
  AdmitResult out;
  out.projected_bytes = ledger_.BytesOf(pool, blocks);
  out.available_bytes = ledger_.budget_bytes() - ledger_.reserved_bytes();
  out.decision = ledger_.CanReserve(pool, blocks) ? AdmitDecision::kAdmitted : AdmitDecision::kWait;
  return out;
}

absl::StatusOr<AdmitResult> KvCache::Admit(const RequestSpec& spec) {
  // What depends on the request alone is built before the lock: its copies of the prompt and the
  // chained keys of its full blocks (hashing, the one per-token cost of a lookup).
  auto prepared = std::make_unique<Request>();
  if (absl::StatusOr<PoolId> p = FindPool(spec.ns.pool);
      p.ok() && static_cast<int64_t>(spec.prompt.size()) <= pool_geometries_[*p].max_model_len) {
    prepared->spec = spec;
    prepared->known_tokens = spec.prompt;
    prepared->keys = ChainKeys(spec.ns, spec.prompt, pool_geometries_[*p].block_tokens);
  }
  absl::StatusOr<AdmitResult> result;
  {
    absl::MutexLock lock(&mu_);
    ExpireLocked(nullptr);
    absl::StatusOr<PoolId> pool = ValidateSpecLocked(spec);
    if (pool.ok()) result = DecideLocked(spec, *pool);
    else result = pool.status();
    if (!result.ok()) {
      ++counters_.rejected;
    } else if (result->decision == AdmitDecision::kWait) {
      ++counters_.waited;
    } else {
      std::unique_ptr<Request> req = std::move(prepared);
      if (req->spec.id.empty()) {  // not prepared above (cannot happen for a valid spec; be safe)
        req->spec = spec;
        req->known_tokens = spec.prompt;
      }
      req->serial = next_serial_++;
      req->pool = *pool;
      const PoolGeometry& geo = pool_geometries_[*pool];
      const int64_t tokens = static_cast<int64_t>(spec.prompt.size()) + spec.max_new_tokens;
      req->admitted_at = clock_->Now();
      if (geo.hybrid()) {
        req->reserved_units = UnitsFor(geo, tokens);
        req->reserved_blocks = 0;
        for (int64_t u : req->reserved_units) req->reserved_blocks += u;
        KVD_CHECK(ledger_.ReserveUnits(*pool, req->reserved_units).ok());
      } else {
        req->reserved_blocks = geo.BlocksFor(tokens);
        KVD_CHECK(ledger_.Reserve(*pool, req->reserved_blocks).ok());
      }
      workers_.AddUsage(spec.limit_key(), 1, ReservedBytesLocked(*req));
      requests_.emplace(spec.id, std::move(req));
      ++counters_.admitted;
      UpdatePressureLocked();
    }
  }
  Deliver();
  return result;
}

absl::StatusOr<AdmitResult> KvCache::Fits(const RequestSpec& spec) const {
  absl::MutexLock lock(&mu_);
  KVD_ASSIGN_OR_RETURN(PoolId pool, ValidateSpecLocked(spec));
  return DecideLocked(spec, pool);
}

absl::StatusOr<AcquireResult> KvCache::Acquire(const RequestId& id, OnInFlight on_in_flight) {
  absl::StatusOr<AcquireResult> result;
  {
    absl::MutexLock lock(&mu_);
    ExpireLocked(nullptr);
    absl::StatusOr<Request*> req = FindRequestLocked(id);
    if (!req.ok()) {
      result = req.status();
    } else if ((*req)->acquired) {
      result = absl::FailedPreconditionError(
          absl::StrCat("request '", id.value(), "' has already acquired its state"));
    } else {
      Request& r = **req;
      CheckpointRecord* ckpt = nullptr;
      if (!r.spec.resume_from.empty()) {
        auto it = checkpoints_.find(r.spec.resume_from);
        if (it != checkpoints_.end() && it->second->orphaned) ckpt = it->second.get();
      }
      const bool hybrid = pools_[r.pool]->geometry.hybrid();
      std::optional<InFlightInfo> ahead;
      if (on_in_flight == OnInFlight::kDefer && r.spec.resume_from.empty()) {  // a resume enters nothing
        ahead = InFlightAheadLocked(*pools_[r.pool], r.spec.ns, r.spec.prompt, r.keys);
      }
      if (ahead.has_value()) {
        AcquireResult deferred;
        deferred.pool = r.pool;
        deferred.deferred = true;
        deferred.in_flight = std::move(ahead);
        result = std::move(deferred);
      } else {
        result = ckpt != nullptr ? (hybrid ? ResumeGroupsLocked(r, *ckpt) : ResumeLocked(r, *ckpt))
               : hybrid        ? AcquireGroupsLocked(r)
                               : AcquirePrefixLocked(r);
        if (result.ok()) {
          r.acquired = true;
          NoteAcquiredLocked(r, *result);  // what it found in flight; then it holds its own
          UpdatePressureLocked();
        }
      }
    }
  }
  Deliver();
  return result;
}

absl::StatusOr<AcquireResult> KvCache::AcquirePrefixLocked(Request& req) {
  Pool& pool = *pools_[req.pool];
  const int32_t bt = pool.geometry.block_tokens;
  const int64_t prompt_len = static_cast<int64_t>(req.spec.prompt.size());
  const NamespaceRoot* root = index_.FindRoot(req.spec.ns);
  std::vector<CachedBlock*> hit =
      index_.Match(root, req.spec.prompt, bt, MaxHitBlocks(pool, prompt_len), req.keys);
  const int64_t total_blocks = pool.geometry.BlocksFor(prompt_len);
  const int64_t fresh = total_blocks - static_cast<int64_t>(hit.size());
  // Hit blocks that are evictable now stop being so once referenced: check room for the fresh
  // blocks first, so that a failure changes nothing.
  int64_t pinning = 0;
  for (CachedBlock* b : hit) pinning += pool.blocks[b->address.index].refs == 0 ? 1 : 0;
  const int64_t reclaimable = pool.allocator.num_free() + pool.num_cached_unreferenced - pinning;
  if (fresh > reclaimable) {
    return absl::ResourceExhaustedError(absl::StrCat("pool '", pool.geometry.name, "' has ",
                                                     reclaimable, " reclaimable blocks, need ", fresh));
  }
  for (CachedBlock* b : hit) {
    RefLocked(req.pool, b->address.index);
    if (options_.eviction_policy != EvictionPolicy::kLru) b->reused = true;  // referenced: not queued
    pool.NoteUse(*b, /*reused=*/true);
  }
  const Owner writer = WriterOf(req);
  absl::StatusOr<std::vector<BlockIndex>> owned = AllocateOwnedLocked(req.pool, fresh, req.serial, &writer);
  KVD_CHECK(owned.ok());
  AcquireResult out;
  out.pool = req.pool;
  for (CachedBlock* b : hit) req.table.push_back(b->address.index);
  out.publishers = PublishersLocked(hit);
  for (BlockIndex b : *owned) req.table.push_back(b);
  req.num_tokens = prompt_len;
  req.cached_tokens = static_cast<int64_t>(hit.size()) * bt;
  counters_.lookups++;
  counters_.hit_tokens += req.cached_tokens;
  counters_.miss_tokens += prompt_len - req.cached_tokens;
  out.blocks = req.table;
  out.num_tokens = req.num_tokens;
  out.cached_tokens = req.cached_tokens;
  return out;
}

absl::StatusOr<AcquireResult> KvCache::ResumeLocked(Request& req, CheckpointRecord& ckpt) {
  if (ckpt.pool != req.pool) {
    return absl::FailedPreconditionError(absl::StrCat(
        "checkpoint '", ckpt.id.value(), "' was taken on pool '", pools_[ckpt.pool]->geometry.name,
        "' (another KV grouping than pool '", pools_[req.pool]->geometry.name, "'s): resume it on its own pool"));
  }
  if (!(ckpt.ns == req.spec.ns)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "checkpoint '", ckpt.id.value(), "' belongs to another namespace than the request"));
  }
  // The checkpoint and the prompt must agree where both have tokens; the longer one is the
  // request's sequence (a checkpoint taken mid-prefill is shorter than the prompt).
  const std::vector<Token>& prompt = req.spec.prompt;
  const size_t common = std::min(prompt.size(), ckpt.tokens.size());
  if (!std::equal(prompt.begin(), prompt.begin() + common, ckpt.tokens.begin())) {
    return absl::FailedPreconditionError(absl::StrCat(
        "checkpoint '", ckpt.id.value(), "' does not continue the request's prompt"));
  }
  std::vector<Token> tokens = ckpt.tokens.size() >= prompt.size() ? ckpt.tokens : prompt;
  Pool& pool = *pools_[req.pool];
  const int32_t bt = pool.geometry.block_tokens;
  const int64_t valid = static_cast<int64_t>(ckpt.tokens.size());  // tokens with KV in the blocks
  const int64_t n = static_cast<int64_t>(tokens.size());
  // The block holding the next token to compute must be writable. If it was published after the
  // checkpoint was taken it is immutable now: give the request a fresh block there and let it
  // recompute the checkpoint's tokens in that block (fewer than block_tokens).
  // Likewise every block from there on that a fence holds: the checkpoint's old writer may still
  // be writing past the checkpoint into it (kv_cache_fences.cc). And any block that has a writer
  // in the ledger (a pull its request started is still writing it): the request recomputes from
  // the first of them. A fence's writer writes only past what it had computed, so past this
  // checkpoint: a block below the tail that a fence writes, before any block recomputed, is read
  // where it lies and taken from the fence (kv_cache_fences.cc).
  const int64_t tail_pos = valid / bt;
  std::vector<int64_t> replace;
  for (int64_t i = 0; i < static_cast<int64_t>(ckpt.blocks.size()); ++i) {
    const Owner* w = owners_.OwnerOf(req.pool, ckpt.blocks[i]);
    const bool fenced_head = w != nullptr && w->kind == OwnerKind::kFence && i < tail_pos && replace.empty();
    if ((i == tail_pos && pool.blocks[ckpt.blocks[i]].kind != BlockState::Kind::kOwned) ||
        (i >= tail_pos && FencedLocked(req.pool, ckpt.blocks[i])) || (w != nullptr && !fenced_head)) {
      replace.push_back(i);
    }
  }
  const int64_t total_blocks = pool.geometry.BlocksFor(n);
  const int64_t extra = total_blocks - static_cast<int64_t>(ckpt.blocks.size());
  const int64_t fresh = static_cast<int64_t>(replace.size()) + extra;
  if (fresh > pool.allocator.num_free() + pool.num_cached_unreferenced) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "pool '", pool.geometry.name, "' has too few reclaimable blocks for the resumed request"));
  }
  const int64_t grow = std::max<int64_t>(0, total_blocks - req.reserved_blocks);
  ledger_.Unreserve(ckpt.pool, ckpt.charged_blocks);
  if (!ledger_.CanReserve(req.pool, grow)) {
    KVD_CHECK(ledger_.Reserve(ckpt.pool, ckpt.charged_blocks).ok());
    return absl::ResourceExhaustedError("KV budget cannot cover the resumed generation's blocks");
  }
  KVD_CHECK(ledger_.Reserve(req.pool, grow).ok());
  req.reserved_blocks += grow;
  workers_.AddUsage(req.spec.limit_key(), 0, ledger_.BytesOf(req.pool, grow));
  orphan_blocks_bytes_ -= ledger_.BytesOf(ckpt.pool, ckpt.charged_blocks);

  // The checkpoint's references pass to the request's table; its owned blocks to the request,
  // which writes them from now on (nobody did while it was orphaned), except those replaced below.
  req.table = ckpt.blocks;
  const Owner writer = WriterOf(req);
  for (size_t i = 0, next = 0; i < req.table.size(); ++i) {
    if (next < replace.size() && replace[next] == static_cast<int64_t>(i)) {
      ++next;
      continue;
    }
    BlockState& s = pool.blocks[req.table[i]];
    if (s.kind != BlockState::Kind::kOwned) continue;
    s.owner = req.serial;
    if (const Owner* w = owners_.OwnerOf(req.pool, req.table[i]); w != nullptr) {
      const Owner fence = *w;  // below the tail, as checked above
      KVD_CHECK(owners_.Transfer(req.pool, req.table[i], fence, writer).ok());
    } else {
      KVD_CHECK(owners_.Assign(req.pool, req.table[i], writer).ok());
    }
  }
  absl::StatusOr<std::vector<BlockIndex>> owned = AllocateOwnedLocked(req.pool, fresh, req.serial, &writer);
  KVD_CHECK(owned.ok());
  auto next_owned = owned->begin();
  req.cached_tokens = valid;
  for (int64_t i : replace) {
    UnrefLocked(req.pool, req.table[i]);
    req.table[i] = *next_owned++;
    req.cached_tokens = std::min(req.cached_tokens, i * bt);  // recomputed from the fresh block
  }
  req.table.insert(req.table.end(), next_owned, owned->end());
  req.known_tokens = tokens;
  req.num_tokens = n;

  AcquireResult out;
  out.pool = req.pool;
  out.blocks = req.table;
  out.num_tokens = n;
  out.cached_tokens = req.cached_tokens;
  out.resumed = true;
  out.resumed_tokens = std::move(tokens);
  out.engine_state = std::move(ckpt.engine_state);
  orphans_.erase({ckpt.expires_at, ckpt.serial});
  ChargeCheckpointStateLocked(ckpt, -1);
  checkpoints_.erase(ckpt.id);  // destroys `ckpt`
  counters_.resumed++;
  return out;
}

absl::StatusOr<std::vector<BlockIndex>> KvCache::Extend(const RequestId& id,
                                                       int64_t additional_tokens) {
  absl::StatusOr<std::vector<BlockIndex>> result;
  {
    absl::MutexLock lock(&mu_);
    ExpireLocked(nullptr);
    result = ExtendLocked(id, additional_tokens);
  }
  Deliver();
  return result;
}

absl::StatusOr<std::vector<BlockIndex>> KvCache::ExtendLocked(const RequestId& id,
                                                             int64_t additional_tokens) {
  return GrowLocked(id, additional_tokens, {});
}

void KvCache::ReleaseLocked(Request& req, bool completed) {
  auto it = checkpoints_.find(req.spec.id);
  CheckpointRecord* own_ckpt =
      it != checkpoints_.end() && it->second->serial == req.serial ? it->second.get() : nullptr;
  if (own_ckpt != nullptr && completed) {
    DropCheckpointLocked(req.spec.id);
    own_ckpt = nullptr;
  }
  if (!req.spec.session.empty() && req.acquired) UpdateSessionLocked(req);
  ReleaseWritesLocked(req);  // a pull writing some of them keeps them until UnpinBlocks
  InflightEndedLocked(req);  // whoever waits on its blocks computes them
  for (auto g = req.groups.rbegin(); g != req.groups.rend(); ++g) {
    UnrefTableLocked(req.pool, g->blocks);
    if (g->checkpoint != HybridSpine::kNone) UnrefLocked(req.pool, g->checkpoint);
  }
  ReorderReleasedWindowsLocked(req);  // kv_cache_spine.cc
  UnrefTableLocked(req.pool, req.table);
  for (const Request::OwnCopy& c : req.own_copies) UnrefLocked(req.pool, c.block);  // private: freed
  workers_.AddUsage(req.spec.limit_key(), -1, -ReservedBytesLocked(req));
  if (!req.reserved_units.empty()) ledger_.UnreserveUnits(req.pool, req.reserved_units);
  else ledger_.Unreserve(req.pool, req.reserved_blocks);
  if (own_ckpt != nullptr) OrphanCheckpointLocked(*own_ckpt);
  UpdatePressureLocked();
}

absl::Status KvCache::Release(const RequestId& id, bool completed) {
  absl::Status status;
  {
    absl::MutexLock lock(&mu_);
    ExpireLocked(nullptr);
    absl::StatusOr<Request*> req = FindRequestLocked(id);
    if (!req.ok()) {
      status = req.status();
    } else {
      ReleaseLocked(**req, completed);
      requests_.erase(id);
    }
  }
  Deliver();
  return status;
}

std::vector<WorkerId> KvCache::PublishersLocked(const std::vector<CachedBlock*>& blocks) const {
  std::vector<WorkerId> out;
  for (const CachedBlock* b : blocks) {
    const WorkerId& w = workers_.Name(b->publisher);
    if (w.empty()) continue;
    if (std::find(out.begin(), out.end(), w) == out.end()) out.push_back(w);
  }
  return out;
}

int64_t KvCache::ReleaseWorker(const WorkerId& worker) {
  int64_t released = 0;
  {
    absl::MutexLock lock(&mu_);
    ExpireLocked(nullptr);
    workers_.Forget(worker);
    DropCreditLocked(worker, nullptr);
    std::vector<RequestId> ids;
    for (const auto& [id, req] : requests_) {
      if (req->spec.owner == worker) ids.push_back(id);
    }
    for (const RequestId& id : ids) {
      ReleaseLocked(*requests_[id], /*completed=*/false);
      requests_.erase(id);
      ++released;
    }
  }
  Deliver();
  return released;
}

absl::StatusOr<int64_t> KvCache::PeekPrefixLen(const Namespace& ns,
                                               absl::Span<const Token> tokens) const {
  KVD_ASSIGN_OR_RETURN(PoolId id, FindPool(ns.pool));
  const int32_t bt = pool_geometries_[id].block_tokens;
  const std::vector<BlockKey> keys =
      ChainKeys(ns, tokens, bt, std::min<int64_t>(static_cast<int64_t>(tokens.size()), pool_geometries_[id].max_model_len) / bt);
  absl::MutexLock lock(&mu_);
  const Pool& pool = *pools_[id];
  if (pool.spine != nullptr) {
    std::vector<CachedBlock*> chain;
    HybridHit hit;
    LookupHybridLocked(pool, ns, tokens, keys, &chain, &hit);
    return hit.depth * pool.geometry.block_tokens;
  }
  std::vector<CachedBlock*> hit =
      index_.Match(index_.FindRoot(ns), tokens, pool.geometry.block_tokens,
                   MaxHitBlocks(pool, static_cast<int64_t>(tokens.size())), keys);
  return static_cast<int64_t>(hit.size()) * pool.geometry.block_tokens;
}

}  // namespace kvd
