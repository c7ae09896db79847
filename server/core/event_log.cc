#include "server/core/event_log.h"

namespace kvd {


uint64_t EventLog::Append(const CacheEvent& event) {
  absl::MutexLock lock(&mu_);
  const uint64_t seq = ++last_sequence_;
  const size_t slot = (seq - 1) % capacity_;
  if (slot == ring_.size()) ring_.emplace_back();
  CacheEvent& dst = ring_[slot];
  dst.sequence = seq;
  dst.kind = event.kind;
  dst.time = event.time;
  dst.pool = event.pool;        // assignments reuse the slot's string and vector capacity
  dst.adapter = event.adapter;
  dst.key = event.key;
  dst.parent_key = event.parent_key;
  dst.has_parent = event.has_parent;
  dst.block = event.block;
  dst.block_tokens = event.block_tokens;
  dst.tokens.assign(event.tokens.begin(), event.tokens.end());
  dst.medium = event.medium;
  return seq;
}

EventLog::ReadResult EventLog::ReadAfter(uint64_t last_seen, size_t max_events) const {
  absl::MutexLock lock(&mu_);
  ReadResult out;
  if (last_seen >= last_sequence_) return out;
  const uint64_t oldest = last_sequence_ - ring_.size() + 1;
  if (last_seen + 1 < oldest) {
    out.resync = true;
    return out;
  }
  for (uint64_t s = last_seen + 1; s <= last_sequence_ && out.events.size() < max_events; ++s) {
    out.events.push_back(ring_[(s - 1) % capacity_]);
  }
  return out;
}

uint64_t EventLog::last_sequence() const {
  absl::MutexLock lock(&mu_);
  return last_sequence_;
}

}  // namespace kvd
