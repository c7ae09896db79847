#include "server/core/event_log.h"

#include <algorithm>
#include <cstring>

namespace kvd {

EventLog::EventLog(size_t capacity)
    : capacity_(std::max<size_t>(capacity, 1)),
      payload_bytes_(std::max(capacity_ * kPayloadBytesPerEvent, kMinPayloadBytes)),
      records_(capacity_),
      payload_(payload_bytes_) {
  static_assert(sizeof(EventRecord) == 80, "one event is one fixed-size record");
}

void EventLog::PutLocked(const void* src, size_t n) {
  if (n == 0) return;  // src may be null then
  const size_t first = std::min(n, payload_bytes_ - payload_pos_);
  std::memcpy(payload_.data() + payload_pos_, src, first);
  if (first < n) std::memcpy(payload_.data(), static_cast<const uint8_t*>(src) + first, n - first);
  payload_pos_ = first < n ? n - first : payload_pos_ + n;
  if (payload_pos_ == payload_bytes_) payload_pos_ = 0;
  payload_head_ += n;
}

void EventLog::GetLocked(uint64_t at, void* dst, size_t n) const {
  if (n == 0) return;
  const size_t size = payload_.size();
  const size_t start = static_cast<size_t>(at % size);
  const size_t first = std::min(n, size - start);
  std::memcpy(dst, payload_.data() + start, first);
  std::memcpy(static_cast<uint8_t*>(dst) + first, payload_.data(), n - first);
}

uint64_t EventLog::Append(const CacheEvent& event) {
  absl::MutexLock lock(&mu_);
  const uint64_t seq = ++last_sequence_;
  EventRecord& r = records_[(seq - 1) % records_.size()];
  r.sequence = seq;
  r.unix_ns = absl::ToUnixNanos(event.time);
  r.kind = static_cast<uint8_t>(event.kind);
  r.key = event.key;
  r.parent_key = event.parent_key;
  r.has_parent = event.has_parent;
  r.block = event.block;
  r.block_tokens = event.block_tokens;
  // A payload larger than the byte ring (names past their length fields, or tokens past the rest)
  // cannot be replayed: it is cut to fit and marked, and ReadAfter resyncs a watcher that needs it.
  const size_t quarter = payload_.size() / 4;
  r.pool_len = static_cast<uint16_t>(std::min<size_t>({event.pool.size(), UINT16_MAX, quarter}));
  r.adapter_len = static_cast<uint16_t>(std::min<size_t>({event.adapter.size(), UINT16_MAX, quarter}));
  r.medium_len = static_cast<uint8_t>(std::min<size_t>({event.medium.size(), UINT8_MAX, quarter}));
  const size_t names = size_t{r.pool_len} + r.adapter_len + r.medium_len;
  const size_t room = (payload_.size() - names) / sizeof(Token);
  r.num_tokens = static_cast<uint32_t>(std::min(event.tokens.size(), room));
  r.truncated = r.pool_len != event.pool.size() || r.adapter_len != event.adapter.size() ||
                r.medium_len != event.medium.size() || r.num_tokens != event.tokens.size();
  r.payload_at = payload_head_;
  PutLocked(event.pool.data(), r.pool_len);
  PutLocked(event.adapter.data(), r.adapter_len);
  PutLocked(event.medium.data(), r.medium_len);
  PutLocked(event.tokens.data(), r.num_tokens * sizeof(Token));
  return seq;
}

CacheEvent EventLog::DecodeLocked(const EventRecord& r) const {
  CacheEvent e;
  e.sequence = r.sequence;
  e.kind = static_cast<CacheEventKind>(r.kind);
  e.time = absl::FromUnixNanos(r.unix_ns);
  e.key = r.key;
  e.parent_key = r.parent_key;
  e.has_parent = r.has_parent;
  e.block = r.block;
  e.block_tokens = r.block_tokens;
  uint64_t at = r.payload_at;
  e.pool.resize(r.pool_len);
  GetLocked(at, e.pool.data(), r.pool_len);
  at += r.pool_len;
  e.adapter.resize(r.adapter_len);
  GetLocked(at, e.adapter.data(), r.adapter_len);
  at += r.adapter_len;
  e.medium.resize(r.medium_len);
  GetLocked(at, e.medium.data(), r.medium_len);
  at += r.medium_len;
  e.tokens.resize(r.num_tokens);
  GetLocked(at, e.tokens.data(), r.num_tokens * sizeof(Token));
  return e;
}

EventLog::ReadResult EventLog::ReadAfter(uint64_t last_seen, size_t max_events) const {
  absl::MutexLock lock(&mu_);
  ReadResult out;
  if (last_seen >= last_sequence_) return out;
  const uint64_t held = std::min<uint64_t>(last_sequence_, records_.size());
  const uint64_t oldest = last_sequence_ - held + 1;
  // Payloads are written in sequence order: the first one asked for is the oldest needed.
  const EventRecord& first = records_[last_seen % records_.size()];
  if (last_seen + 1 < oldest || payload_head_ - first.payload_at > payload_.size()) {
    out.resync = true;
    return out;
  }
  for (uint64_t s = last_seen + 1; s <= last_sequence_ && out.events.size() < max_events; ++s) {
    const EventRecord& r = records_[(s - 1) % records_.size()];
    if (r.truncated) {  // cannot be replayed whole
      out.events.clear();
      out.resync = true;
      return out;
    }
    out.events.push_back(DecodeLocked(r));
  }
  return out;
}

uint64_t EventLog::last_sequence() const {
  absl::MutexLock lock(&mu_);
  return last_sequence_;
}

}  // namespace kvd
