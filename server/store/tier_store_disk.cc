// TierStore: the disk tier (G3) — warm-restart load, spill writes, flush, segment eviction, the
// manifest, saved prefixes and statistics.
#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <limits>
#include <optional>
#include <thread>

#include "absl/container/flat_hash_map.h"
#include "absl/container/btree_set.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "proto/vocab/status_macros.h"
#include "server/store/tier_store.h"
#include "spdlog/spdlog.h"

namespace kvd {
namespace {

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Orders reloaded "stored" events so that each block comes after its parent (segments hold
// records in write order, not chain order), as a consumer chaining hashes needs. events[0] is the
// "all cleared" event and stays first.
void OrderParentsFirst(std::vector<CacheEvent>* events) {
  absl::flat_hash_map<BlockKey, size_t> at;
  for (size_t i = 1; i < events->size(); ++i) at[(*events)[i].key] = i;
  std::vector<int32_t> depth(events->size(), -1);  // -1 unknown, -2 on the current walk
  for (size_t i = 1; i < events->size(); ++i) {
    std::vector<size_t> path;
    int32_t above = -1;  // depth of the block above the walk's top
    for (size_t j = i;;) {
      if (depth[j] >= 0) {
        above = depth[j];
        break;
      }
      if (depth[j] == -2) break;  // a cycle: impossible with distinct keys, but never loop
      depth[j] = -2;
      path.push_back(j);
      const CacheEvent& e = (*events)[j];
      auto it = e.has_parent ? at.find(e.parent_key) : at.end();
      if (it == at.end()) break;
      j = it->second;
    }
    for (auto p = path.rbegin(); p != path.rend(); ++p) depth[*p] = ++above;
  }
  std::vector<size_t> order(events->size() - 1);
  for (size_t i = 0; i < order.size(); ++i) order[i] = i + 1;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return depth[a] < depth[b]; });
  std::vector<CacheEvent> sorted;
  sorted.reserve(events->size());
  sorted.push_back(std::move((*events)[0]));
  for (size_t i : order) sorted.push_back(std::move((*events)[i]));
  *events = std::move(sorted);
}

absl::Status MakeDirs(const std::string& dir) {
  std::string path;
  for (size_t pos = 0; pos != std::string::npos;) {
    pos = dir.find('/', pos + 1);
    path = dir.substr(0, pos);
    if (path.empty()) continue;
    if (mkdir(path.c_str(), 0750) != 0 && errno != EEXIST) {
      return absl::InternalError(absl::StrCat("mkdir ", path, ": ", std::strerror(errno)));
    }
  }
  return absl::OkStatus();
}

// A hybrid pool's checkpoint record (kCheckpoint of a pool with groups; docs/hybrid.md §2.9):
// after the engine state, [u8 groups][u32 units, per group], then every unit's bytes, each its
// group's unit across all shards, in CheckpointSnapshot::AllBlocks() order: the spine group's table,
// then each other group in index order (a window's blocks before the position, a state group's
// slot). The counts are under the record's one checksum; a restart checks them against what its
// own pool's checkpoint at those tokens holds (TierPort::RestoreCheckpoint) before allocating.
// The bytes of each unit in that order, for `units` per group.
std::vector<int64_t> UnitBytesInOrder(const PoolGeometry& g, int spine, absl::Span<const int64_t> units) {
  std::vector<int64_t> out;
  const auto add = [&](int group) {
    for (int64_t i = 0; i < units[group]; ++i) out.push_back(g.GroupUnitBytes(group) * g.num_shards);
  };
  add(spine);
  for (int group = 0; group < static_cast<int>(g.groups.size()); ++group) {
    if (group != spine) add(group);
  }
  return out;
}

}  // namespace

