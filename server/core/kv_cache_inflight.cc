// KvCache: prefixes in flight (docs/architecture.md, "Prefixes in flight"). The InflightIndex
// (inflight_index.h) records the prompt blocks live requests hold writable and have not published;
// a start probes it where its cached prefix ends, and a waiting start watches the run it found.
//
// Entered at Acquire (not a resume) from the end of the namespace's match: the whole cached chain
// on a pool without groups, the spine's (full group's) match on a hybrid pool with a spine, whose
// hit then follows docs/hybrid.md §2.6 (a hybrid pool without a full group enters nothing). Left
// at a publish (the published positions, whatever their outcome) and at every end of the request
// (ReleaseLocked: End, Release, preempt, a fence, its worker gone). A hot handoff's successor
// starts with an empty index: the requests in flight at the handoff are fenced or resumed there,
// not computing for it.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "proto/vocab/status_macros.h"
#include "server/core/kv_cache.h"

namespace kvd {

std::optional<InFlightInfo> KvCache::InFlightInfoLocked(const Namespace& ns, absl::Span<const BlockKey> keys,
                                                        int64_t from) const {
  std::optional<InflightIndex::Run> run = inflight_.Probe(ns, keys, from);
  if (!run.has_value()) return std::nullopt;
  InFlightInfo info;
  info.first_block = run->first;
  info.blocks = run->blocks;
  info.request_id = run->holder;
  info.serial = run->serial;
  info.keys = std::move(run->keys);
  if (auto it = requests_.find(run->holder); it != requests_.end() && it->second->serial == run->serial) {
    const Request& holder = *it->second;
    const int32_t bt = pools_[holder.pool]->geometry.block_tokens;
    info.published_tokens = run->holder_first * bt;
    info.computed_tokens = holder.computed_tokens;
  }
  return info;
}

int64_t KvCache::MatchedBlocksLocked(const Pool& pool, const Namespace& ns, absl::Span<const Token> prompt,
                                     absl::Span<const BlockKey> keys) const {
  std::vector<CachedBlock*> chain;
  if (pool.spine != nullptr) {
    HybridHit hit;
    LookupHybridLocked(pool, ns, prompt, keys, &chain, &hit);
    return hit.full_depth;
  }
  chain = index_.Match(index_.FindRoot(ns), prompt, pool.geometry.block_tokens,
                       MaxHitBlocks(pool, static_cast<int64_t>(prompt.size())), keys);
  return static_cast<int64_t>(chain.size());
}

std::optional<InFlightInfo> KvCache::InFlightAheadLocked(const Pool& pool, const Namespace& ns,
                                                         absl::Span<const Token> prompt,
                                                         absl::Span<const BlockKey> keys) const {
  if (pool.geometry.hybrid() && pool.spine == nullptr) return std::nullopt;  // it enters nothing
  return InFlightInfoLocked(ns, keys, MatchedBlocksLocked(pool, ns, prompt, keys));
}

absl::StatusOr<std::optional<InFlightInfo>> KvCache::InFlightAhead(const Namespace& ns,
                                                                   absl::Span<const Token> prompt) const {
  KVD_ASSIGN_OR_RETURN(PoolId id, FindPool(ns.pool));
  const PoolGeometry& geo = pool_geometries_[id];
  const std::vector<BlockKey> keys = ChainKeys(
      ns, prompt, geo.block_tokens, std::min<int64_t>(static_cast<int64_t>(prompt.size()), geo.max_model_len) / geo.block_tokens);
  absl::MutexLock lock(&mu_);
  return InFlightAheadLocked(*pools_[id], ns, prompt, keys);
}

bool KvCache::InFlightHeld(const InFlightInfo& info) const {
  absl::MutexLock lock(&mu_);
  return inflight_.HoldsAny(info.serial, info.keys);
}

void KvCache::SetInflightWake(std::function<void()> wake) {
  absl::MutexLock deliver_lock(&deliver_mu_);  // Deliver calls it under deliver_mu_
  absl::MutexLock lock(&mu_);
  inflight_wake_ = std::move(wake);
}

int64_t KvCache::inflight_blocks() const {
  absl::MutexLock lock(&mu_);
  return inflight_.size();
}

void KvCache::NoteAcquiredLocked(Request& req, AcquireResult& out) {
  if (out.resumed) return;
  const Pool& pool = *pools_[req.pool];
  if (pool.geometry.hybrid() && pool.spine == nullptr) return;
  const int32_t bt = pool.geometry.block_tokens;
  const int64_t matched = pool.spine != nullptr ? out.full_hit_tokens / bt : out.cached_tokens / bt;
  // What this request found in flight before entering its own: it computes those blocks too (it
  // did not wait, or its wait ended), and holds none of them.
  out.in_flight = InFlightInfoLocked(req.spec.ns, req.keys, matched);
  // A match the hit cap stopped (the last full block of a prompt that fills it, left to compute)
  // may stop at a cached block: nobody computes that one for others.
  int64_t from = matched;
  if (from < static_cast<int64_t>(req.keys.size()) &&
      from == MaxHitBlocks(pool, static_cast<int64_t>(req.spec.prompt.size()))) {
    const NamespaceRoot* root = index_.FindRoot(req.spec.ns);
    const CachedBlock* parent = from > 0 ? pool.blocks[req.table[from - 1]].node : nullptr;
    if (root != nullptr && (from == 0 || parent != nullptr) &&
        index_.FindChild(*root, parent, absl::MakeConstSpan(req.spec.prompt).subspan(from * bt, bt),
                         &req.keys[from]) != nullptr) {
      ++from;
    }
  }
  inflight_.Hold(req.serial, req.spec.id, req.spec.ns, req.keys, from);
}

void KvCache::InflightPublishedLocked(const Request& req, int64_t n) {
  if (inflight_.Published(req.serial, n) > 0) inflight_changed_.store(true, std::memory_order_relaxed);
}

void KvCache::InflightEndedLocked(const Request& req) {
  if (inflight_.End(req.serial) > 0) inflight_changed_.store(true, std::memory_order_relaxed);
}

void KvCache::WakeInflightWaiters() {
  if (!inflight_changed_.load(std::memory_order_relaxed)) return;
  absl::MutexLock deliver_lock(&deliver_mu_);
  std::function<void()> wake;
  {
    absl::MutexLock lock(&mu_);
    if (inflight_changed_.exchange(false, std::memory_order_relaxed)) wake = inflight_wake_;
  }
  if (wake) wake();
}

absl::Status KvCache::CheckInflightLocked() const {
  absl::Status status;
  inflight_.ForEach([&](uint64_t serial, const RequestId& id, int64_t pos, const BlockKey& key) {
    mu_.AssertHeld();  // the lambda runs under the caller's lock; the analysis cannot see through it
    if (!status.ok()) return;
    auto it = requests_.find(id);
    if (it == requests_.end() || it->second->serial != serial) {
      status = absl::InternalError(absl::StrCat("in-flight block ", pos, " names request '", id.value(),
                                                "', which is not live"));
      return;
    }
    const Request& req = *it->second;
    if (!req.acquired || pos >= static_cast<int64_t>(req.keys.size()) || req.keys[pos] != key ||
        pos >= static_cast<int64_t>(req.table.size())) {
      status = absl::InternalError(absl::StrCat("in-flight block ", pos, " of request '", id.value(),
                                                "' is not a prompt block of its table"));
      return;
    }
    if (pools_[req.pool]->blocks[req.table[pos]].kind != BlockState::Kind::kOwned) {
      status = absl::InternalError(absl::StrCat("in-flight block ", pos, " of request '", id.value(),
                                                "' is not writable (published or cached)"));
    }
  });
  return status;
}

}  // namespace kvd
