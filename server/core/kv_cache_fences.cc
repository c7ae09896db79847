// KvCache: fences. A block is never handed to a new owner while a writer kvd can no longer reach
// may still write it: the blocks of requests ended by a handoff or restart or held by an
// attachment whose stream broke, and every free block (and orphaned checkpoint tail) of memory
// adopted from a process that died without saying who was writing it, are held by a fence until
// the attachment that held them re-attaches having quiesced (or its process is gone), or until a
// lease TTL has passed on the engine's clock, by which time every worker that could not renew
// has stopped writing by itself (cache_state::FenceRecord; docs/security.md, "Leases and fencing").
//
// In the ownership ledger (block_ledger.h) a fence is Owner{kFence, its attachment, its serial}:
// the writer of every block it holds that is not cached. Every fence path is a ledger transition:
// a request's writable blocks are handed over (EndFencedLocked), credit is Transferred
// (FenceCreditLocked), a block nobody writes (free, an orphaned checkpoint's, one imported across
// a handoff) is Assigned (AddFenceLocked), and a lift gives back what the fence writes. Two rules:
// - A block fenced twice has one writer, the first fence; the other holds a reference. When the
//   writer lifts while another fence still holds the block, the write passes to that fence
//   (ReturnWriteLocked): the block never becomes writer-free and reusable while any fence holds it.
// - A fenced writer writes only past what its request had computed, so past any checkpoint taken
//   of it: a resume takes a checkpoint's blocks below its tail from their fence (kv_cache.cc,
//   ResumeLocked) and they are the resumed request's, below its cached_tokens; when it lets go of
//   one still fenced, the write returns to a fence that holds it. The invariant checker allows a
//   fenced block no other writer.
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
                             absl::Time until, uint64_t serial) {
  Pool& pool = *pools_[pool_id];
  FenceRecord f;
  f.serial = serial;
  f.attachment = owner.attachment;
  f.pid = owner.pid;
  f.pool = pool_id;
  f.until = until;
  const Owner me = FenceWriter(f);
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
    // Its writer from now on: this fence, unless the caller handed it over already or another
    // fence holds it (that one stays its writer; this one holds a reference until lifted).
    const Owner* w = owners_.OwnerOf(pool_id, b);
    if (w == nullptr) {
      KVD_CHECK(owners_.Assign(pool_id, b, me).ok());
    } else {
      KVD_CHECK(*w == me || w->kind == OwnerKind::kFence);
    }
  }
  fences_.emplace(std::make_pair(until, f.serial), std::move(f));
  UpdatePressureLocked();
}

void KvCache::ChargeFenceLocked(absl::Time until, uint64_t serial) {
  auto it = fences_.find(std::make_pair(until, serial));
  if (it == fences_.end()) return;
  FenceRecord& f = it->second;
  // The blocks it alone references count against the budget as a request's would. A successor
  // configured smaller than its predecessor's live use may lack the room: the fence holds them
  // uncharged then.
  const Pool& pool = *pools_[f.pool];
  int64_t n = 0;
  std::vector<BlockIndex> alone;
  for (BlockIndex b : f.blocks) {
    if (pool.blocks[b].kind == BlockState::Kind::kOwned && pool.blocks[b].refs == 1) alone.push_back(b);
  }
  n = static_cast<int64_t>(alone.size());
  if (pool.geometry.hybrid()) {  // each unit its group's bytes (docs/hybrid.md §2.5)
    std::vector<int64_t> units = UnitsOfLocked(f.pool, alone);
    if (ledger_.CanReserveUnits(f.pool, units)) {
      KVD_CHECK(ledger_.ReserveUnits(f.pool, units).ok());
      f.charged_units = std::move(units);
      f.charged_blocks = n;
    }
  } else if (ledger_.CanReserve(f.pool, n)) {
    KVD_CHECK(ledger_.Reserve(f.pool, n).ok());
    f.charged_blocks = n;
  }
  UpdatePressureLocked();
}

void KvCache::ReturnWriteLocked(PoolId pool, BlockIndex block, const Owner& from, uint64_t except_serial) {
  // O(fenced blocks) when the block is fenced: only a block fenced twice, or one a resume took
  // from a fence, comes here fenced.
  if (FencedLocked(pool, block)) {
    for (const auto& [key, f] : fences_) {
      if (f.serial == except_serial || f.pool != pool) continue;
      if (std::find(f.blocks.begin(), f.blocks.end(), block) == f.blocks.end()) continue;
      KVD_CHECK(owners_.Transfer(pool, block, from, FenceWriter(f)).ok());
      return;
    }
  }
  KVD_CHECK(owners_.Release(pool, block, from).ok());
}