absl::Status TierStore::Load(bool restore_checkpoints) {
  if (options_.disk_dir.empty()) return absl::OkStatus();
  const auto start = std::chrono::steady_clock::now();
  const std::string& dir = options_.disk_dir;
  KVD_RETURN_IF_ERROR(MakeDirs(dir));
  // What the directory holds. Only the manifest decides what is deleted: a file is never removed
  // because metadata about it is missing.
  absl::btree_set<uint64_t> on_disk;
  std::vector<std::string> tmp_files;
  {
    DIR* d = opendir(dir.c_str());
    if (d == nullptr) return absl::InternalError(absl::StrCat("opendir ", dir, ": ", std::strerror(errno)));
    while (dirent* ent = readdir(d)) {
      const std::string name = ent->d_name;
      if (std::optional<uint64_t> num = ParseSegmentName(name)) {
        on_disk.insert(*num);
      } else if (absl::EndsWith(name, ".tmp")) {
        tmp_files.push_back(name);
      }
    }
    closedir(d);
  }
  // A .tmp file is a write a crash interrupted before its rename: never part of the tier.
  for (const std::string& name : tmp_files) {
    spdlog::warn("tiers: deleting {}/{}: an unfinished write left by a crash", dir, name);
    fs_->Unlink(absl::StrCat(dir, "/", name).c_str());
  }
  Manifest manifest;
  bool rebuilt = false;
  if (absl::StatusOr<Manifest> m = ReadManifest(dir, fs_); m.ok()) {
    manifest = *std::move(m);
  } else if (absl::IsNotFound(m.status()) || absl::IsDataLoss(m.status())) {
    // Lost or damaged: the segments carry their own checksums, so rebuild the list from them.
    // Deletions recorded only in the manifest may be lost, so rebuilt segments contribute their
    // prefix blocks alone (content-addressed and checksummed: reviving one is harmless).
    rebuilt = !on_disk.empty();
    if (absl::IsDataLoss(m.status())) {
      const std::string kept = absl::StrCat(dir, "/", kManifestName, ".damaged");
      fs_->Rename(absl::StrCat(dir, "/", kManifestName).c_str(), kept.c_str());
      spdlog::error("tiers: {}; kept as {}", m.status().ToString(), kept);
    } else if (rebuilt) {
      spdlog::error("tiers: {}/{} is missing", dir, kManifestName);
    }
    if (rebuilt) {
      spdlog::warn("tiers: rebuilding the manifest from {} segment files; their objects and "
                   "checkpoints are not restored (a deletion of them may be lost)", on_disk.size());
    }
    manifest = Manifest{};
    manifest.next_segment = on_disk.empty() ? 1 : *on_disk.rbegin() + 1;
  } else {
    // Unreadable (permissions, I/O error): no proof of damage, so refuse to guess.
    return absl::FailedPreconditionError(absl::StrCat(
        "the disk tier's manifest cannot be read: ", m.status().ToString(),
        "; fix the file's permissions or the device, or move the file away to rebuild it from the segments"));
  }
  const absl::flat_hash_set<uint64_t> listed(manifest.segments.begin(), manifest.segments.end());
  // Segments to read: the listed ones, and (blocks only) those the manifest does not vouch for:
  // every file when it was rebuilt, else files numbered past its next_segment, written by a crash
  // before the manifest that would have listed them. Unlisted files below next_segment were
  // evicted or replaced by a committed manifest: deleting them is the manifest's own decision.
  struct ToLoad {
    uint64_t num;
    bool blocks_only;
  };
  std::vector<ToLoad> to_load;
  for (uint64_t num : manifest.segments) to_load.push_back({num, false});
  for (uint64_t num : on_disk) {
    if (listed.contains(num)) continue;
    if (rebuilt || num >= manifest.next_segment) {
      if (!rebuilt) spdlog::warn("tiers: adopting {}: written but not yet in the manifest", SegmentName(num));
      to_load.push_back({num, true});
      manifest.next_segment = std::max(manifest.next_segment, num + 1);
    } else {
      spdlog::info("tiers: deleting {}: the manifest no longer lists it (evicted or replaced)", SegmentName(num));
      fs_->Unlink(absl::StrCat(dir, "/", SegmentName(num)).c_str());
    }
  }
  absl::flat_hash_set<std::pair<uint64_t, uint64_t>> dead;
  std::vector<Tombstone> tombstones;
  for (const Tombstone& t : manifest.deleted) {
    if (listed.contains(t.segment)) {
      dead.insert({t.key.hi ^ t.segment, t.key.lo});
      tombstones.push_back(t);
    }
  }
  std::vector<CacheEvent> events;
  CacheEvent cleared;
  cleared.kind = CacheEventKind::kCleared;
  events.push_back(cleared);
  bool rewrite = rebuilt || tombstones.size() != manifest.deleted.size() ||
                 to_load.size() != manifest.segments.size();
  int64_t reloaded = 0;
  // Read every header section first (no lock held), so the index is sized once: re-hashing
  // entries while it grows dominated the load of a million blocks.
  struct Loaded {
    ToLoad what;
    int64_t size;
    absl::StatusOr<std::vector<RecordHeader>> headers;
  };
  std::vector<Loaded> loaded;
  size_t total = 0;
  for (const ToLoad& t : to_load) {
    const std::string path = absl::StrCat(dir, "/", SegmentName(t.num));
    int64_t size = 0, truncated = 0;
    auto headers = ReadSegmentHeaders(path, &size, &truncated, fs_);
    if (headers.ok()) {
      total += headers->size();
      if (truncated > 0) {
        spdlog::error("tiers: {} is truncated: {} records past its end are lost, {} intact ones are served",
                      path, truncated, headers->size());
      }
    } else if (absl::IsDataLoss(headers.status())) {
      const absl::Status q = Quarantine(SegmentName(t.num));
      spdlog::error("tiers: {}; {}", headers.status().ToString(),
                    q.ok() ? absl::StrCat("moved to ", dir, "/quarantine/") : q.ToString());
    } else {
      spdlog::error("tiers: {}; kept on disk and in the manifest, not served until a restart can read it",
                    headers.status().ToString());
      struct stat st;
      if (stat(path.c_str(), &st) == 0) size = st.st_size;
    }
    loaded.push_back(Loaded{t, size, std::move(headers)});
  }
  events.reserve(total + 1);
  {
    absl::MutexLock lock(&mu_);
    manifest_.next_segment = std::max<uint64_t>(manifest.next_segment, 1);
    manifest_.generation = manifest.generation;
    manifest_.deleted = std::move(tombstones);
    entries_.reserve(entries_.size() + total);
    absl::flat_hash_map<std::string, int64_t> not_served;  // records refused, by why
    for (Loaded& l : loaded) {
      const uint64_t num = l.what.num;
      absl::StatusOr<std::vector<RecordHeader>>& headers = l.headers;
      if (!headers.ok()) {
        if (absl::IsDataLoss(headers.status())) {
          ++stats_.quarantined_segments;
        } else {
          ++stats_.read_errors;
          Segment& seg = segments_[num];  // listed and counted, never read or evicted this run
          seg.file_bytes = l.size;
          seg.unreadable = true;
          disk_used_ += l.size;
        }
        continue;
      }
      manifest_.next_segment = std::max(manifest_.next_segment, num + 1);
      Segment& seg = segments_[num];
      seg.file_bytes = l.size;
      disk_used_ += l.size;
      for (RecordHeader& h : *headers) {
        if (dead.contains({h.key.hi ^ num, h.key.lo}) || entries_.contains(h.key)) continue;
        if (l.what.blocks_only && !IsChainRecord(h.kind)) continue;
        if (absl::Status bad = CheckLoadedLocked(h); !bad.ok()) {
          // One line per reason: after a model upgrade every record of a pool is refused alike.
          if (++not_served[std::string(bad.message())] == 1) {
            spdlog::warn("tiers: {} record {} not served: {}", SegmentName(num), h.key.ToHex(), std::string(bad.message()));
          }
          ++stats_.incompatible;
          continue;
        }
        if (IsChainRecord(h.kind)) {
          const PoolGeometry& g = pools_[*PoolOf(h.ns.pool)];
          CacheEvent e;
          e.kind = CacheEventKind::kStored;
          e.pool = h.ns.pool;
          e.adapter = h.ns.adapter;
          e.key = h.key;
          e.has_parent = h.has_parent;
          e.parent_key = h.parent_key;
          e.block_tokens = g.block_tokens;
          e.tokens = h.tokens;
          e.media_keys = h.ns.media_keys;
          e.method = h.ns.method;
          e.cache_salt = h.ns.cache_salt;
          e.medium = "disk";
          events.push_back(std::move(e));
        }
        Entry& entry = entries_[h.key];
        entry.header = std::move(h);
        entry.segment = num;
        RecountLocked(entry);
        ++seg.records;
        ++reloaded;
      }
    }
    stats_.reloaded_records = reloaded;
    for (const auto& [why, count] : not_served) {
      if (count > 1) spdlog::warn("tiers: {} records in all not served: {}", count, why);
    }
    std::vector<uint64_t> evicted = EvictSegmentsLocked(0);
    if (!evicted.empty()) rewrite = true;
  }
  if (rewrite) KVD_RETURN_IF_ERROR(WriteManifestNow({}));
  OrderParentsFirst(&events);
  cache_->EmitExternal(events);
  if (restore_checkpoints) RestoreCheckpoints();
  absl::MutexLock lock(&mu_);
  stats_.load_seconds = SecondsSince(start);
  spdlog::info("tiers: reloaded {} records from {} segments in {:.3f}s", reloaded, segments_.size(),
               stats_.load_seconds);
  return absl::OkStatus();
}

