// EventLog numbers every change of the prefix index (block stored, block removed, all cleared)
// with a monotonically increasing sequence number and keeps the most recent ones in a bounded
// ring, so a watcher that reconnects with the last sequence it saw gets what it missed, or learns
// that it fell too far behind and must resync from scratch.
//
// Memory is fixed at construction and nothing is allocated per event. The log keeps one
// fixed-size RunRecord per *run* of consecutive events (sequence range, kind, time, the first
// block's parent key, names) in a ring of `capacity` records; a run is what one engine call did
// to one chain: the blocks a publish stored, each the previous one's child, or the blocks an
// eviction pass removed — same kind, pool, adapter, medium, block size and time. Its variable part
// goes into a byte ring of `capacity * kPayloadBytesPerEvent` bytes (at least kMinPayloadBytes)
// written in sequence order: the run's names once, then one fixed-size entry per block (key,
// block index, tokens), so the entry of any sequence in a run is found by arithmetic. A payload
// that the byte ring has since overwritten (long blocks) ends the replayable history there:
// ReadAfter asks a watcher to resync rather than hand it an event without its tokens. So replay
// covers the last `capacity` events (never more, however long the runs), or the last
// ~kPayloadBytesPerEvent * capacity bytes of entries, whichever is shorter; a run is cut at half
// the byte ring, so the last capacity / 2 short events always replay. The namespace's media keys,
// method and salt are not kept (they are never sent to watchers).
//
// Tokens are copied into the byte ring rather than read from the engine's token slab when a
// watcher catches up: a removed block's slab line is reused at once, and a lagging watcher would
// read another block's tokens.
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
  // Room per event in the byte ring: one 16-token block's entry (key, index, tokens: 84 bytes)
  // and short pool/adapter names, even when every run is one block long.
  static constexpr size_t kPayloadBytesPerEvent = 104;
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
  // Records ever started (each holds one run of events).
  uint64_t num_runs() const ABSL_LOCKS_EXCLUDED(mu_);
  // The ring's memory: records and payload bytes (fixed at construction).
  size_t memory_bytes() const { return capacity_ * sizeof(RunRecord) + payload_bytes_; }

 private:
  // One run: events first_sequence .. first_sequence + count - 1.
  struct RunRecord {
    uint64_t first_sequence = 0;
    int64_t unix_ns = 0;
    BlockKey parent_key;      // the first event's; a later stored event's parent is its predecessor
    uint64_t payload_at = 0;  // offset of its names in the byte stream (payload_head_ terms)
    uint32_t count = 0;
    int32_t block_tokens = 0;
    uint32_t entry_tokens = 0;  // tokens in each of its entries
    uint16_t pool_len = 0, adapter_len = 0;
    uint8_t medium_len = 0;
    uint8_t kind = 0;
    bool has_parent = false;  // the first event's
    bool truncated = false;   // its payload did not fit the byte ring: a run of one, never replayed

    size_t names_bytes() const { return size_t{pool_len} + adapter_len + medium_len; }
    size_t entry_bytes() const { return kEntryHeaderBytes + size_t{entry_tokens} * sizeof(Token); }
  };
  // An entry: the block's key, its index, then its tokens.
  static constexpr size_t kEntryHeaderBytes = sizeof(BlockKey) + sizeof(BlockIndex);

  // Whether `event` continues the open run (the newest record).
  bool ContinuesRunLocked(const CacheEvent& event, int64_t unix_ns) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void StartRunLocked(const CacheEvent& event, int64_t unix_ns, uint64_t seq) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void PutEntryLocked(const CacheEvent& event, uint32_t num_tokens) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The run holding sequence `seq`, or nullptr when it has left the ring.
  const RunRecord* FindRunLocked(uint64_t seq) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Event `i` of run `r`; `prev_key` is the key of event i - 1 (unused for i == 0).
  CacheEvent DecodeLocked(const RunRecord& r, uint32_t i, const BlockKey& prev_key) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Appends `n` bytes to the byte ring / copies `n` bytes out of it from stream offset `at`.
  void PutLocked(const void* src, size_t n) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void GetLocked(uint64_t at, void* dst, size_t n) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const size_t capacity_;       // records_.size()
  const size_t payload_bytes_;  // payload_.size()
  mutable absl::Mutex mu_;
  // Run n (counting from 0) is records_[n % capacity]; the ring holds the last
  // min(capacity, num_runs_) runs, in sequence order.
  std::vector<RunRecord> records_ ABSL_GUARDED_BY(mu_);
  std::vector<uint8_t> payload_ ABSL_GUARDED_BY(mu_);
  uint64_t payload_head_ ABSL_GUARDED_BY(mu_) = 0;  // bytes ever written to the byte ring
  size_t payload_pos_ ABSL_GUARDED_BY(mu_) = 0;     // payload_head_ % payload_bytes_
  uint64_t num_runs_ ABSL_GUARDED_BY(mu_) = 0;
  size_t open_slot_ ABSL_GUARDED_BY(mu_) = 0;  // the newest run's slot, (num_runs_ - 1) % capacity_
  // The open run's names and last key, to test whether the next event continues it.
  std::string open_pool_ ABSL_GUARDED_BY(mu_), open_adapter_ ABSL_GUARDED_BY(mu_), open_medium_ ABSL_GUARDED_BY(mu_);
  BlockKey open_last_key_ ABSL_GUARDED_BY(mu_);
  uint64_t last_sequence_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvd
