// DemotionMover is the data mover: one thread that keeps each pool's reserve of free blocks
// (CacheOptions::demote_reserve) by demoting the next victims into the lower tiers ahead of need
// (KvCache::DemoteAhead). A request that needs room then takes free blocks, and the copies of the
// blocks that made the room run here, not on the request's thread: a slow sink delays this thread
// only. A block being demoted is held (owned by nobody, pinned, not free) until its copy is done,
// so no request can see it meanwhile. When the mover falls behind, requests still evict (and
// copy) on their own threads, as without it.
//
// The cache wakes it (KvCache::SetMoverWake) when an operation leaves a pool below its reserve;
// it then demotes in batches of `batch_blocks` (each under one short hold of the engine's lock)
// until every pool is back at its reserve or has nothing unprotected left to demote.
//
// The engine's side. KvCache::DemoteAhead(max_blocks): in each pool with fewer free blocks than
// its reserve, demotes up to `max_blocks` unreferenced, unprotected blocks in eviction order
// through the eviction sink, their copies run on the calling thread after the engine's lock;
// returns how many (0 without a sink). KvCache::SetMoverWake(wake): `wake` runs, without the
// engine's lock and one call at a time, after an operation leaves a pool below its reserve;
// SetMoverWake(nullptr) returns once no call of the old one is running.
// Thread-safe. Destruction stops the thread after its current batch and joins it; destroy it
// before the eviction sink goes away.
#pragma once

#include <atomic>
#include <cstdint>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "server/core/kv_cache.h"

namespace kvd {

class DemotionMover {
 public:
  // `cache` is borrowed and must outlive the mover.
  explicit DemotionMover(KvCache* cache, int64_t batch_blocks = 64);
  ~DemotionMover();
  DemotionMover(const DemotionMover&) = delete;
  DemotionMover& operator=(const DemotionMover&) = delete;

  // Asks for a pass (cheap; the cache calls it).
  void Wake() ABSL_LOCKS_EXCLUDED(mu_);
  // Blocks demoted ahead so far.
  int64_t demoted() const { return demoted_.load(std::memory_order_relaxed); }

 private:
  void Run() ABSL_LOCKS_EXCLUDED(mu_);
  bool Ready() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return wanted_ || stop_; }

  KvCache* const cache_;
  const int64_t batch_blocks_;
  absl::Mutex mu_;
  bool wanted_ ABSL_GUARDED_BY(mu_) = true;  // a first pass at start
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::atomic<int64_t> demoted_{0};
  std::thread thread_;  // last: started once everything above exists
};

}  // namespace kvd