absl::Status TierStore::Quarantine(const std::string& name) const {
  const std::string qdir = absl::StrCat(options_.disk_dir, "/quarantine");
  if (mkdir(qdir.c_str(), 0750) != 0 && errno != EEXIST) {
    return absl::InternalError(absl::StrCat("mkdir ", qdir, ": ", std::strerror(errno), "; left in place"));
  }
  if (fs_->Rename(absl::StrCat(options_.disk_dir, "/", name).c_str(), absl::StrCat(qdir, "/", name).c_str()) != 0) {
    return absl::InternalError(absl::StrCat("rename to ", qdir, ": ", std::strerror(errno), "; left in place"));
  }
  return absl::OkStatus();
}

absl::Status TierStore::CheckLoadedLocked(const RecordHeader& h) const {
  // Lengths are checked before anything is allocated from them.
  if (h.codec == Codec::kNone && h.raw_length != h.stored_length) {
    return absl::DataLossError("raw and stored lengths differ without a codec");
  }
  switch (h.kind) {
    case RecordKind::kBlock: {
      absl::StatusOr<PoolId> pool = PoolOf(h.ns.pool);
      if (!pool.ok()) return absl::FailedPreconditionError(absl::StrCat("no pool '", h.ns.pool, "'"));
      if (h.layout_tag != layout_tags_[*pool]) {
        return absl::FailedPreconditionError(DescribeTagMismatch(pools_[*pool], h.layout_tag));
      }
      if (h.raw_length != pools_[*pool].block_bytes_all_shards()) {
        return absl::FailedPreconditionError("its pool's layout changed");
      }
      return absl::OkStatus();
    }
    case RecordKind::kUnit: {
      // A hybrid unit is whole or not served: its parts must be ones the pool's units have, and
      // its length exactly theirs (a unit cut short fails its checksum when read).
      absl::StatusOr<PoolId> pool = PoolOf(h.ns.pool);
      if (!pool.ok()) return absl::FailedPreconditionError(absl::StrCat("no pool '", h.ns.pool, "'"));
      if (h.layout_tag != layout_tags_[*pool]) {
        return absl::FailedPreconditionError(DescribeTagMismatch(pools_[*pool], h.layout_tag));
      }
      const int64_t want = UnitRawLength(*pool, h.parts);
      if (want < 0 || h.raw_length != want) {
        return absl::DataLossError("a hybrid unit whose parts or length its pool's groups do not allow");
      }
      return absl::OkStatus();
    }
    case RecordKind::kCheckpoint: {
      absl::StatusOr<PoolId> pool = PoolOf(h.ns.pool);
      if (!pool.ok()) return absl::FailedPreconditionError(absl::StrCat("no pool '", h.ns.pool, "'"));
      const PoolGeometry& g = pools_[*pool];
      const int64_t blocks = g.BlocksFor(static_cast<int64_t>(h.tokens.size()));
      int64_t most = static_cast<int64_t>(sizeof(uint32_t)) + cache_->max_engine_state_bytes();
      if (g.hybrid()) {
        // Another grouping's record is never restored (LayoutTag covers the groups): counted
        // incompatible, and left on disk for a restart under its own grouping.
        if (h.layout_tag != layout_tags_[*pool]) {
          return absl::FailedPreconditionError(DescribeTagMismatch(g, h.layout_tag));
        }
        most += 1;
        for (int group = 0; group < static_cast<int>(g.groups.size()); ++group) {
          const int64_t units = g.groups[group].kind == KvGroupKind::kState ? 1 : blocks;
          most += static_cast<int64_t>(sizeof(uint32_t)) + units * g.GroupUnitBytes(group) * g.num_shards;
        }
      } else {
        most += blocks * g.block_bytes_all_shards();
      }
      if (h.raw_length > most) return absl::DataLossError("checkpoint length exceeds what its tokens need");
      return absl::OkStatus();
    }
    case RecordKind::kObject:
      // No object is larger than the largest gRPC message that could have carried it.
      if (h.raw_length > std::numeric_limits<int32_t>::max()) return absl::DataLossError("object length out of range");
      return absl::OkStatus();
  }
  return absl::DataLossError("unknown record kind");
}

void TierStore::FlushCheckpoints(FlushResult* result) {
  std::vector<CheckpointSnapshot> snaps = cache_->SnapshotCheckpoints(/*pin=*/true);
  std::vector<RecordHeader> headers;
  std::vector<std::shared_ptr<const std::string>> raws;
  std::vector<std::pair<RequestId, uint64_t>> writing;  // (id, version) of each of `headers`
  absl::flat_hash_set<BlockKey> live;
  for (const CheckpointSnapshot& c : snaps) {
    const BlockKey key = CheckpointKey(c.id.value());
    live.insert(key);
    const std::vector<BlockIndex> all = c.AllBlocks();  // pinned
    // A hybrid pool without a full group has no spine table to lay its record out from: its
    // checkpoints are not written and stay counted in checkpoints_not_durable.
    if (pools_[c.pool].hybrid() && spine_groups_[c.pool] < 0) {
      cache_->UnpinBlocks(c.pool, all);
      continue;
    }
    // The engine knows whether this version was written (a rewrite with the same tokens may carry
    // new engine state); the copy must still be here.
    bool durable = false;
    if (c.durable) {
      absl::MutexLock lock(&mu_);
      auto it = entries_.find(key);
      durable = it != entries_.end() && it->second.segment != 0 &&
                it->second.header.tokens == c.tokens && it->second.header.ns == c.ns;
    }
    if (durable) {
      ++result->already_durable;
    } else if (result->error.empty()) {
      const PoolGeometry& g = pools_[c.pool];
      auto raw = std::make_shared<std::string>();
      const uint32_t es = static_cast<uint32_t>(c.engine_state.size());
      raw->append(reinterpret_cast<const char*>(&es), sizeof(es));
      raw->append(c.engine_state);
      std::vector<int64_t> sizes(c.blocks.size(), g.block_bytes_all_shards());
      absl::Status s;
      if (g.hybrid()) {
        const int spine = spine_groups_[c.pool];
        std::vector<int64_t> units(g.groups.size(), 0);
        if (c.groups.size() != g.groups.size()) {
          s = absl::InternalError(absl::StrCat("checkpoint '", c.id.value(), "' does not hold its pool's groups"));
        } else {
          units[spine] = static_cast<int64_t>(c.blocks.size());
          for (size_t group = 0; group < c.groups.size(); ++group) {
            if (static_cast<int>(group) == spine) continue;
            units[group] = static_cast<int64_t>(c.groups[group].blocks.size()) +
                           (c.groups[group].slot != CheckpointSnapshot::kNoSlot ? 1 : 0);
          }
        }
        raw->push_back(static_cast<char>(units.size()));
        for (int64_t u : units) {
          const uint32_t n = static_cast<uint32_t>(u);
          raw->append(reinterpret_cast<const char*>(&n), sizeof(n));
        }
        sizes = UnitBytesInOrder(g, spine, units);
      }
      if (s.ok() && sizes.size() != all.size()) s = absl::InternalError("checkpoint units and layout disagree");
      size_t offset = raw->size();
      size_t end = offset;
      for (int64_t size : sizes) end += static_cast<size_t>(size);
      raw->resize(end);
      for (size_t i = 0; i < all.size() && s.ok(); ++i) {
        s = arena_->ReadBlock(c.pool, all[i], reinterpret_cast<uint8_t*>(raw->data() + offset));
        offset += static_cast<size_t>(sizes[i]);
      }
      if (!s.ok()) {
        ++result->failed_blocks;
        result->error = std::string(s.message());
      } else {
        RecordHeader h;
        h.kind = RecordKind::kCheckpoint;
        h.ns = c.ns;
        h.key = key;
        h.tokens = c.tokens;
        h.object_key = c.id.value();
        h.raw_length = static_cast<int64_t>(raw->size());
        h.layout_tag = layout_tags_[c.pool];
        headers.push_back(std::move(h));
        raws.push_back(std::move(raw));
        writing.emplace_back(c.id, c.version);
      }
    } else {
      ++result->failed_blocks;
    }
    cache_->UnpinBlocks(c.pool, all);
  }
  if (!headers.empty()) {
    int64_t stored = 0;
    const int64_t n = static_cast<int64_t>(headers.size());
    if (absl::Status s = WriteSegmentOf(std::move(headers), std::move(raws), &stored); !s.ok()) {
      result->failed_blocks += n;
      if (result->error.empty()) result->error = std::string(s.message());
    } else {
      result->written_blocks += n;
      result->written_bytes += stored;
      for (const auto& [id, version] : writing) cache_->SetCheckpointDurable(id, version, true);
    }
  }
  // Stored checkpoints whose generation completed (or expired) since must not come back.
  bool deleted = false;
  {
    absl::MutexLock lock(&mu_);
    std::vector<BlockKey> ended;
    for (auto& [key, e] : entries_) {
      if (e.header.kind == RecordKind::kCheckpoint && e.segment != 0 && !live.contains(key)) {
        ended.push_back(key);
      }
    }
    for (const BlockKey& key : ended) {
      TombstoneLocked(key, entries_.at(key));
      EraseIfEmptyLocked(key);
      deleted = true;
    }
  }
  if (deleted) {
    if (absl::Status s = WriteManifestNow({}); !s.ok() && result->error.empty()) {
      result->error = std::string(s.message());
      ++result->failed_blocks;
    }
  }
}

