#include "server/core/eviction_queue.h"

#include "server/core/status_macros.h"

namespace kvd {

void EvictionQueue::Push(CachedBlock* block) {
  KVD_CHECK(!block->queued);
  auto& tier = block->protect_count > 0 ? protected_ : unprotected_;
  tier.emplace(Order{block->last_use, block->serial}, block);
  block->queued = true;
}

void EvictionQueue::Remove(CachedBlock* block) {
  if (!block->queued) return;
  auto& tier = block->protect_count > 0 ? protected_ : unprotected_;
  size_t n = tier.erase(Order{block->last_use, block->serial});
  KVD_CHECK(n == 1);
  block->queued = false;
}

CachedBlock* EvictionQueue::Peek() const {
  if (!unprotected_.empty()) return unprotected_.begin()->second;
  if (!protected_.empty()) return protected_.begin()->second;
  return nullptr;
}

CachedBlock* EvictionQueue::PeekUnprotected() const {
  return unprotected_.empty() ? nullptr : unprotected_.begin()->second;
}

}  // namespace kvd
