#include "server/core/eviction_queue.h"

#include "proto/vocab/status_macros.h"

namespace kvd {

void EvictionQueue::Insert(CachedBlock* block) {
  const Tier tier = block->protect_count > 0 ? kProtected : block->reused ? kMain : kProbation;
  tiers_[tier].emplace(Key{block->last_use, block->serial}, block);
  block->queued = true;
  block->queue_tier = tier;
}

void EvictionQueue::Push(CachedBlock* block) {
  KVD_CHECK(!block->queued);
  Insert(block);
  while (size(kMain) > main_max_) {
    CachedBlock* oldest = Oldest(kMain);
    Remove(oldest);
    oldest->reused = false;
    Insert(oldest);
  }
}

void EvictionQueue::Remove(CachedBlock* block) {
  if (!block->queued) return;
  size_t n = tiers_[block->queue_tier].erase(Key{block->last_use, block->serial});
  KVD_CHECK(n == 1);
  block->queued = false;
}

CachedBlock* EvictionQueue::Oldest(Tier tier) const {
  return tiers_[tier].empty() ? nullptr : tiers_[tier].begin()->second;
}

CachedBlock* EvictionQueue::Newest(Tier tier) const {
  return tiers_[tier].empty() ? nullptr : tiers_[tier].rbegin()->second;
}

CachedBlock* EvictionQueue::HorizonVictim() const {
  if (CachedBlock* b = Oldest(kProbation); Overdue(b, probation_horizon_)) return b;
  if (CachedBlock* b = Oldest(kMain); Overdue(b, main_horizon_)) return b;
  if (CachedBlock* b = Newest(kProbation)) return b;
  return Newest(kMain);
}

CachedBlock* EvictionQueue::UnprotectedVictim() const {
  if (order_ == Order::kHorizon) return HorizonVictim();
  const double main = static_cast<double>(size(kMain));
  const double all = main + static_cast<double>(size(kProbation));
  if (main > main_share_ * all) {
    if (CachedBlock* b = Oldest(kMain)) return b;
  }
  if (CachedBlock* b = Oldest(kProbation)) return b;
  return Oldest(kMain);
}

CachedBlock* EvictionQueue::Peek() const {
  if (CachedBlock* b = UnprotectedVictim()) return b;
  return Oldest(kProtected);
}

CachedBlock* EvictionQueue::PeekUnprotected() const { return UnprotectedVictim(); }

}  // namespace kvd
