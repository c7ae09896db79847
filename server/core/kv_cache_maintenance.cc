// KvCache: sessions, expiry, trimming, pressure, notifications, reports and invariant checks.
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "server/core/kv_cache.h"
#include "proto/vocab/status_macros.h"

namespace kvd {

void KvCache::UpdateSessionLocked(const Request& req) {
  auto [it, created] = sessions_.try_emplace(req.spec.session);
  Session& session = it->second;
  // Made by another tenant since this request was admitted: left alone.
  if (!created && session.salt.has_value() && *session.salt != req.spec.ns.cache_salt) return;
  session.salt = req.spec.ns.cache_salt;
  std::vector<ProtectedRef> old = std::move(session.protected_blocks);
  session.protected_blocks.clear();
  session.worker = req.spec.owner;
  // Protect the new prefix before unprotecting the old, so shared blocks never dip to zero.
  const Pool& pool = *pools_[req.pool];
  for (BlockIndex b : req.table) {
    if (static_cast<int64_t>(session.protected_blocks.size()) >= options_.session_max_protected_blocks) break;
    const BlockState& s = pool.blocks[b];
    if (s.kind != BlockState::Kind::kCached) break;
    SetProtectionLocked(req.pool, s.node, +1);
    session.protected_blocks.push_back({req.pool, b, s.node->serial});
  }
  for (const ProtectedRef& ref : old) {
    const BlockState& s = pools_[ref.pool]->blocks[ref.index];
    if (s.kind == BlockState::Kind::kCached && s.node->serial == ref.node_serial) {
      SetProtectionLocked(ref.pool, s.node, -1);
    }
  }
  session_expiry_.erase({session.expires_at, req.spec.session});
  session.expires_at = clock_->Now() + options_.session_ttl;
  session_expiry_.emplace(std::make_pair(session.expires_at, req.spec.session), true);
}

void KvCache::DropSessionLocked(const SessionId& id) {
  auto it = sessions_.find(id);
  KVD_CHECK(it != sessions_.end());
  for (const ProtectedRef& ref : it->second.protected_blocks) {
    const BlockState& s = pools_[ref.pool]->blocks[ref.index];
    // A softly protected block may have been evicted (and its index reused) since.
    if (s.kind == BlockState::Kind::kCached && s.node->serial == ref.node_serial) {
      SetProtectionLocked(ref.pool, s.node, -1);
    }
  }
  session_expiry_.erase({it->second.expires_at, id});
  sessions_.erase(it);
}

void KvCache::ExpireLocked(GcStats* stats) {
  const absl::Time now = clock_->Now();
  op_now_ns_ = static_cast<uint64_t>(absl::ToUnixNanos(now));
  while (!session_expiry_.empty() && session_expiry_.begin()->first.first <= now) {
    DropSessionLocked(session_expiry_.begin()->first.second);
    if (stats != nullptr) ++stats->sessions_expired;
  }
  while (!orphans_.empty() && orphans_.begin()->first.first <= now) {
    DropCheckpointLocked(orphans_.begin()->second);
    if (stats != nullptr) ++stats->checkpoints_dropped;
  }
  while (!fences_.empty() && fences_.begin()->first.first <= now) LiftFenceLocked(fences_.begin());
}

absl::Status KvCache::CloseSession(const SessionId& session) {
  absl::MutexLock lock(&mu_);
  ExpireLocked(nullptr);
  if (!sessions_.contains(session)) {
    return absl::NotFoundError(absl::StrCat("unknown session '", session.value(), "'"));
  }
  DropSessionLocked(session);
  return absl::OkStatus();
}

absl::StatusOr<SessionInfo> KvCache::GetSession(const SessionId& session) const {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(session);
  if (it == sessions_.end() || it->second.expires_at <= clock_->Now()) {
    return absl::NotFoundError(absl::StrCat("unknown session '", session.value(), "'"));
  }
  return SessionInfoLocked(session, it->second);
}

SessionInfo KvCache::SessionInfoLocked(const SessionId& id, const Session& s) const {
  SessionInfo info;
  info.id = id;
  info.worker = s.worker;
  info.protected_blocks = static_cast<int64_t>(s.protected_blocks.size());
  info.expires_at = s.expires_at;
  return info;
}

std::vector<SessionInfo> KvCache::ListSessions() const {
  absl::MutexLock lock(&mu_);
  const absl::Time now = clock_->Now();
  std::vector<SessionInfo> out;
  for (const auto& [key, unused] : session_expiry_) {
    if (key.first <= now) continue;
    out.push_back(SessionInfoLocked(key.second, sessions_.at(key.second)));
  }
  return out;
}

GcStats KvCache::Gc(absl::Duration max_idle) {
  GcStats stats;
  {
    absl::MutexLock lock(&mu_);
    ExpireLocked(&stats);
    const bool all = max_idle <= absl::ZeroDuration();
    const uint64_t cutoff =
        all ? 0 : static_cast<uint64_t>(absl::ToUnixNanos(clock_->Now() - max_idle));
    for (auto& pool : pools_) {
      while (CachedBlock* victim = pool->queue.PeekUnprotected()) {
        if (!all && victim->last_use > cutoff) break;
        EvictOneLocked(*pool, victim, EvictReason::kGc);
        ++stats.blocks_freed;
        stats.bytes_freed += pool->geometry.block_bytes_all_shards();
      }
    }
    UpdatePressureLocked();
  }
  Deliver();
  return stats;
}

int64_t KvCache::Boundary() {
  int64_t evicted = 0;
  {
    absl::MutexLock lock(&mu_);
    ExpireLocked(nullptr);
    for (auto& pool : pools_) {
      const double capacity = static_cast<double>(pool->geometry.capacity_blocks);
      int64_t used = pool->geometry.capacity_blocks - pool->allocator.num_free();
      if (used <= options_.boundary_high_watermark * capacity) continue;
      const double target = options_.boundary_low_watermark * capacity;
      while (used > target) {
        CachedBlock* victim = pool->queue.PeekUnprotected();
        if (victim == nullptr) break;
        EvictOneLocked(*pool, victim, EvictReason::kBoundary);
        --used;
        ++evicted;
      }
    }
    UpdatePressureLocked();
  }
  Deliver();
  return evicted;
}

int64_t KvCache::ClearCache() {
  int64_t evicted = 0;
  {
    absl::MutexLock lock(&mu_);
    ExpireLocked(nullptr);
    bool all_unreferenced = true;
    for (const auto& pool : pools_) {
      all_unreferenced &= pool->num_cached == pool->num_cached_unreferenced;
    }
    for (auto& pool : pools_) {
      while (CachedBlock* victim = pool->queue.Peek()) {
        // When the whole index goes, watchers get one kCleared instead of a removal per block.
        EvictOneLocked(*pool, victim, all_unreferenced ? EvictReason::kClear : EvictReason::kGc);
        ++evicted;
      }
    }
    if (all_unreferenced) {
      scratch_event_ = CacheEvent{};
      scratch_event_.kind = CacheEventKind::kCleared;
      EmitLocked();
    }
    UpdatePressureLocked();
  }
  Deliver();
  return evicted;
}

void KvCache::UpdatePressureLocked() {
  const int64_t budget = ledger_.budget_bytes();
  int64_t reclaimable = 0;
  for (const auto& pool : pools_) {
    reclaimable += (pool->allocator.num_free() + pool->num_cached_unreferenced) *
                   pool->geometry.block_bytes_all_shards();
  }
  const int64_t available = std::min(budget - ledger_.reserved_bytes(), reclaimable);
  const double fraction = budget > 0 ? static_cast<double>(available) / budget : 0.0;
  if (pressure_.Update(fraction)) {
    outbox_.pressure_changed = true;
    outbox_.level = pressure_.level();
    outbox_.available = fraction;
    outbox_pending_.store(true, std::memory_order_relaxed);
  }
}

void KvCache::EmitLocked() {
  scratch_event_.time = absl::FromUnixNanos(static_cast<int64_t>(op_now_ns_));
  scratch_event_.sequence = events_.Append(scratch_event_);
  if (!event_listeners_.empty()) {
    outbox_.events.push_back(scratch_event_);
    outbox_pending_.store(true, std::memory_order_relaxed);
  }
}

void KvCache::Deliver() {
  RunDemotions();
  WakeInflightWaiters();
  if (demote_wanted_.load(std::memory_order_relaxed)) {
    absl::MutexLock deliver_lock(&deliver_mu_);  // SetMoverWake waits for it
    std::function<void()> wake;
    {
      absl::MutexLock lock(&mu_);
      if (demote_wanted_.exchange(false, std::memory_order_relaxed)) wake = mover_wake_;
    }
    if (wake) wake();
  }
  // Cheap exit for the common case: nothing to deliver and no listener work.
  if (!outbox_pending_.load(std::memory_order_relaxed)) return;
  absl::MutexLock deliver_lock(&deliver_mu_);
  Outbox out;
  std::vector<std::pair<int, EventListener>> event_listeners;
  std::vector<std::pair<int, PressureListener>> pressure_listeners;
  {
    absl::MutexLock lock(&mu_);
    std::swap(out, outbox_);
    outbox_pending_.store(false, std::memory_order_relaxed);
    if (out.empty()) return;
    event_listeners = event_listeners_;
    pressure_listeners = pressure_listeners_;
  }
  for (const CacheEvent& e : out.events) {
    for (const auto& [handle, fn] : event_listeners) fn(e);
  }
  if (out.pressure_changed) {
    for (const auto& [handle, fn] : pressure_listeners) fn(out.level, out.available);
  }
}

int KvCache::AddEventListener(EventListener fn) {
  absl::MutexLock lock(&mu_);
  event_listeners_.emplace_back(next_listener_, std::move(fn));
  return next_listener_++;
}

int KvCache::AddPressureListener(PressureListener fn) {
  absl::MutexLock lock(&mu_);
  pressure_listeners_.emplace_back(next_listener_, std::move(fn));
  return next_listener_++;
}

void KvCache::RemoveListener(int handle) {
  absl::MutexLock lock(&mu_);
  std::erase_if(event_listeners_, [handle](const auto& p) { return p.first == handle; });
  std::erase_if(pressure_listeners_, [handle](const auto& p) { return p.first == handle; });
}

void KvCache::RemoveListenerAndWait(int handle) {
  absl::MutexLock deliver_lock(&deliver_mu_);  // a delivery in progress finishes first
  RemoveListener(handle);
}

PressureLevel KvCache::pressure_level() const {
  absl::MutexLock lock(&mu_);
  return pressure_.level();
}

HandleInfo KvCache::HandleOfLocked(const Request& req) const {
  HandleInfo h;
  h.id = req.spec.id;
  h.pool = pool_geometries_[req.pool].name;
  h.owner = req.spec.owner;
  h.session = req.spec.session;
  h.acquired = req.acquired;
  h.num_tokens = req.num_tokens;
  h.cached_tokens = req.cached_tokens;
  h.reserved_bytes = ReservedBytesLocked(req);
  h.blocks = req.table;
  auto it = checkpoints_.find(req.spec.id);
  h.has_checkpoint = it != checkpoints_.end() && it->second->serial == req.serial;
  h.admitted_at = req.admitted_at;
  return h;
}

std::vector<HandleInfo> KvCache::ListHandles() const {
  absl::MutexLock lock(&mu_);
  std::vector<HandleInfo> out;
  out.reserve(requests_.size());
  for (const auto& [id, req] : requests_) out.push_back(HandleOfLocked(*req));
  std::sort(out.begin(), out.end(),
            [](const HandleInfo& a, const HandleInfo& b) { return a.admitted_at < b.admitted_at; });
  return out;
}

absl::Status KvCache::CheckOwner(const RequestId& id, const WorkerId& worker) const {
  absl::MutexLock lock(&mu_);
  KVD_ASSIGN_OR_RETURN(Request * req, FindRequestLocked(id));
  if (req->spec.owner != worker) {
    return absl::PermissionDeniedError(
        absl::StrCat("request '", id.value(), "' belongs to another worker"));
  }
  return absl::OkStatus();
}

absl::StatusOr<HandleInfo> KvCache::GetHandle(const RequestId& id) const {
  absl::MutexLock lock(&mu_);
  KVD_ASSIGN_OR_RETURN(Request * req, FindRequestLocked(id));
  return HandleOfLocked(*req);
}

CacheReport KvCache::Report() const {
  absl::MutexLock lock(&mu_);
  CacheReport r = counters_;
  for (PoolId i = 0; i < pools_.size(); ++i) {
    const Pool& pool = *pools_[i];
    PoolReport p;
    p.name = pool.geometry.name;
    p.block_bytes = pool.geometry.block_bytes_all_shards();
    p.capacity_blocks = pool.geometry.capacity_blocks;
    p.free_blocks = pool.allocator.num_free();
    p.owned_blocks = pool.num_owned;
    p.cached_blocks = pool.num_cached;
    p.evictable_blocks = pool.num_cached_unreferenced;
    p.protected_blocks = pool.queue.num_protected();
    p.reserved_blocks = ledger_.reserved_blocks(i);
    for (size_t g = 0; g < pool.geometry.groups.size(); ++g) {
      const int gi = static_cast<int>(g);
      PoolReport::Group rg;
      rg.name = pool.geometry.groups[g].name;
      rg.capacity = pool.allocator.group_capacity(gi);
      rg.unit_bytes = pool.geometry.GroupUnitBytes(gi) * pool.geometry.num_shards;
      rg.free = pool.allocator.num_free(gi);
      rg.cached = pool.CachedIn(gi);
      rg.owned = rg.capacity - rg.free - rg.cached;  // the invariant checker counts it from the blocks
      rg.evictable = pool.EvictableIn(gi);
      rg.reserved = ledger_.reserved_units(i, gi);
      rg.limited_hits = pool.limits[g].hits;
      rg.limited_tokens = pool.limits[g].tokens;
      p.groups.push_back(std::move(rg));
    }
    r.pools.push_back(std::move(p));
  }
  r.budget_bytes = ledger_.budget_bytes();
  r.reserved_bytes = ledger_.reserved_bytes();
  r.checkpoint_bytes = orphan_blocks_bytes_;
  r.checkpoint_state_bytes = checkpoint_state_bytes_;
  r.live_requests = static_cast<int64_t>(requests_.size());
  r.orphaned_checkpoints = static_cast<int64_t>(orphans_.size());
  r.sessions = static_cast<int64_t>(sessions_.size());
  r.indexed_blocks = index_.num_blocks();
  r.pressure = pressure_.level();
  r.available_fraction = pressure_.available_fraction();
  r.last_event_sequence = events_.last_sequence();
  return r;
}

}  // namespace kvd
