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
#include "server/core/block_key.h"
#include "server/core/types.h"

namespace kvd {

enum class CacheEventKind { kStored, kRemoved, kCleared };
std::string CacheEventKindName(CacheEventKind kind);

struct CacheEvent {
  uint64_t sequence = 0;  // assigned by EventLog::Append; first event is 1
  CacheEventKind kind = CacheEventKind::kStored;
  absl::Time time;
  std::string pool;        // empty for kCleared (all pools)
  std::string adapter;     // the namespace's adapter, for routers that key by LoRA
  BlockKey key;            // kStored, kRemoved
  BlockKey parent_key;     // kStored; zero for the first block of a prefix
  bool has_parent = false;
  BlockIndex block = 0;    // kStored, kRemoved
  int32_t block_tokens = 0;
  std::vector<Token> tokens;  // kStored
  // kStored: the rest of the namespace, for router block hashes (server/events/router_hash.h).
  // Internal: never sent on the WatchEvents stream.
  std::vector<std::string> media_keys;
  std::string method;
  std::string cache_salt;
  // Where the block is: empty for the device pool (G1), "disk" for blocks a warm restart reloaded
  // onto G3 (their `block` index means nothing then).
  std::string medium;
};

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