void TierStore::RestoreCheckpoints() {
  std::vector<ReadSource> sources;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [key, e] : entries_) {
      if (e.header.kind == RecordKind::kCheckpoint && e.segment != 0) sources.push_back(PinForReadLocked(key, e));
    }
  }
  int64_t restored = 0;
  for (const ReadSource& src : sources) {
    absl::Status s = [&]() -> absl::Status {
      KVD_ASSIGN_OR_RETURN(PoolId pool, PoolOf(src.header.ns.pool));
      if (src.header.layout_tag != layout_tags_[pool]) {
        return absl::FailedPreconditionError(DescribeTagMismatch(pools_[pool], src.header.layout_tag));
      }
      std::string raw(static_cast<size_t>(src.header.raw_length), '\0');
      KVD_RETURN_IF_ERROR(ReadRaw(src, reinterpret_cast<uint8_t*>(raw.data())));
      uint32_t es = 0;
      if (raw.size() < sizeof(es)) return absl::DataLossError("truncated checkpoint record");
      std::memcpy(&es, raw.data(), sizeof(es));
      const PoolGeometry& g = pools_[pool];
      size_t at = sizeof(es) + static_cast<size_t>(es);
      if (raw.size() < at) return absl::DataLossError("truncated checkpoint record");
      std::vector<int64_t> units;  // a hybrid pool's, per group (the layout above UnitBytesInOrder)
      std::vector<int64_t> sizes(static_cast<size_t>(g.BlocksFor(static_cast<int64_t>(src.header.tokens.size()))),
                                 g.block_bytes_all_shards());
      if (g.hybrid()) {
        if (raw.size() < at + 1 || static_cast<uint8_t>(raw[at]) != g.groups.size() ||
            raw.size() < at + 1 + g.groups.size() * sizeof(uint32_t)) {
          return absl::DataLossError("checkpoint record's unit counts do not match its pool's groups");
        }
        ++at;
        for (size_t group = 0; group < g.groups.size(); ++group, at += sizeof(uint32_t)) {
          uint32_t n = 0;
          std::memcpy(&n, raw.data() + at, sizeof(n));
          units.push_back(n);
        }
        if (spine_groups_[pool] < 0) return absl::FailedPreconditionError("its pool has no spine group");
        sizes = UnitBytesInOrder(g, spine_groups_[pool], units);
      }
      int64_t want = static_cast<int64_t>(at);
      for (int64_t size : sizes) want += size;
      if (static_cast<int64_t>(raw.size()) != want) {
        return absl::DataLossError("checkpoint record size does not match its tokens");
      }
      KVD_ASSIGN_OR_RETURN(std::vector<BlockIndex> blocks,
                           cache_->RestoreCheckpoint(RequestId(src.header.object_key), src.header.ns,
                                                     src.header.tokens, raw.substr(sizeof(es), es), units));
      if (blocks.size() != sizes.size()) {
        return absl::InternalError("the restored checkpoint's units differ from its record's");
      }
      for (size_t i = 0; i < blocks.size(); ++i) {
        if (absl::Status w = arena_->WriteBlock(pool, blocks[i], reinterpret_cast<const uint8_t*>(raw.data() + at));
            !w.ok()) {
          // A unit left unwritten must never be resumed: the checkpoint goes, its record stays on disk.
          cache_->DropRestoredCheckpoint(RequestId(src.header.object_key));
          return w;
        }
        at += static_cast<size_t>(sizes[i]);
      }
      return absl::OkStatus();
    }();
    if (s.ok()) {
      ++restored;
    } else {
      spdlog::warn("tiers: checkpoint '{}' not restored: {}", src.header.object_key, s.ToString());
    }
    absl::MutexLock lock(&mu_);
    UnpinLocked(src.key);
  }
  absl::MutexLock lock(&mu_);
  stats_.restored_checkpoints = restored;
}

void TierStore::ScheduleSpillWriteLocked() {
  if (spill_write_scheduled_) return;
  spill_write_scheduled_ = true;
  writer_->Submit([this] { WriteSpills(); });
}

