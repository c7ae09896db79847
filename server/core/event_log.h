// EventLog numbers every change of the prefix index (block stored, block removed, all cleared)
// with a monotonically increasing sequence number and keeps the most recent ones in a bounded
// ring, so a watcher that reconnects with the last sequence it saw gets what it missed, or learns
// that it fell too far behind and must resync from scratch.
//
// Memory is fixed at construction and nothing is allocated per event: each event is one
// fixed-size EventRecord (sequence, kind, time, block, key, parent key) in a ring of `capacity`
// records, and its variable part — pool, adapter and medium names, and a stored block's tokens —
// goes into a byte ring of `capacity * kPayloadBytesPerEvent` bytes (at least kMinPayloadBytes)
// written in sequence order. A
// payload that the byte ring has since overwritten (long blocks) ends the replayable history
// there: ReadAfter asks a watcher to resync rather than hand it an event without its tokens. So
// replay covers the last `capacity` events or the last ~kPayloadBytesPerEvent * capacity bytes of
// tokens, whichever is shorter. The namespace's media keys, method and salt are not kept (they
// are never sent to watchers).
// Thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/vocab/block_key.h"
#include "proto/vocab/cache_event.h"

namespace kvd {

class EventLog {
 public:
  // Room per event in the byte ring: a 16-token block's tokens and short pool/adapter names.
  static constexpr size_t kPayloadBytesPerEvent = 80;
  static constexpr size_t kMinPayloadBytes = 64 << 10;

  explicit EventLog(size_t capacity);

  // Assigns the next sequence number to `event`, stores it, and returns the number.
  uint64_t Append(const CacheEvent& event) ABSL_LOCKS_EXCLUDED(mu_);

  struct ReadResult {
    bool resync = false;             // events after `last_seen` were dropped from the ring
    std::vector<CacheEvent> events;  // in sequence order
  };
  // Up to `max_events` events with sequence > last_seen.
  ReadResult ReadAfter(uint64_t last_seen, size_t max_events) const ABSL_LOCKS_EXCLUDED(mu_);

  uint64_t last_sequence() const ABSL_LOCKS_EXCLUDED(mu_);
  // The ring's memory: records and payload bytes (fixed at construction).
  size_t memory_bytes() const { return capacity_ * sizeof(EventRecord) + payload_bytes_; }

 private:
  struct EventRecord {
    uint64_t sequence = 0;
    int64_t unix_ns = 0;
    BlockKey key;
    BlockKey parent_key;
    uint64_t payload_at = 0;  // offset of its payload in the byte stream (payload_head_ terms)
    BlockIndex block = 0;
    int32_t block_tokens = 0;
    uint32_t num_tokens = 0;
    uint16_t pool_len = 0, adapter_len = 0;
    uint8_t medium_len = 0;
    uint8_t kind = 0;
    bool has_parent = false;
    bool truncated = false;  // its payload did not fit the byte ring
  };
  // Appends `n` bytes to the byte ring / copies `n` bytes out of it from stream offset `at`.
  void PutLocked(const void* src, size_t n) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void GetLocked(uint64_t at, void* dst, size_t n) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  CacheEvent DecodeLocked(const EventRecord& r) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const size_t capacity_;       // records_.size()
  const size_t payload_bytes_;  // payload_.size()
  mutable absl::Mutex mu_;
  // Slot of sequence s is records_[(s - 1) % capacity]; it holds the last min(capacity,
  // last_sequence) events.
  std::vector<EventRecord> records_ ABSL_GUARDED_BY(mu_);
  std::vector<uint8_t> payload_ ABSL_GUARDED_BY(mu_);
  uint64_t payload_head_ ABSL_GUARDED_BY(mu_) = 0;  // bytes ever written to the byte ring
  size_t payload_pos_ ABSL_GUARDED_BY(mu_) = 0;     // payload_head_ % payload_bytes_
  uint64_t last_sequence_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvd
