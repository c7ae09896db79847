// TierStore's gauges, counted as entries change (tier_store.h, Tally), and the scan that checks them.
#include <string>

#include "absl/strings/str_cat.h"
#include "server/store/tier_store.h"

namespace kvd {

void TierStore::RecountLocked(Entry& e) {
  // Checkpoints are counted by the engine (TierPort::checkpoints_not_durable): they add only to
  // disk_records.
  const bool on_disk = e.segment != 0, spill = e.spill != nullptr;
  const bool pending = e.header.kind != RecordKind::kCheckpoint;
  uint8_t now = on_disk ? kOnDisk : 0;
  if (e.header.kind == RecordKind::kObject) now |= kObject;
  if (pending && spill) now |= kSpill;
  if (pending && !spill && !on_disk && !e.slots.empty()) now |= kSnapshot;
  CountAsLocked(e, now, (now & kSpill) ? static_cast<int64_t>(e.spill->size()) : 0);
}

void TierStore::UncountLocked(Entry& e) { CountAsLocked(e, 0, 0); }

void TierStore::CountAsLocked(Entry& e, uint8_t now, int64_t spill_bytes) {
  const uint8_t was = e.counted;
  if (now == was && spill_bytes == e.counted_spill_bytes) return;
  auto delta = [&](TallyBit bit) { return ((now & bit) ? 1 : 0) - ((was & bit) ? 1 : 0); };
  tally_.disk_records += delta(kOnDisk);
  tally_.objects += delta(kObject);
  tally_.spill_records += delta(kSpill);
  tally_.snapshot_records += delta(kSnapshot);
  tally_.spill_bytes += spill_bytes - e.counted_spill_bytes;
  if (delta(kOnDisk) != 0 && g1_keys_.contains(e.header.key)) tally_.g1_on_disk += delta(kOnDisk);
  e.counted = now;
  e.counted_spill_bytes = spill_bytes;
}

void TierStore::OnCacheEvent(const CacheEvent& e) {
  if (!e.medium.empty()) return;  // records a warm restart reloaded onto G3: not in G1
  absl::MutexLock lock(&mu_);
  switch (e.kind) {
    case CacheEventKind::kStored:
    case CacheEventKind::kRemoved: {
      const bool stored = e.kind == CacheEventKind::kStored;
      const bool changed = stored ? g1_keys_.insert(e.key).second : g1_keys_.erase(e.key) > 0;
      if (!changed || tally_.disk_records == 0) return;
      auto it = entries_.find(e.key);
      if (it != entries_.end() && (it->second.counted & kOnDisk)) tally_.g1_on_disk += stored ? 1 : -1;
      return;
    }
    case CacheEventKind::kCleared:
      g1_keys_.clear();
      tally_.g1_on_disk = 0;
      return;
  }
}

void TierStore::ReportLostCheckpoints() {
  std::vector<RequestId> lost;
  {
    absl::MutexLock lock(&mu_);
    lost.swap(lost_checkpoints_);
  }
  for (const RequestId& id : lost) cache_->SetCheckpointDurable(id, 0, false);
}

TierStats TierStore::Stats() const {
  const int64_t pending_checkpoints = cache_->checkpoints_not_durable();
  const int64_t g1_cached = cache_listener_ >= 0 ? 0 : cache_->cached_blocks();
  absl::MutexLock lock(&mu_);
  TierStats s = stats_;
  s.pending_checkpoints = pending_checkpoints;
  if (host_ != nullptr) {
    s.host_capacity_bytes = host_->num_slots() * host_->slot_bytes();
    s.host_used_bytes = (host_->num_slots() - host_->free_slots()) * host_->slot_bytes();
  }
  s.host_records = static_cast<int64_t>(g2_lru_.size());
  s.disk_capacity_bytes = options_.disk_dir.empty() ? 0 : options_.disk_bytes;
  s.disk_used_bytes = disk_used_;
  s.disk_segments = static_cast<int64_t>(segments_.size());
  s.disk_records = tally_.disk_records;
  s.objects = tally_.objects;
  s.pending_spill_records = tally_.spill_records;
  s.pending_spill_bytes = tally_.spill_bytes;
  const int64_t g1 = cache_listener_ >= 0 ? static_cast<int64_t>(g1_keys_.size()) : g1_cached;
  s.pending_snapshot_records = tally_.snapshot_records + g1 - tally_.g1_on_disk;
  s.prefetch_handles = static_cast<int64_t>(prefetches_.size());
  s.idle_demotion = idle_demotion();
  if (remote_ != nullptr) {
    s.remote_enabled = true;
    s.remote_url = remote_->display_url();
    s.remote = remote_->Stats();
  }
  return s;
}

absl::Status TierStore::CheckStatsForTesting() const {
  // The engine's side first (nothing else may change the engine meanwhile), then this store's
  // tallies and the scan under one hold of mu_, so a writer thread at work cannot tear them.
  const std::vector<CachedBlockRef> g1 = cache_->SnapshotCached();
  const std::vector<CheckpointSnapshot> ckpts = cache_->SnapshotCheckpoints(/*pin=*/false);
  const int64_t not_durable = cache_->checkpoints_not_durable();
  auto check = [](const char* name, int64_t counted, int64_t scanned) {
    if (counted == scanned) return absl::OkStatus();
    return absl::InternalError(absl::StrCat(name, " is ", counted, ", a scan finds ", scanned));
  };
  absl::MutexLock lock(&mu_);
  int64_t pending_checkpoints = 0;
  for (const CheckpointSnapshot& c : ckpts) {
    if (!c.durable) {
      ++pending_checkpoints;
      continue;
    }
    // The engine's flag must never claim a copy G3 does not hold.
    auto it = entries_.find(CheckpointKey(c.id.value()));
    if (it == entries_.end() || it->second.segment == 0 || it->second.header.tokens != c.tokens ||
        !(it->second.header.ns == c.ns)) {
      return absl::InternalError(
          absl::StrCat("checkpoint '", c.id.value(), "' is marked durable without its copy on G3"));
    }
  }
  Tally want;
  for (const auto& [key, e] : entries_) {
    if (!(e.header.key == key)) {
      return absl::InternalError(absl::StrCat("entry ", key.ToHex(), " has another key"));
    }
    if (e.segment != 0) ++want.disk_records;
    if (e.header.kind == RecordKind::kObject) ++want.objects;
    if (e.header.kind == RecordKind::kCheckpoint) continue;
    if (e.spill != nullptr) {
      ++want.spill_records;
      want.spill_bytes += static_cast<int64_t>(e.spill->size());
    } else if (e.segment == 0 && !e.slots.empty()) {
      ++want.snapshot_records;
    }
  }
  absl::flat_hash_set<BlockKey> g1_keys;
  for (const CachedBlockRef& r : g1) {
    g1_keys.insert(r.key);
    auto it = entries_.find(r.key);
    if (it != entries_.end() && it->second.segment != 0) ++want.g1_on_disk;
  }
  if (cache_listener_ < 0) {  // no disk: no mirror, the engine's count
    if (cache_->cached_blocks() != static_cast<int64_t>(g1.size())) {
      return absl::InternalError("the engine's count of cached blocks differs from its blocks");
    }
  } else if (g1_keys != g1_keys_) {
    return absl::InternalError(absl::StrCat("the store's copy of the G1 keys (", g1_keys_.size(),
                                            ") differs from the engine's (", g1_keys.size(), ")"));
  }
  for (absl::Status s : {check("pending_checkpoints", not_durable, pending_checkpoints),
                         check("disk_records", tally_.disk_records, want.disk_records),
                         check("objects", tally_.objects, want.objects),
                         check("pending_spill_records", tally_.spill_records, want.spill_records),
                         check("pending_spill_bytes", tally_.spill_bytes, want.spill_bytes),
                         check("snapshot records below G1", tally_.snapshot_records, want.snapshot_records),
                         check("G1 blocks on G3", tally_.g1_on_disk, want.g1_on_disk)}) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace kvd
