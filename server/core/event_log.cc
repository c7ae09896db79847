#include "server/core/event_log.h"

#include <algorithm>
#include <cstring>

namespace kvd {

EventLog::EventLog(size_t capacity)
    : capacity_(std::max<size_t>(capacity, 1)),
      payload_bytes_(std::max(capacity_ * kPayloadBytesPerEvent, kMinPayloadBytes)),
      records_(capacity_),
      payload_(payload_bytes_) {
  static_assert(sizeof(RunRecord) == 64, "one run of events is one fixed-size record");
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

bool EventLog::ContinuesRunLocked(const CacheEvent& event, int64_t unix_ns) const {
  if (num_runs_ == 0 || event.kind == CacheEventKind::kCleared) return false;
  const RunRecord& r = records_[open_slot_];
  if (r.truncated || r.kind != static_cast<uint8_t>(event.kind) || r.unix_ns != unix_ns ||
      r.block_tokens != event.block_tokens || r.entry_tokens != event.tokens.size()) {
    return false;
  }
  // A stored event continues the chain (its parent is the run's last block); any other kind
  // carries no parent, so the decoded events are exactly the appended ones.
  if (event.kind == CacheEventKind::kStored ? !(event.has_parent && event.parent_key == open_last_key_)
                                            : (event.has_parent || !(event.parent_key == BlockKey{}))) {
    return false;
  }
  if (event.pool != open_pool_ || event.adapter != open_adapter_ || event.medium != open_medium_) return false;
  // A run stays within half the byte ring, so that a watcher can catch up on a whole one.
  return r.names_bytes() + (size_t{r.count} + 1) * r.entry_bytes() <= payload_.size() / 2;
}

void EventLog::PutEntryLocked(const CacheEvent& event, uint32_t num_tokens) {
  open_last_key_ = event.key;
  const size_t token_bytes = num_tokens * sizeof(Token);
  const size_t n = kEntryHeaderBytes + token_bytes;
  if (payload_pos_ + n < payload_bytes_) {  // the common case: no wrap, one contiguous write
    uint8_t* at = payload_.data() + payload_pos_;
    std::memcpy(at, &event.key, sizeof(BlockKey));
    std::memcpy(at + sizeof(BlockKey), &event.block, sizeof(BlockIndex));
    if (token_bytes > 0) std::memcpy(at + kEntryHeaderBytes, event.tokens.data(), token_bytes);
    payload_pos_ += n;
    payload_head_ += n;
    return;
  }
  PutLocked(&event.key, sizeof(BlockKey));
  PutLocked(&event.block, sizeof(BlockIndex));
  PutLocked(event.tokens.data(), token_bytes);
}

void EventLog::StartRunLocked(const CacheEvent& event, int64_t unix_ns, uint64_t seq) {
  open_slot_ = num_runs_++ == 0 || open_slot_ + 1 == records_.size() ? 0 : open_slot_ + 1;
  RunRecord& r = records_[open_slot_];
  r.first_sequence = seq;
  r.count = 1;
  r.unix_ns = unix_ns;
  r.kind = static_cast<uint8_t>(event.kind);
  r.parent_key = event.parent_key;
  r.has_parent = event.has_parent;
  r.block_tokens = event.block_tokens;
  // A payload larger than the byte ring (names past their length fields, or tokens past the rest)
  // cannot be replayed: it is cut to fit and marked, and ReadAfter resyncs a watcher that needs it.
  const size_t quarter = payload_.size() / 4;
  r.pool_len = static_cast<uint16_t>(std::min<size_t>({event.pool.size(), UINT16_MAX, quarter}));
  r.adapter_len = static_cast<uint16_t>(std::min<size_t>({event.adapter.size(), UINT16_MAX, quarter}));
  r.medium_len = static_cast<uint8_t>(std::min<size_t>({event.medium.size(), UINT8_MAX, quarter}));
  const size_t room = (payload_.size() - r.names_bytes() - kEntryHeaderBytes) / sizeof(Token);
  r.entry_tokens = static_cast<uint32_t>(std::min(event.tokens.size(), room));
  r.truncated = r.pool_len != event.pool.size() || r.adapter_len != event.adapter.size() ||
                r.medium_len != event.medium.size() || r.entry_tokens != event.tokens.size();
  r.payload_at = payload_head_;
  open_pool_.assign(event.pool, 0, r.pool_len);
  open_adapter_.assign(event.adapter, 0, r.adapter_len);
  open_medium_.assign(event.medium, 0, r.medium_len);
  PutLocked(open_pool_.data(), r.pool_len);
  PutLocked(open_adapter_.data(), r.adapter_len);
  PutLocked(open_medium_.data(), r.medium_len);
  PutEntryLocked(event, r.entry_tokens);
}

uint64_t EventLog::Append(const CacheEvent& event) {
  const int64_t unix_ns = absl::ToUnixNanos(event.time);
  absl::MutexLock lock(&mu_);
  const uint64_t seq = ++last_sequence_;
  if (ContinuesRunLocked(event, unix_ns)) {
    ++records_[open_slot_].count;
    PutEntryLocked(event, static_cast<uint32_t>(event.tokens.size()));
  } else {
    StartRunLocked(event, unix_ns, seq);
  }
  return seq;
}

const EventLog::RunRecord* EventLog::FindRunLocked(uint64_t seq) const {
  const uint64_t held = std::min<uint64_t>(num_runs_, records_.size());
  // The last run whose first sequence is <= seq, by binary search over the held runs.
  uint64_t lo = num_runs_ - held, hi = num_runs_;
  if (held == 0 || records_[lo % records_.size()].first_sequence > seq) return nullptr;
  while (hi - lo > 1) {
    const uint64_t mid = lo + (hi - lo) / 2;
    if (records_[mid % records_.size()].first_sequence <= seq) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return &records_[lo % records_.size()];
}

CacheEvent EventLog::DecodeLocked(const RunRecord& r, uint32_t i, const BlockKey& prev_key) const {
  CacheEvent e;
  e.sequence = r.first_sequence + i;
  e.kind = static_cast<CacheEventKind>(r.kind);
  e.time = absl::FromUnixNanos(r.unix_ns);
  e.parent_key = i == 0 ? r.parent_key : (e.kind == CacheEventKind::kStored ? prev_key : BlockKey{});
  e.has_parent = i == 0 ? r.has_parent : e.kind == CacheEventKind::kStored;
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
  at += r.medium_len + uint64_t{i} * r.entry_bytes();
  GetLocked(at, &e.key, sizeof(BlockKey));
  GetLocked(at + sizeof(BlockKey), &e.block, sizeof(BlockIndex));
  e.tokens.resize(r.entry_tokens);
  GetLocked(at + kEntryHeaderBytes, e.tokens.data(), r.entry_tokens * sizeof(Token));
  return e;
}

EventLog::ReadResult EventLog::ReadAfter(uint64_t last_seen, size_t max_events) const {
  absl::MutexLock lock(&mu_);
  ReadResult out;
  if (last_seen >= last_sequence_) return out;
  // Payloads are written in sequence order: the first run asked for is the oldest needed.
  // Replay covers the last `capacity` events at most, as configured, however long the runs.
  const RunRecord* run = last_sequence_ - last_seen > capacity_ ? nullptr : FindRunLocked(last_seen + 1);
  if (run == nullptr || payload_head_ - run->payload_at > payload_.size()) {
    out.resync = true;
    return out;
  }
  size_t slot = static_cast<size_t>(run - records_.data());  // the next run is in the next slot
  uint32_t i = static_cast<uint32_t>(last_seen + 1 - run->first_sequence);
  BlockKey prev_key;  // the previous event's key: a stored event's parent within a run
  if (i > 0) {
    GetLocked(run->payload_at + run->names_bytes() + uint64_t{i - 1} * run->entry_bytes(), &prev_key,
              sizeof(BlockKey));
  }
  while (out.events.size() < max_events) {
    const RunRecord& r = records_[slot];
    if (r.truncated) {  // cannot be replayed whole
      out.events.clear();
      out.resync = true;
      return out;
    }
    for (; i < r.count && out.events.size() < max_events; ++i) {
      out.events.push_back(DecodeLocked(r, i, prev_key));
      prev_key = out.events.back().key;
    }
    if (i < r.count || r.first_sequence + r.count > last_sequence_) break;  // batch full, or the newest run
    slot = (slot + 1) % records_.size();
    i = 0;
  }
  return out;
}

uint64_t EventLog::last_sequence() const {
  absl::MutexLock lock(&mu_);
  return last_sequence_;
}

uint64_t EventLog::num_runs() const {
  absl::MutexLock lock(&mu_);
  return num_runs_;
}

}  // namespace kvd