void TierStore::WriteSpills() {
  for (;;) {
    std::vector<RecordHeader> headers;
    std::vector<std::shared_ptr<const std::string>> raws;
    bool manifest_only = false;
    {
      absl::MutexLock lock(&mu_);
      int64_t bytes = 0;
      size_t taken = 0;
      for (; taken < spill_queue_.size() && bytes < options_.segment_bytes; ++taken) {
        auto it = entries_.find(spill_queue_[taken]);
        if (it == entries_.end() || it->second.spill == nullptr || it->second.segment != 0) continue;
        headers.push_back(it->second.header);
        raws.push_back(it->second.spill);
        bytes += static_cast<int64_t>(it->second.spill->size());
      }
      spill_queue_.erase(spill_queue_.begin(), spill_queue_.begin() + static_cast<int64_t>(taken));
      if (headers.empty()) {
        spill_write_scheduled_ = false;
        manifest_only = manifest_dirty_;
      }
    }
    if (headers.empty()) {
      if (manifest_only) {
        if (absl::Status s = WriteManifestNow({}); !s.ok()) spdlog::error("tiers: {}", std::string(s.message()));
      }
      return;
    }
    int64_t stored = 0;
    if (absl::Status s = WriteSegmentOf(headers, raws, &stored); !s.ok()) {
      spdlog::error("tiers: writing {} demoted blocks to disk failed: {}; they are dropped",
                    headers.size(), std::string(s.message()));
      absl::MutexLock lock(&mu_);
      for (const RecordHeader& h : headers) {
        auto it = entries_.find(h.key);
        if (it == entries_.end() || it->second.spill == nullptr) continue;
        spill_bytes_ -= static_cast<int64_t>(it->second.spill->size());
        it->second.spill = nullptr;
        RecountLocked(it->second);
        ++stats_.dropped;
        EraseIfEmptyLocked(h.key);
      }
    }
  }
}

absl::Status TierStore::WriteSegmentOf(std::vector<RecordHeader> headers,
                                       std::vector<std::shared_ptr<const std::string>> raws,
                                       int64_t* stored_bytes) {
  std::vector<std::string> compressed(headers.size());
  std::vector<absl::string_view> payloads(headers.size());
  int64_t raw_total = 0, total = 0;
  for (size_t i = 0; i < headers.size(); ++i) {
    const std::string& raw = *raws[i];
    headers[i].codec = Codec::kNone;
    payloads[i] = raw;  // stored as is unless the codec saves bytes
    if (options_.codec != Codec::kNone) {
      headers[i].codec = Compress(
          options_.codec, absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(raw.data()), raw.size()),
          &compressed[i]);
      if (headers[i].codec != Codec::kNone) payloads[i] = compressed[i];
    }
    headers[i].stored_length = static_cast<int64_t>(payloads[i].size());
    headers[i].checksum = Checksum(payloads[i].data(), payloads[i].size());
    raw_total += static_cast<int64_t>(raw.size());
    total += headers[i].stored_length;
  }
  uint64_t number = 0;
  {
    absl::MutexLock lock(&mu_);
    number = manifest_.next_segment++;
  }
  const absl::StatusOr<int64_t> size =
      WriteSegment(options_.disk_dir, SegmentName(number), headers, payloads, fs_);
  if (!size.ok()) {
    absl::MutexLock lock(&mu_);
    ++stats_.write_failures;
    return size.status();  // nothing was evicted for it: the index is as it was
  }
  std::vector<uint64_t> evicted;
  {
    absl::MutexLock lock(&mu_);
    // Room for the new segment is made once it exists: a failed write never costs the index the
    // segments it would have replaced (their files go after the next manifest write).
    evicted = EvictSegmentsLocked(*size);
    Segment& seg = segments_[number];
    seg.file_bytes = *size;
    seg.last_use = ++tick_;
    disk_used_ += *size;
    for (const RecordHeader& h : headers) {
      auto [it, inserted] = entries_.try_emplace(h.key);
      Entry& e = it->second;
      if (inserted) {
        e.last_use = cache_->clock()->Now();
      } else if (h.kind == RecordKind::kCheckpoint && e.header.kind == RecordKind::kCheckpoint) {
        if (e.segment != 0) TombstoneLocked(h.key, e);  // the generation moved on: replace it
      } else if (h.kind == RecordKind::kUnit && e.header.kind == RecordKind::kUnit && e.header.parts != h.parts &&
                 e.header.tokens == h.tokens && e.header.parent_key == h.parent_key) {
        // The same unit with other components (G1 gained or lost a checkpoint): the newer
        // replaces every older copy, unless a reader holds it now.
        if (e.pins > 0) continue;
        if (e.segment != 0) TombstoneLocked(h.key, e);
        DropSlotsLocked(e);
      } else if (e.segment != 0 || e.header.tokens != h.tokens || e.header.kind != h.kind ||
                 e.header.object_key != h.object_key) {
        continue;  // already on G3, or another record under a colliding key
      }
      e.header = h;
      e.segment = number;
      ++seg.records;
      if (e.spill != nullptr) {
        spill_bytes_ -= static_cast<int64_t>(e.spill->size());
        e.spill = nullptr;
      }
      RecountLocked(e);
    }
    stats_.raw_bytes_written += static_cast<uint64_t>(raw_total);
    stats_.stored_bytes_written += static_cast<uint64_t>(total);
  }
  *stored_bytes = total;
  absl::Status written = WriteManifestNow(evicted);
  ReportLostCheckpoints();  // before the caller marks what it wrote durable
  return written;
}

void TierStore::TombstoneLocked(const BlockKey& key, Entry& e) {
  manifest_.deleted.push_back(Tombstone{key, e.segment});
  auto seg = segments_.find(e.segment);
  if (seg != segments_.end()) --seg->second.records;
  e.segment = 0;
  RecountLocked(e);
  manifest_dirty_ = true;
}

std::vector<uint64_t> TierStore::EvictSegmentsLocked(int64_t bytes) {
  std::vector<uint64_t> evicted;
  while (disk_used_ + bytes > options_.disk_bytes) {
    // Unreadable segments are kept for a later start to read: never evicted.
    auto victim = segments_.end();
    for (auto it = segments_.begin(); it != segments_.end(); ++it) {
      if (!it->second.unreadable && (victim == segments_.end() || it->second.last_use < victim->second.last_use)) {
        victim = it;
      }
    }
    if (victim == segments_.end()) break;
    const uint64_t number = victim->first;
    disk_used_ -= victim->second.file_bytes;
    segments_.erase(victim);
    std::vector<BlockKey> keys;
    for (auto& [key, e] : entries_) {
      if (e.segment == number) keys.push_back(key);
    }
    for (const BlockKey& key : keys) {
      Entry& e = entries_.at(key);
      e.segment = 0;
      RecountLocked(e);
      if (e.header.kind == RecordKind::kCheckpoint) lost_checkpoints_.push_back(RequestId(e.header.object_key));
      EraseIfEmptyLocked(key);
    }
    std::erase_if(manifest_.deleted, [&](const Tombstone& t) { return t.segment == number; });
    evicted.push_back(number);
  }
  return evicted;
}

absl::Status TierStore::WriteManifestNow(const std::vector<uint64_t>& unlink_after) {
  Manifest m;
  {
    absl::MutexLock lock(&mu_);
    m.generation = ++manifest_.generation;
    m.next_segment = manifest_.next_segment;
    for (const auto& [number, seg] : segments_) m.segments.push_back(number);
    m.deleted = manifest_.deleted;
    manifest_dirty_ = false;
  }
  absl::Status s = WriteManifest(options_.disk_dir, m, fs_);
  if (!s.ok()) {
    absl::MutexLock lock(&mu_);
    manifest_dirty_ = true;
    ++stats_.write_failures;
    return s;
  }
  for (uint64_t number : unlink_after) {
    fs_->Unlink(absl::StrCat(options_.disk_dir, "/", SegmentName(number)).c_str());
  }
  return absl::OkStatus();
}

absl::Status TierStore::FlushAsync(std::function<void(FlushResult)> done) {
  if (options_.disk_dir.empty()) {
    return absl::FailedPreconditionError("no disk tier is configured (tiers.disk_dir): nothing can be durable");
  }
  writer_->Submit([this, done = std::move(done)] { done(FlushNow()); });
  return absl::OkStatus();
}

absl::StatusOr<FlushResult> TierStore::Flush() {
  absl::Notification finished;
  FlushResult result;
  KVD_RETURN_IF_ERROR(FlushAsync([&](FlushResult r) {
    result = std::move(r);
    finished.Notify();
  }));
  finished.WaitForNotification();
  return result;
}

