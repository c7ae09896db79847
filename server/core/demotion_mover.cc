#include "server/core/demotion_mover.h"

namespace kvd {

DemotionMover::DemotionMover(KvCache* cache, int64_t batch_blocks)
    : cache_(cache), batch_blocks_(batch_blocks > 0 ? batch_blocks : 1) {
  thread_ = std::thread([this] { Run(); });
  cache_->SetMoverWake([this] { Wake(); });
}

DemotionMover::~DemotionMover() {
  cache_->SetMoverWake(nullptr);  // no Wake runs after this
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

void DemotionMover::Wake() {
  absl::MutexLock lock(&mu_);
  wanted_ = true;
}

void DemotionMover::Run() {
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(this, &DemotionMover::Ready));
      if (stop_) return;
      wanted_ = false;
    }
    for (;;) {
      const int64_t n = cache_->DemoteAhead(batch_blocks_);
      demoted_.fetch_add(n, std::memory_order_relaxed);
      if (n < batch_blocks_) break;  // every pool at its reserve, or nothing left to demote
      absl::MutexLock lock(&mu_);
      if (stop_) return;
    }
  }
}

}  // namespace kvd
