// Executor runs tasks on a few background threads, in submission order per thread pick-up. The
// tiers use it so that disk reads, writes and flushes never run on a gRPC thread. Destruction
// finishes every queued task, then joins.
#pragma once

#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace kvd {

class Executor {
 public:
  explicit Executor(int threads);
  ~Executor();
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  void Submit(std::function<void()> task) ABSL_LOCKS_EXCLUDED(mu_);
  // Tasks queued or running.
  int64_t pending() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Loop();
  mutable absl::Mutex mu_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  int64_t running_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace kvd