FlushResult TierStore::FlushNow() {
  const auto start = std::chrono::steady_clock::now();
  FlushResult result;
  const auto fail = [&](const absl::Status& s, int64_t n) {
    result.failed_blocks += n;
    if (result.error.empty()) result.error = std::string(std::string(s.message()));
  };
  const auto write = [&](std::vector<RecordHeader>& headers,
                         std::vector<std::shared_ptr<const std::string>>& raws) {
    if (headers.empty()) return;
    const int64_t n = static_cast<int64_t>(headers.size());
    int64_t stored = 0;
    if (!result.error.empty()) {
      fail(absl::OkStatus(), n);  // storage already failed: do not hammer it
    } else if (absl::Status s = WriteSegmentOf(headers, raws, &stored); !s.ok()) {
      fail(s, n);
    } else {
      result.written_blocks += n;
      result.written_bytes += stored;
    }
    headers.clear();
    raws.clear();
  };
  // What "durable" promises: every block cached when the flush began. G1 is listed first, so a
  // block that leaves it while the flush runs (demoted by load or a gc) is looked for below.
  std::vector<CachedBlockRef> refs = cache_->SnapshotCached();
  std::vector<RecordHeader> headers;
  std::vector<std::shared_ptr<const std::string>> raws;
  // Writes the G2 and spill copies of the entries not on G3: every such entry, or only `keys`.
  // Returns how many of `keys` are held by no tier at all.
  const auto flush_held = [&](const absl::flat_hash_set<BlockKey>* keys) {
    WriteSpills();  // demoted blocks waiting for the writer
    std::vector<ReadSource> held;
    int64_t missing = 0;
    {
      absl::MutexLock lock(&mu_);
      const auto visit = [&](const BlockKey& key, Entry& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        if (e.segment != 0) {
          ++result.already_durable;
        } else if (!e.slots.empty() || e.spill != nullptr) {
          held.push_back(PinForReadLocked(key, e));
        } else {
          ++missing;
        }
      };
      if (keys == nullptr) {
        for (auto& [key, e] : entries_) visit(key, e);
      } else {
        for (const BlockKey& key : *keys) {
          auto it = entries_.find(key);
          if (it == entries_.end()) {
            ++missing;
          } else {
            visit(key, it->second);
          }
        }
      }
    }
    int64_t batch_bytes = 0;
    for (const ReadSource& src : held) {
      auto raw = std::make_shared<std::string>(static_cast<size_t>(src.header.raw_length), '\0');
      if (absl::Status s = ReadRaw(src, reinterpret_cast<uint8_t*>(raw->data())); !s.ok()) {
        fail(s, 1);
        continue;
      }
      headers.push_back(src.header);
      raws.push_back(std::move(raw));
      batch_bytes += src.header.raw_length;
      if (batch_bytes >= options_.segment_bytes) {
        write(headers, raws);
        batch_bytes = 0;
      }
    }
    write(headers, raws);
    absl::MutexLock lock(&mu_);
    for (const ReadSource& src : held) UnpinLocked(src.key);
    return missing;
  };
  // 1. G2 copies and pending spills not on G3 (blocks and objects).
  flush_held(nullptr);
  if (flush_hook_for_testing_) flush_hook_for_testing_();
  // 2. G1: every listed block not on G3, copied out under the cache lock in batches.
  {
    absl::MutexLock lock(&mu_);
    std::erase_if(refs, [&](const CachedBlockRef& r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      if (pools_[r.pool].hybrid()) return false;  // a unit's components are compared when visited
      auto it = entries_.find(r.key);
      const bool durable = it != entries_.end() && it->second.segment != 0;
      if (durable) ++result.already_durable;
      return durable;
    });
  }
  absl::flat_hash_set<BlockKey> left_g1;  // listed, no longer in G1 when visited
  for (size_t i = 0; i < refs.size();) {
    const int64_t per_block = pools_[refs[i].pool].block_bytes_all_shards();
    const size_t n = std::max<size_t>(1, static_cast<size_t>(options_.segment_bytes / per_block));
    const size_t end = std::min(refs.size(), i + n);
    absl::Status copy_error;
    absl::flat_hash_set<BlockKey> visited;
    cache_->VisitCached(absl::MakeConstSpan(refs).subspan(i, end - i), [&](const CachedBlockView& v) {
      visited.insert(v.key);
      RecordHeader h = BlockHeader(v);
      if (h.raw_length < 0) return;  // a hybrid unit with a part no record can name: not written
      if (h.kind == RecordKind::kUnit) {
        absl::MutexLock lock(&mu_);
        auto it = entries_.find(h.key);
        if (it != entries_.end() && it->second.segment != 0 && it->second.header.parts == h.parts) {
          ++result.already_durable;  // on G3 with the same components
          return;
        }
      }
      auto raw = std::make_shared<std::string>(static_cast<size_t>(h.raw_length), '\0');
      absl::Status s = ReadFromDevice(v, reinterpret_cast<uint8_t*>(raw->data()));
      if (!s.ok()) {
        if (copy_error.ok()) copy_error = s;
        return;
      }
      headers.push_back(std::move(h));
      raws.push_back(std::move(raw));
    });
    for (size_t j = i; j < end; ++j) {
      if (!visited.contains(refs[j].key)) left_g1.insert(refs[j].key);
    }
    if (!copy_error.ok()) fail(copy_error, 1);
    write(headers, raws);
    i = end;
  }
  // 3. Blocks that left G1 during the flush were demoted below it (or dropped for lack of room):
  // write them from there, and count any that no tier holds as not durable.
  // A block evicted under the cache lock is copied down after it (OnEvict, on the evicting
  // thread): wait for those on their way, up to kDemotionWait, before any counts as lost.
  if (!left_g1.empty()) {
    constexpr absl::Duration kDemotionWait = absl::Seconds(2);
    (void)cache_->WaitForDemotions(kDemotionWait);
    if (const int64_t lost = flush_held(&left_g1); lost > 0) {
      fail(absl::DataLossError(absl::StrCat(lost, " blocks cached when the flush began were dropped "
                                            "from every tier before they could be written")),
           lost);
    }
  }
  FlushCheckpoints(&result);
  // A manifest write that failed earlier (after its segment was written) must succeed before the
  // answer can say durable: the manifest is what a restart trusts.
  bool manifest_dirty = false;
  {
    absl::MutexLock lock(&mu_);
    manifest_dirty = manifest_dirty_;
  }
  if (manifest_dirty && result.error.empty()) {
    if (absl::Status s = WriteManifestNow({}); !s.ok()) fail(s, 1);
  }
  result.durable = result.failed_blocks == 0;
  result.seconds = SecondsSince(start);
  absl::MutexLock lock(&mu_);
  ++stats_.flushes;
  if (!result.durable) ++stats_.flush_failures;
  stats_.last_flush_seconds = result.seconds;
  stats_.last_flush_durable = result.durable;
  return result;
}

std::vector<SavedPrefix> TierStore::SavedPrefixes() const {
  absl::MutexLock lock(&mu_);
  absl::flat_hash_set<BlockKey> parents;
  for (const auto& [key, e] : entries_) {
    if (e.segment != 0 && IsChainRecord(e.header.kind) && e.header.has_parent) {
      parents.insert(e.header.parent_key);
    }
  }
  std::vector<SavedPrefix> out;
  for (const auto& [key, e] : entries_) {
    if (e.segment == 0 || !IsChainRecord(e.header.kind) || parents.contains(key)) continue;
    std::vector<const RecordHeader*> chain{&e.header};
    bool complete = true;
    while (chain.back()->has_parent) {
      auto it = entries_.find(chain.back()->parent_key);
      if (it == entries_.end() || it->second.segment == 0 || !IsChainRecord(it->second.header.kind)) {
        complete = false;
        break;
      }
      chain.push_back(&it->second.header);
    }
    if (!complete) continue;
    SavedPrefix p;
    p.ns = e.header.ns;
    for (auto it = chain.rbegin(); it != chain.rend(); ++it) {
      p.tokens.insert(p.tokens.end(), (*it)->tokens.begin(), (*it)->tokens.end());
    }
    out.push_back(std::move(p));
  }
  return out;
}

void TierStore::WaitIdleForTesting() {
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      if (spill_queue_.empty() && !spill_write_scheduled_ && writer_->pending() == 0 &&
          readers_->pending() == 0) {
        return;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

}  // namespace kvd
