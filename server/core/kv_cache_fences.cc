// KvCache: fences. A block is never handed to a new owner while a writer kvd can no longer reach
// may still write it: the blocks of requests ended by a handoff or restart or held by an
// attachment whose stream broke, and every free block (and orphaned checkpoint tail) of memory
// adopted from a process that died without saying who was writing it, are held by a fence until
// the attachment that held them re-attaches having quiesced (or its process is gone), or until a
// lease TTL has passed on the engine's clock, by which time every worker that could not renew
// has stopped writing by itself (cache_state::FenceRecord; docs/security.md, "Leases and fencing").
#include <algorithm>
#include <functional>

#include "absl/container/flat_hash_set.h"
#include "proto/vocab/status_macros.h"
#include "server/core/kv_cache.h"

namespace kvd {
using cache_state::FencedBlockKey;
using cache_state::FenceOwner;

bool KvCache::FencedLocked(PoolId pool, BlockIndex index) const { return fenced_.contains(FencedBlockKey(pool, index)); }

void KvCache::AddFenceLocked(const FenceOwner& owner, PoolId pool_id, absl::Span<const BlockIndex> blocks,
                             absl::Time until) {
  Pool& pool = *pools_[pool_id];
  FenceRecord f;
  f.serial = next_serial_++;
  f.attachment = owner.attachment;
  f.pid = owner.pid;
  f.pool = pool_id;
  f.until = until;
  std::vector<BlockIndex> claim;
  for (BlockIndex b : blocks) {
    const BlockState& s = pool.blocks[b];
    if (s.kind == BlockState::Kind::kCached) continue;  // published: its bytes are never rewritten
    if (s.kind == BlockState::Kind::kFree) claim.push_back(b);
    f.blocks.push_back(b);
  }
  if (f.blocks.empty()) return;
  KVD_CHECK(pool.allocator.Claim(claim).ok());  // free, as just checked
  for (BlockIndex b : f.blocks) {
    BlockState& s = pool.blocks[b];
    if (s.kind == BlockState::Kind::kFree) {
      s.kind = BlockState::Kind::kOwned;
      s.owner = f.serial;
      ++pool.num_owned;
    }
    ++s.refs;
    ++fenced_[FencedBlockKey(pool_id, b)];
  }
  // Blocks it took from the free list count against the budget as a request's would, so that
  // admission never promises blocks a fence holds. A successor configured smaller than its
  // predecessor's live use may lack the room: the fence holds them uncharged then.
  const int64_t n = static_cast<int64_t>(claim.size());
  if (ledger_.CanReserve(pool_id, n)) {
    KVD_CHECK(ledger_.Reserve(pool_id, n).ok());
    f.charged_blocks = n;
  }
  fences_.emplace(std::make_pair(until, f.serial), std::move(f));
  UpdatePressureLocked();
}

void KvCache::LiftFenceLocked(FenceMap::iterator it) {
  const FenceRecord& f = it->second;
  for (BlockIndex b : f.blocks) {
    auto count = fenced_.find(FencedBlockKey(f.pool, b));
    if (--count->second == 0) fenced_.erase(count);
    UnrefLocked(f.pool, b, /*touch=*/false);  // freed when the fence held it alone
  }
  ledger_.Unreserve(f.pool, f.charged_blocks);
  fences_.erase(it);
  UpdatePressureLocked();
}

void KvCache::EndFencedLocked(Request& req, const FenceOwner& owner, absl::Time until) {
  const Pool& pool = *pools_[req.pool];
  std::vector<BlockIndex> own;  // what its writer may still be writing
  for (BlockIndex b : req.table) {
    const BlockState& s = pool.blocks[b];
    if (s.kind == BlockState::Kind::kOwned && s.owner == req.serial) own.push_back(b);
  }
  // Released first, as interrupted (its checkpoint kept): the blocks it alone held go back to
  // the free list, and the fence takes them from there, charged as the request was.
  ReleaseLocked(req, /*completed=*/false);
  AddFenceLocked(owner, req.pool, own, until);
}

void KvCache::FenceCreditLocked(const WorkerId& worker, const FenceOwner& owner, absl::Time until) {
  // Its worker may be writing a block it placed since its last step.
  std::vector<CreditHeld> taken;
  DropCreditLocked(worker, &taken);
  for (const CreditHeld& c : taken) AddFenceLocked(owner, c.pool, c.blocks, until);
}

int64_t KvCache::EndAllFenced(absl::Duration ttl, const absl::flat_hash_map<WorkerId, uint32_t>& pids) {
  int64_t ended = 0;
  {
    absl::MutexLock lock(&mu_);
    ExpireLocked(nullptr);
    const absl::Time until = clock_->Now() + ttl;
    const auto owner_of = [&pids](const WorkerId& worker) {
      auto pid = pids.find(worker);
      return FenceOwner{worker, pid != pids.end() ? pid->second : 0};
    };
    for (auto& [id, req] : requests_) {
      EndFencedLocked(*req, owner_of(req->spec.owner), until);
      ++ended;
    }
    requests_.clear();
    std::vector<WorkerId> holders;
    for (const auto& [worker, credit] : credit_) holders.push_back(worker);
    for (const WorkerId& worker : holders) FenceCreditLocked(worker, owner_of(worker), until);
  }
  Deliver();
  return ended;
}

int64_t KvCache::FenceWorker(const WorkerId& worker, uint32_t pid, absl::Duration ttl) {
  int64_t ended = 0;
  {
    absl::MutexLock lock(&mu_);
    ExpireLocked(nullptr);
    const absl::Time until = clock_->Now() + ttl;
    const FenceOwner owner{worker, pid};
    workers_.Forget(worker);
    FenceCreditLocked(worker, owner, until);
    std::vector<RequestId> ids;
    for (const auto& [id, req] : requests_) {
      if (req->spec.owner == worker) ids.push_back(id);
    }
    for (const RequestId& id : ids) {
      EndFencedLocked(*requests_[id], owner, until);
      requests_.erase(id);
      ++ended;
    }
  }
  Deliver();
  return ended;
}

int64_t KvCache::FenceFreeBlocks(absl::Duration ttl) {
  int64_t fenced = 0;
  {
    absl::MutexLock lock(&mu_);
    ExpireLocked(nullptr);
    const absl::Time until = clock_->Now() + ttl;
    // O(capacity) under the lock: only at start, before anything is served.
    for (PoolId p = 0; p < pools_.size(); ++p) {
      std::vector<BlockIndex> held;
      for (BlockIndex b = 0; b < pools_[p]->blocks.size(); ++b) {
        if (pools_[p]->blocks[b].kind == BlockState::Kind::kFree) held.push_back(b);
      }
      // An orphaned checkpoint's own blocks from the one its last token is in: the request it
      // was taken from may still be writing past it there.
      const int64_t bt = pools_[p]->geometry.block_tokens;
      for (const auto& [id, ckpt] : checkpoints_) {
        if (!ckpt->orphaned || ckpt->pool != p) continue;
        for (size_t i = ckpt->tokens.size() / bt; i < ckpt->blocks.size(); ++i) {
          const BlockState& s = pools_[p]->blocks[ckpt->blocks[i]];
          if (s.kind == BlockState::Kind::kOwned && s.owner == ckpt->serial) held.push_back(ckpt->blocks[i]);
        }
      }
      fenced += static_cast<int64_t>(held.size());
      AddFenceLocked(FenceOwner{}, p, held, until);
    }
  }
  Deliver();
  return fenced;
}

int64_t KvCache::LiftMatchingLocked(const std::function<bool(const FenceRecord&)>& match) {
  // Keys first: erasing from a btree invalidates its iterators.
  std::vector<std::pair<absl::Time, uint64_t>> due;
  for (const auto& [key, f] : fences_) {
    if (match(f)) due.push_back(key);
  }
  int64_t lifted = 0;
  for (const auto& key : due) {
    auto it = fences_.find(key);
    lifted += static_cast<int64_t>(it->second.blocks.size());
    LiftFenceLocked(it);
  }
  return lifted;
}

int64_t KvCache::LiftFences(const WorkerId& attachment, uint32_t pid) {
  if (attachment.empty() || pid == 0) return 0;
  int64_t lifted = 0;
  {
    absl::MutexLock lock(&mu_);
    ExpireLocked(nullptr);
    lifted = LiftMatchingLocked(
        [&](const FenceRecord& f) { return f.pid == pid && f.attachment == attachment; });
  }
  Deliver();
  return lifted;
}

int64_t KvCache::LiftFencesOfGone(uint32_t pid) {
  if (pid == 0) return 0;
  int64_t lifted = 0;
  {
    absl::MutexLock lock(&mu_);
    ExpireLocked(nullptr);
    lifted = LiftMatchingLocked([pid](const FenceRecord& f) { return f.pid == pid; });
  }
  Deliver();
  return lifted;
}

int64_t KvCache::ExpireFences() {
  int64_t fenced = 0;
  {
    absl::MutexLock lock(&mu_);
    ExpireLocked(nullptr);  // lifts what is due
    fenced = static_cast<int64_t>(fenced_.size());
  }
  Deliver();
  return fenced;
}

std::vector<uint32_t> KvCache::FencedPids() const {
  absl::MutexLock lock(&mu_);
  absl::flat_hash_set<uint32_t> pids;
  for (const auto& [key, f] : fences_) {
    if (f.pid != 0) pids.insert(f.pid);
  }
  return std::vector<uint32_t>(pids.begin(), pids.end());
}

}  // namespace kvd
