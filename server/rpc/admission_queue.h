// AdmissionQueue: where Start waits for room in the KV budget, inside the daemon.
//
// A Start whose request does not fit now waits here instead of making its client poll. Waits are
// first come, first served per pool: while anyone waits for a pool, a newer Start for that pool
// queues behind them even if it would fit (a stream of small requests cannot starve a large
// one). A wait ends when the request is admitted (or Admit fails outright), at its deadline
// (RESOURCE_EXHAUSTED), when its caller gives up, or at Close (UNAVAILABLE).
//
// One thread, "kvd-admit", retries the head of each pool's queue when Poke says room may have
// appeared (after every release the service makes), and at least every kRetryInterval, because
// room also appears in ways nobody announces (a checkpoint's TTL runs out inside another call).
// With nobody waiting it sleeps until a wait begins: no timer, and pokes do not wake it (an idle
// daemon's threads do not wake 50 times a second, nor on every step that frees blocks).
//
// Locking: mu_ guards the queues; KvCache::Admit runs under mu_ (order: mu_, then KvCache's lock),
// so that "nobody waits, admit now" is atomic. `done` callbacks never run under mu_ or any
// KvCache lock; they run on the caller's thread when answered at once, else on kvd-admit's, and
// must not block (they start the Acquire and finish the RPC).
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <string>
#include <utility>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/core/kv_cache.h"

namespace kvd {

class AdmissionQueue {
 public:
  // The answer, and how long the request waited (zero when it did not queue).
  using Done = std::function<void(absl::StatusOr<AdmitResult>, absl::Duration waited)>;
  static constexpr absl::Duration kRetryInterval = absl::Milliseconds(20);
  // Starts one worker (process) may have waiting at once; past it RESOURCE_EXHAUSTED at once, so a
  // worker cannot grow the queue, and the daemon's memory, without bound.
  static constexpr int64_t kMaxWaitersPerWorker = 1024;

  explicit AdmissionQueue(KvCache* cache);
  ~AdmissionQueue();  // Close()
  AdmissionQueue(const AdmissionQueue&) = delete;
  AdmissionQueue& operator=(const AdmissionQueue&) = delete;

  // Admits `spec` now when nobody waits for its pool and it fits; else waits until `deadline`.
  // `cancelled` is polled by the queue's thread (the RPC's IsCancelled). `done` runs exactly once.
  void Admit(RequestSpec spec, absl::Time deadline, std::function<bool()> cancelled, Done done)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Room may have appeared: retry the queue heads now.
  void Poke() ABSL_LOCKS_EXCLUDED(mu_);
  // Ends every wait with `why`, then refuses new ones with it (drain). Idempotent.
  void Close(absl::Status why = absl::UnavailableError("kvd is draining: no new work is admitted"))
      ABSL_LOCKS_EXCLUDED(mu_);
  // Takes new waits again after Close (an undone drain). No-op while open.
  void Reopen() ABSL_LOCKS_EXCLUDED(mu_);
  int64_t waiting() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Waiter {
    RequestSpec spec;
    absl::Time queued_at;
    absl::Time deadline;
    std::function<bool()> cancelled;
    Done done;
  };
  using Answer = std::pair<Waiter, absl::StatusOr<AdmitResult>>;
  void Run() ABSL_LOCKS_EXCLUDED(mu_);
  bool Woken() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return poked_ || stop_; }
  bool HasWaiters() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return waiting_ > 0 || stop_; }
  // Pops every head that can be answered now (admitted, failed, expired, cancelled) into `out`.
  void SweepLocked(absl::Time now, std::vector<Answer>* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  KvCache* const cache_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::deque<Waiter>> queues_ ABSL_GUARDED_BY(mu_);  // by pool name
  int64_t waiting_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<WorkerId, int64_t> waiting_by_worker_ ABSL_GUARDED_BY(mu_);  // by limit_key
  bool poked_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status closed_ ABSL_GUARDED_BY(mu_);  // OK while open
  std::thread thread_;
};

}  // namespace kvd
