// EventLog numbers every change of the prefix index (block stored, block removed, all cleared)
// with a monotonically increasing sequence number and keeps the most recent ones in a bounded
// ring, so a watcher that reconnects with the last sequence it saw gets what it missed, or learns
// that it fell too far behind and must resync from scratch.
// Thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/vocab/cache_event.h"

namespace kvd {

class EventLog {
 public:
  explicit EventLog(size_t capacity) : capacity_(capacity == 0 ? 1 : capacity) {}

  // Assigns the next sequence number to a copy of `event`, stores it, and returns the number.
  // Copies into a recycled ring slot, so a steady stream of events allocates nothing.
  uint64_t Append(const CacheEvent& event) ABSL_LOCKS_EXCLUDED(mu_);

  struct ReadResult {
    bool resync = false;             // events after `last_seen` were dropped from the ring
    std::vector<CacheEvent> events;  // in sequence order
  };
  // Up to `max_events` events with sequence > last_seen.
  ReadResult ReadAfter(uint64_t last_seen, size_t max_events) const ABSL_LOCKS_EXCLUDED(mu_);

  uint64_t last_sequence() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const size_t capacity_;
  mutable absl::Mutex mu_;
  // Slot of sequence s is ring_[(s - 1) % capacity_]; it holds the last min(capacity, last_sequence)
  // events.
  std::vector<CacheEvent> ring_ ABSL_GUARDED_BY(mu_);
  uint64_t last_sequence_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvd
