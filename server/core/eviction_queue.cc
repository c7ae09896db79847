#include "server/core/eviction_queue.h"

#include "proto/vocab/status_macros.h"

namespace kvd {

void EvictionQueue::Insert(CachedBlock* block) {
  const Tier tier = block->protect_count > 0 ? kProtected : block->reused ? kMain : kProbation;
  List& list = lists_[tier];
  const Key key = KeyOf(block);
  block->queued = true;
  block->queue_tier = tier;
  block->queue_spilled = false;
  if (list.tail == nullptr || KeyOf(list.tail) < key) {  // the newest: append
    block->queue_prev = list.tail;
    block->queue_next = nullptr;
    (list.tail != nullptr ? list.tail->queue_next : list.head) = block;
    list.tail = block;
  } else if (key < KeyOf(list.head)) {  // the oldest: prepend
    block->queue_prev = nullptr;
    block->queue_next = list.head;
    list.head->queue_prev = block;
    list.head = block;
  } else {
    spills_[tier].emplace(key, block);
    block->queue_spilled = true;
    return;
  }
  ++list.size;
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
  block->queued = false;
  if (block->queue_spilled) {
    size_t n = spills_[block->queue_tier].erase(KeyOf(block));
    KVD_CHECK(n == 1);
    block->queue_spilled = false;
    return;
  }
  List& list = lists_[block->queue_tier];
  (block->queue_prev != nullptr ? block->queue_prev->queue_next : list.head) = block->queue_next;
  (block->queue_next != nullptr ? block->queue_next->queue_prev : list.tail) = block->queue_prev;
  block->queue_prev = block->queue_next = nullptr;
  --list.size;
}

CachedBlock* EvictionQueue::Oldest(Tier tier) const {
  CachedBlock* listed = lists_[tier].head;
  if (spills_[tier].empty()) return listed;
  const auto& [key, spilled] = *spills_[tier].begin();
  return listed != nullptr && KeyOf(listed) < key ? listed : spilled;
}

CachedBlock* EvictionQueue::Newest(Tier tier) const {
  CachedBlock* listed = lists_[tier].tail;
  if (spills_[tier].empty()) return listed;
  const auto& [key, spilled] = *spills_[tier].rbegin();
  return listed != nullptr && key < KeyOf(listed) ? listed : spilled;
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
