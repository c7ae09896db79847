// InflightWaits: where a Start waits for prompt blocks another live request of its namespace is
// computing (StartRequest.wait_for_in_flight_ms; docs/architecture.md, "Prefixes in flight").
//
// A start that asks to wait and whose next blocks are in flight (KvCache::InFlightAhead) waits
// here before admission, or after an acquire that deferred to them (KvCache::Acquire,
// OnInFlight::kDefer, its admission given back first), holding nothing: no reservation, no block,
// no in-flight entry. So no
// request ever waits on a waiting one (a waiter computes nothing another could wait for), nor on
// itself, and no chain of waits can close into a cycle. A wait ends when the computing request no
// longer holds any of the blocks it found (KvCache::InFlightHeld): published (then the start's
// Acquire hits them) or let go without publishing (it ended, was preempted, fenced, or its worker
// died: the start computes them); at its deadline (then it computes them); when its caller gives
// up or its worker detaches (CANCELLED / FAILED_PRECONDITION, from `cancelled`); at Close
// (UNAVAILABLE). Every wait is bounded by kMaxWait and its caller's deadline.
//
// One thread, "kvd-inflight", re-checks the waits when Poke says in-flight blocks went
// (KvCache::SetInflightWake, after the operation that let them go, outside the engine lock), and
// at least every kRetryInterval for deadlines and cancellations; with no wait, it sleeps until one
// begins (no timer; pokes do not wake it).
//
// Locking: mu_ guards the waits; InFlightHeld and PeekPrefixLen run under mu_ (order: mu_, then
// KvCache's lock). `done` callbacks never run under mu_ or any KvCache lock; they run on the
// caller's thread when answered at once, else on kvd-inflight's, and must not block.
#pragma once

#include <cstdint>
#include <functional>
#include <list>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/core/kv_cache.h"

namespace kvd {

class InflightWaits {
 public:
  enum class Outcome { kPublished = 1, kReleased = 2, kTimedOut = 3 };  // the wire's InFlightWait
  using Done = std::function<void(absl::StatusOr<Outcome>, absl::Duration waited)>;
  static constexpr absl::Duration kMaxWait = absl::Seconds(30);
  static constexpr absl::Duration kRetryInterval = absl::Milliseconds(20);
  // Waits one worker (process) may have at once; past it the start does not wait (it computes).
  static constexpr int64_t kMaxWaitersPerWorker = 1024;

  explicit InflightWaits(KvCache* cache);
  ~InflightWaits();  // Close()
  InflightWaits(const InflightWaits&) = delete;
  InflightWaits& operator=(const InflightWaits&) = delete;

  // Waits until `what` (found by InFlightAhead for `ns`, `prompt`) is no longer held, or
  // `deadline`. `limit_key`: the worker whose kMaxWaitersPerWorker it counts against (over it:
  // answered kTimedOut at once, as if the bound were 0). `cancelled` is polled by the thread.
  // `done` runs exactly once.
  void Wait(const WorkerId& limit_key, InFlightInfo what, Namespace ns, std::vector<Token> prompt,
            absl::Time deadline, std::function<absl::Status()> cancelled, Done done) ABSL_LOCKS_EXCLUDED(mu_);
  void Poke() ABSL_LOCKS_EXCLUDED(mu_);
  void Close(absl::Status why = absl::UnavailableError("kvd is draining: no new work is admitted"))
      ABSL_LOCKS_EXCLUDED(mu_);
  void Reopen() ABSL_LOCKS_EXCLUDED(mu_);
  int64_t waiting() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Waiter {
    WorkerId limit_key;
    InFlightInfo what;
    Namespace ns;
    std::vector<Token> prompt;
    absl::Time queued_at;
    absl::Time deadline;
    std::function<absl::Status()> cancelled;  // OK: still wanted
    Done done;
  };
  using Answer = std::pair<Waiter, absl::StatusOr<Outcome>>;
  void Run() ABSL_LOCKS_EXCLUDED(mu_);
  bool Woken() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return poked_ || stop_; }
  bool HasWaiters() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !waiters_.empty() || stop_; }
  // Moves every wait that can be answered now into `out`.
  void SweepLocked(absl::Time now, std::vector<Answer>* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Outcome EndedOutcomeLocked(const Waiter& w) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  KvCache* const cache_;
  mutable absl::Mutex mu_;
  std::list<Waiter> waiters_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<WorkerId, int64_t> waiting_by_worker_ ABSL_GUARDED_BY(mu_);
  bool poked_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status closed_ ABSL_GUARDED_BY(mu_);  // OK while open
  std::thread thread_;
};

}  // namespace kvd
