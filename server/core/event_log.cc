#include "server/core/event_log.h"

namespace kvd {

std::string CacheEventKindName(CacheEventKind kind) {
  switch (kind) {
    case CacheEventKind::kStored: return "stored";
    case CacheEventKind::kRemoved: return "removed";
    case CacheEventKind::kCleared: return "cleared";
  }
  return "unknown";
}

uint64_t EventLog::Append(CacheEvent event) {
  absl::MutexLock lock(&mu_);
  event.sequence = ++last_sequence_;
  ring_.push_back(std::move(event));
  if (ring_.size() > capacity_) ring_.pop_front();
  return last_sequence_;
}

EventLog::ReadResult EventLog::ReadAfter(uint64_t last_seen, size_t max_events) const {
  absl::MutexLock lock(&mu_);
  ReadResult out;
  if (last_seen >= last_sequence_) return out;
  const uint64_t oldest = ring_.empty() ? last_sequence_ + 1 : ring_.front().sequence;
  if (last_seen + 1 < oldest) {
    out.resync = true;
    return out;
  }
  for (size_t i = last_seen + 1 - oldest; i < ring_.size() && out.events.size() < max_events; ++i) {
    out.events.push_back(ring_[i]);
  }
  return out;
}

uint64_t EventLog::last_sequence() const {
  absl::MutexLock lock(&mu_);
  return last_sequence_;
}

}  // namespace kvd