void KvCache::LiftFenceLocked(FenceMap::iterator it) {
  const FenceRecord& f = it->second;
  const Owner me = FenceWriter(f);
  for (BlockIndex b : f.blocks) {
    auto count = fenced_.find(FencedBlockKey(f.pool, b));
    if (--count->second == 0) fenced_.erase(count);
  }
  // What it writes goes to another fence that still holds it (the block stays out of every new
  // owner's hands until the last fence lifts), else to nobody; then it lets go of its references.
  // A lifted fence owns nothing.
  for (BlockIndex b : f.blocks) {
    const Owner* w = owners_.OwnerOf(f.pool, b);
    if (w != nullptr && *w == me) ReturnWriteLocked(f.pool, b, me, f.serial);
  }
  KVD_CHECK(owners_.Find(f.serial) == nullptr);
  for (BlockIndex b : f.blocks) UnrefLocked(f.pool, b, /*touch=*/false);  // freed when the fence held it alone
  if (!f.charged_units.empty()) ledger_.UnreserveUnits(f.pool, f.charged_units);
  else ledger_.Unreserve(f.pool, f.charged_blocks);
  fences_.erase(it);
  UpdatePressureLocked();
}

void KvCache::EndFencedLocked(Request& req, const FenceOwner& owner, absl::Time until) {
  // What its writer may still be writing passes to the fence in the ledger (not what a pull
  // writes for it: the worker does not), the fence references it, and only then the request is
  // released as interrupted (its checkpoint kept): no block it wrote is free for a moment.
  const uint64_t serial = next_serial_++;
  const std::vector<BlockIndex> own = HandOverWritesLocked(req, Owner{OwnerKind::kFence, owner.attachment, serial});
  AddFenceLocked(owner, req.pool, own, until, serial);
  ReleaseLocked(req, /*completed=*/false);
  ChargeFenceLocked(until, serial);
}

void KvCache::FenceCreditLocked(const WorkerId& worker, const FenceOwner& owner, absl::Time until) {
  // Its worker may be writing a block it placed since its last step: each passes from the credit
  // to the fence in one Transfer, then the credit's reference and charge go.
  auto it = credit_.find(worker);
  if (it == credit_.end()) return;
  for (const auto& [pool, pc] : it->second.pools) {
    const Owner from{OwnerKind::kCredit, worker, pc.serial};
    const uint64_t serial = next_serial_++;
    const Owner to{OwnerKind::kFence, owner.attachment, serial};
    const absl::flat_hash_set<BlockIndex>& mine = owners_.BlocksOf(pc.serial);
    std::vector<BlockIndex> blocks(mine.begin(), mine.end());
    std::sort(blocks.begin(), blocks.end());
    for (BlockIndex b : blocks) KVD_CHECK(owners_.Transfer(pool, b, from, to).ok());
    AddFenceLocked(owner, pool, blocks, until, serial);
    for (BlockIndex b : blocks) UnrefLocked(pool, b, /*touch=*/false);
    const int64_t n = static_cast<int64_t>(blocks.size());
    if (pools_[pool]->geometry.hybrid()) {  // a hybrid pool's credit is charged per group's units
      const std::vector<int64_t> units = UnitsOfLocked(pool, blocks);
      ledger_.UnreserveUnits(pool, units);
      workers_.AddUsage(it->second.principal, 0, -ledger_.BytesOfUnits(pool, units));
    } else {
      ledger_.Unreserve(pool, n);
      workers_.AddUsage(it->second.principal, 0, -ledger_.BytesOf(pool, n));
    }
    ChargeFenceLocked(until, serial);
  }
  credit_.erase(it);
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
        // A hybrid pool's window blocks likewise (its state slot is never written again).
        for (const CheckpointRecord::Group& g : ckpt->groups) {
          for (size_t i = 0; i < g.blocks.size(); ++i) {
            const BlockState& s = pools_[p]->blocks[g.blocks[i]];
            if (g.first + static_cast<int64_t>(i) >= static_cast<int64_t>(ckpt->tokens.size()) / bt &&
                s.kind == BlockState::Kind::kOwned && s.owner == ckpt->serial) {
              held.push_back(g.blocks[i]);
            }
          }
        }
      }
      fenced += static_cast<int64_t>(held.size());
      const uint64_t serial = next_serial_++;
      AddFenceLocked(FenceOwner{}, p, held, until, serial);
      ChargeFenceLocked(until, serial);
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
