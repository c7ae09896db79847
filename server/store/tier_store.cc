// TierStore: index, G2 memory, demotion, promotion, prefetch and objects. Disk: tier_store_disk.cc.
#include "server/store/tier_store.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "proto/vocab/status_macros.h"
#include "spdlog/spdlog.h"

namespace kvd {

absl::StatusOr<std::unique_ptr<TierStore>> TierStore::Open(TierOptions options,
                                                          const DeviceArena* arena, TierPort* cache) {
  if (options.segment_bytes <= 0) return absl::InvalidArgumentError("tiers.segment_bytes must be > 0");
  if (options.max_prefetch_handles_per_worker < 1) {
    return absl::InvalidArgumentError("tiers.max_prefetch_handles_per_worker must be >= 1");
  }
  if (options.disk_bytes <= 0) return absl::InvalidArgumentError("tiers.disk_bytes must be > 0");
  if (options.read_threads <= 0) return absl::InvalidArgumentError("tiers.read_threads must be > 0");
  std::unique_ptr<TierStore> store(new TierStore(std::move(options), arena, cache));
  if (store->options_.host_bytes > 0) {
    int64_t slot = 0;
    for (const PoolGeometry& g : store->pools_) slot = std::max(slot, g.block_bytes_all_shards());
    KVD_ASSIGN_OR_RETURN(std::unique_ptr<HostTier> host,
                         HostTier::Create(store->options_.host_bytes, slot, arena));
    absl::MutexLock lock(&store->mu_);
    store->host_ = std::move(host);
  }
  // With a disk, the G1 keys, then their changes (before any traffic: nothing changes between the
  // two). Without one no G1 block is on G3, and the engine's count of cached blocks is the answer.
  if (!store->options_.disk_dir.empty()) {
    std::vector<CachedBlockRef> g1 = cache->SnapshotCached();
    {
      absl::MutexLock lock(&store->mu_);
      for (const CachedBlockRef& r : g1) store->g1_keys_.insert(r.key);
    }
    store->cache_listener_ =
        cache->AddEventListener([raw = store.get()](const CacheEvent& e) { raw->OnCacheEvent(e); });
  }
  if (store->options_.remote.enabled()) {
    KVD_ASSIGN_OR_RETURN(store->remote_, RemoteTier::Open(store->options_.remote));
    if (store->options_.remote.write_through) {
      store->upload_listener_ = cache->AddEventListener(
          [raw = store.get()](const CacheEvent& e) { raw->QueueUpload(e); });
    }
  }
  return store;
}

TierStore::TierStore(TierOptions options, const DeviceArena* arena, TierPort* cache)
    : options_(std::move(options)),
      fs_(options_.file_system != nullptr ? options_.file_system : FileSystem::Default()),
      arena_(arena), cache_(cache), pools_(cache->pools()),
      readers_(std::make_unique<Executor>(options_.read_threads)),
      writer_(std::make_unique<Executor>(1)),
      uploader_(std::make_unique<Executor>(1)) {
  for (const PoolGeometry& g : pools_) {
    layout_tags_.push_back(LayoutTag(g));
    int spine = -1;
    for (size_t i = 0; i < g.groups.size() && spine < 0; ++i) {
      if (g.groups[i].kind == KvGroupKind::kFull) spine = static_cast<int>(i);
    }
    spine_groups_.push_back(spine);
  }
}

TierStore::~TierStore() {
  if (upload_listener_ >= 0) cache_->RemoveListenerAndWait(upload_listener_);
  if (cache_listener_ >= 0) cache_->RemoveListenerAndWait(cache_listener_);
  uploader_.reset();
  readers_.reset();
  writer_.reset();
  absl::MutexLock lock(&mu_);
  if (host_ != nullptr) {
    for (auto& [key, e] : entries_) {
      if (!e.slots.empty()) host_->Free(e.slots);
    }
  }
}

RecordHeader TierStore::BlockHeader(const CachedBlockView& v) const {
  RecordHeader h;
  h.kind = RecordKind::kBlock;
  h.ns = *v.ns;
  h.key = v.key;
  h.parent_key = v.parent_key;
  h.has_parent = v.has_parent;
  h.tokens.assign(v.tokens.begin(), v.tokens.end());
  h.raw_length = pools_[v.pool].block_bytes_all_shards();
  h.layout_tag = layout_tags_[v.pool];
  if (pools_[v.pool].hybrid()) {
    h.kind = RecordKind::kUnit;
    for (const UnitComponent& c : v.parts) h.parts.push_back(UnitRecordPart{static_cast<uint8_t>(c.group), c.tail});
    h.raw_length = UnitRawLength(v.pool, h.parts);
  }
  return h;
}

absl::StatusOr<PoolId> TierStore::PoolOf(const std::string& name) const {
  for (PoolId p = 0; p < pools_.size(); ++p) {
    if (pools_[p].name == name) return p;
  }
  return absl::NotFoundError(absl::StrCat("no pool named '", name, "'"));
}

TierStore::Entry* TierStore::FindBlockLocked(const BlockKey& key, const BlockKey& parent,
                                             bool has_parent, absl::Span<const Token> tokens) {
  auto it = entries_.find(key);
  if (it == entries_.end()) return nullptr;
  const RecordHeader& h = it->second.header;
  if (!IsChainRecord(h.kind) || h.has_parent != has_parent ||
      (has_parent && h.parent_key != parent) || !std::equal(h.tokens.begin(), h.tokens.end(),
                                                            tokens.begin(), tokens.end())) {
    return nullptr;  // a key collision: never serve it
  }
  return &it->second;
}

void TierStore::TouchLocked(const BlockKey& key, Entry& e) {
  e.last_use = cache_->clock()->Now();
  ++tick_;
  if (!e.slots.empty()) {
    g2_lru_.erase(e.lru_tick);
    e.lru_tick = tick_;
    g2_lru_[tick_] = key;
  }
  if (e.segment != 0) {
    auto seg = segments_.find(e.segment);
    if (seg != segments_.end()) seg->second.last_use = tick_;
  }
}

void TierStore::DropSlotsLocked(Entry& e) {
  if (e.slots.empty()) return;
  g2_lru_.erase(e.lru_tick);
  host_->Free(e.slots);
  e.slots.clear();
  RecountLocked(e);
}

void TierStore::EraseIfEmptyLocked(const BlockKey& key) {
  auto it = entries_.find(key);
  if (it == entries_.end()) return;
  Entry& e = it->second;
  if (e.slots.empty() && e.spill == nullptr && e.segment == 0 && e.pins == 0) {
    UncountLocked(e);
    entries_.erase(it);
  }
}

bool TierStore::SpillLocked(const BlockKey& key, Entry& e, std::shared_ptr<const std::string> raw) {
  // Cap what waits for the writer, so a slow disk costs cache hits, not unbounded memory.
  const int64_t cap = 4 * options_.segment_bytes;
  if (options_.disk_dir.empty() || spill_bytes_ + static_cast<int64_t>(raw->size()) > cap) {
    ++stats_.dropped;
    return false;
  }
  spill_bytes_ += static_cast<int64_t>(raw->size());
  e.spill = std::move(raw);
  RecountLocked(e);
  spill_queue_.push_back(key);
  ScheduleSpillWriteLocked();
  return true;
}

std::optional<std::vector<uint32_t>> TierStore::AllocateSlotsLocked(int64_t n) {
  if (host_ == nullptr || n > host_->num_slots()) return std::nullopt;
  auto it = g2_lru_.begin();
  while (host_->free_slots() < n && it != g2_lru_.end()) {
    const BlockKey key = it->second;
    ++it;
    Entry& victim = entries_.at(key);
    if (victim.pins > 0) continue;
    if (victim.segment == 0 && victim.spill == nullptr) {
      auto raw = std::make_shared<std::string>(static_cast<size_t>(victim.header.raw_length), '\0');
      host_->Gather(victim.slots, victim.header.raw_length, reinterpret_cast<uint8_t*>(raw->data()));
      if (SpillLocked(key, victim, std::move(raw))) ++stats_.demotions[kNumEvictReasons][2];
    }
    DropSlotsLocked(victim);  // erases victim's LRU node: continue after its tick
    it = g2_lru_.upper_bound(victim.lru_tick);
    EraseIfEmptyLocked(key);
  }
  return host_->Allocate(n);
}

void TierStore::OnEvict(const CachedBlockView& block, EvictReason reason) {
  if (demotion_hook_for_testing_) demotion_hook_for_testing_();
  // Three steps, so that no block bytes move under mu_ either: claim a destination (a host slot,
  // or a spill buffer) and pin the entry; copy without mu_; install the copy. A reader meanwhile
  // finds the entry without bytes below G1 (a miss there), never a half-written slot.
  const RecordHeader header = BlockHeader(block);
  const int64_t raw_bytes = header.raw_length;
  // A hybrid unit (several components, perhaps several slots) is read into one buffer first.
  const bool unit = header.kind == RecordKind::kUnit;
  if (unit && raw_bytes < 0) return;  // a part the record cannot name: dropped
  if (unit && remote_ != nullptr) QueueUnitUpload(block, header);  // G4: copied now, uploaded after
  const int r = static_cast<int>(reason);
  std::optional<std::vector<uint32_t>> slots;
  uint8_t* slot_bytes = nullptr;  // the claimed slot: this call's alone until installed
  HostTier* host = nullptr;       // G2, when slots were claimed (its slots are this call's alone)
  bool spill = false;
  {
    absl::MutexLock lock(&mu_);
    auto [it, inserted] = entries_.try_emplace(block.key);
    Entry* e = &it->second;
    if (!inserted) {
      e = FindBlockLocked(block.key, block.parent_key, block.has_parent, block.tokens);
      if (e == nullptr) return;  // a collision with another record: keep that one
      TouchLocked(block.key, *e);
      if (e->header.parts != header.parts) {
        // The unit leaves G1 with other components than its stored copy has: the newer replaces
        // it, unless a reader or the writer holds the old one now (then the old one stays).
        if (e->pins > 0 || e->spill != nullptr) return;
        DropSlotsLocked(*e);
        if (e->segment != 0) {
          TombstoneLocked(block.key, *e);
          ScheduleSpillWriteLocked();
        }
        e->header = header;
        RecountLocked(*e);
      } else if (!e->slots.empty() || e->spill != nullptr) {
        return;  // already in memory below G1
      }
    } else {
      e->header = header;
      e->last_use = cache_->clock()->Now();
      RecountLocked(*e);
    }
    slots = AllocateSlotsLocked(host_ == nullptr ? 1 : host_->SlotsFor(raw_bytes));
    e = &entries_.at(block.key);  // slot allocation may have erased other entries (not this one)
    if (slots.has_value() && !unit) slot_bytes = host_->slot((*slots)[0]);
    if (slots.has_value()) host = host_.get();
    if (!slots.has_value()) {
      spill = e->segment == 0 && !options_.disk_dir.empty();
      if (!spill) {
        if (e->segment == 0) ++stats_.dropped;
        EraseIfEmptyLocked(block.key);
        return;
      }
    }
    ++e->pins;  // kept while the copy runs
  }
  absl::Status copied;
  std::shared_ptr<std::string> raw;
  if (unit) {
    raw = std::make_shared<std::string>(static_cast<size_t>(raw_bytes), '\0');
    copied = ReadFromDevice(block, reinterpret_cast<uint8_t*>(raw->data()));
    if (copied.ok() && slots.has_value()) host->Scatter(*slots, reinterpret_cast<const uint8_t*>(raw->data()), raw_bytes);
  } else if (slots.has_value()) {
    copied = arena_->ReadBlock(block.pool, block.index, slot_bytes);
  } else {
    raw = std::make_shared<std::string>(static_cast<size_t>(raw_bytes), '\0');
    copied = arena_->ReadBlock(block.pool, block.index, reinterpret_cast<uint8_t*>(raw->data()));
  }
  absl::MutexLock lock(&mu_);
  Entry& e = entries_.at(block.key);
  --e.pins;
  const bool taken = !e.slots.empty() || e.spill != nullptr;  // another demotion of this key won
  if (slots.has_value()) {
    if (copied.ok() && !taken) {
      e.slots = *std::move(slots);
      RecountLocked(e);
      TouchLocked(block.key, e);
      ++stats_.demotions[r][1];
      return;
    }
    host_->Free(*slots);
    if (!copied.ok()) {
      spdlog::warn("demotion of block {} to host memory failed: {}", block.key.ToHex(), copied.ToString());
    }
  } else if (copied.ok() && !taken && e.segment == 0 && SpillLocked(block.key, e, std::move(raw))) {
    ++stats_.demotions[r][2];
    return;
  }
  EraseIfEmptyLocked(block.key);
}

TierStore::ReadSource TierStore::PinForReadLocked(const BlockKey& key, Entry& e) {
  ++e.pins;
  TouchLocked(key, e);
  ReadSource src;
  src.key = key;
  src.header = e.header;
  if (!e.slots.empty() && e.slots.size() == 1) {
    src.slot_bytes = host_->slot(e.slots[0]);
  } else if (!e.slots.empty()) {
    auto raw = std::make_shared<std::string>(static_cast<size_t>(e.header.raw_length), '\0');
    host_->Gather(e.slots, e.header.raw_length, reinterpret_cast<uint8_t*>(raw->data()));
    src.spill = std::move(raw);
  } else if (e.spill != nullptr) {
    src.spill = e.spill;
  } else if (e.segment != 0) {
    src.segment = e.segment;
    src.segment_path = absl::StrCat(options_.disk_dir, "/", SegmentName(e.segment));
  }
  return src;
}

void TierStore::UnpinLocked(const BlockKey& key) {
  auto it = entries_.find(key);
  if (it == entries_.end()) return;
  --it->second.pins;
  EraseIfEmptyLocked(key);
}

absl::Status TierStore::ReadRaw(const ReadSource& src, uint8_t* out) {
  if (src.slot_bytes != nullptr) {
    std::memcpy(out, src.slot_bytes, static_cast<size_t>(src.header.raw_length));
    return absl::OkStatus();
  }
  if (src.spill != nullptr) {
    std::memcpy(out, src.spill->data(), src.spill->size());
    return absl::OkStatus();
  }
  if (src.segment_path.empty()) return absl::NotFoundError("the record has no bytes anywhere");
  std::string stored;
  KVD_RETURN_IF_ERROR(ReadRecordBytes(src.segment_path, src.header, &stored, fs_));
  return Decompress(src.header.codec,
                    absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(stored.data()), stored.size()),
                    out, src.header.raw_length);
}

void TierStore::OnReadFailure(const ReadSource& src, const absl::Status& s) {
  if (s.ok()) return;
  absl::MutexLock lock(&mu_);
  if (!absl::IsDataLoss(s)) {
    // An I/O or permission error proves nothing about the bytes: count it, keep the record.
    if (src.segment != 0) ++stats_.read_errors;
    return;
  }
  ++stats_.checksum_failures;
  auto it = entries_.find(src.key);
  // Only the copy that was read is dropped: the entry may have moved to another segment since.
  if (it == entries_.end() || src.segment == 0 || it->second.segment != src.segment) return;
  TombstoneLocked(src.key, it->second);
  ScheduleSpillWriteLocked();
  EraseIfEmptyLocked(src.key);
}

bool TierStore::Promote(const RequestId& id, const RequestSpec& spec, const AcquireResult& acquired,
                        PromoteDone done) {
  if (acquired.resumed) return false;
  const PoolGeometry& g = pools_[acquired.pool];
  if (g.hybrid()) return false;  // units come back before the lookup (InstallUnits)
  const int32_t bt = g.block_tokens;
  const int64_t prompt_len = static_cast<int64_t>(spec.prompt.size());
  const int64_t max_blocks = (prompt_len - 1) / bt;  // leave one token to compute
  const int64_t first = acquired.cached_tokens / bt;
  if (first >= max_blocks) return false;
  std::vector<BlockKey> keys = ChainKeys(spec.ns, spec.prompt, bt, max_blocks);
  std::vector<ReadSource> sources;
  {
    absl::MutexLock lock(&mu_);
    for (int64_t i = first; i < max_blocks; ++i) {
      const absl::Span<const Token> tokens = absl::MakeConstSpan(spec.prompt).subspan(i * bt, bt);
      Entry* e = FindBlockLocked(keys[i], i > 0 ? keys[i - 1] : BlockKey{}, i > 0, tokens);
      if (e == nullptr || !HasBytes(*e) || e->header.layout_tag != layout_tags_[acquired.pool] ||
          e->header.raw_length != g.block_bytes_all_shards()) {
        break;
      }
      sources.push_back(PinForReadLocked(keys[i], *e));
    }
  }
  // G4 is asked for what follows the local run (skipped at once while it is failing).
  const int64_t local_end = first + static_cast<int64_t>(sources.size());
  const bool ask_remote = remote_ != nullptr && remote_->available() && local_end < max_blocks;
  if (sources.empty() && !ask_remote) return false;
  const int64_t end = ask_remote ? max_blocks : local_end;
  std::vector<BlockIndex> targets(acquired.blocks.begin() + first, acquired.blocks.begin() + end);
  if (!cache_->PinBlocks(id, targets).ok()) {  // the request is already gone
    absl::MutexLock lock(&mu_);
    for (const ReadSource& s : sources) UnpinLocked(s.key);
    return false;
  }
  std::vector<Token> prompt = ask_remote ? spec.prompt : std::vector<Token>{};
  readers_->Submit([this, id, pool = acquired.pool, first, bt, sources = std::move(sources),
                    targets = std::move(targets), done = std::move(done), ask_remote, ns = spec.ns,
                    prompt = std::move(prompt), keys = std::move(keys)]() {
    std::vector<uint8_t> buf(static_cast<size_t>(pools_[pool].block_bytes_all_shards()));
    int64_t copied = 0;
    int from_tier[kNumTiers] = {};
    for (size_t i = 0; i < sources.size(); ++i) {
      const ReadSource& src = sources[i];
      absl::Status s = src.slot_bytes != nullptr
                           ? arena_->WriteBlock(pool, targets[i], src.slot_bytes)
                           : ReadRaw(src, buf.data());
      if (s.ok() && src.slot_bytes == nullptr) s = arena_->WriteBlock(pool, targets[i], buf.data());
      if (!s.ok()) {
        spdlog::error("promotion: {}{}", std::string(s.message()),
                      absl::IsDataLoss(s) ? "; the block is dropped" : "; the block is kept");
        OnReadFailure(src, s);
        break;
      }
      ++from_tier[src.segment_path.empty() ? 1 : 2];
      ++copied;
    }
    {
      absl::MutexLock lock(&mu_);
      for (const ReadSource& s : sources) UnpinLocked(s.key);
    }
    if (ask_remote && copied == static_cast<int64_t>(sources.size())) {
      copied += FetchRemote(pool, ns, prompt, keys, first + copied,
                            absl::MakeConstSpan(targets).subspan(static_cast<size_t>(copied)));
    }
    absl::StatusOr<int64_t> result = (first + copied) * bt;
    if (copied > 0) {
      absl::Status adopted = cache_->AdoptPromoted(id, *result);
      if (adopted.ok()) {
        absl::MutexLock lock(&mu_);
        stats_.promotions[1] += from_tier[1];
        stats_.promotions[2] += from_tier[2];
        stats_.promoted_tokens += copied * bt;
      } else {
        result = adopted;
      }
    } else {
      result = first * bt;
    }
    cache_->UnpinBlocks(pool, targets);
    done(result);
  });
  return true;
}

absl::StatusOr<PrefetchInfo> TierStore::Prefetch(const Namespace& ns, absl::Span<const Token> tokens,
                                                 const WorkerId& owner) {
  KVD_ASSIGN_OR_RETURN(PoolId pool, PoolOf(ns.pool));
  const int32_t bt = pools_[pool].block_tokens;
  const std::vector<BlockKey> keys =
      ChainKeys(ns, tokens, bt, (static_cast<int64_t>(tokens.size()) - 1) / bt);
  PrefetchInfo info;
  std::vector<ReadSource> to_load;
  absl::MutexLock lock(&mu_);
  int64_t& held = prefetches_of_[owner];
  if (held >= options_.max_prefetch_handles_per_worker) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "worker '", owner.value(), "' holds ", held, " prefetch handles (max_prefetch_handles_per_worker); release some"));
  }
  ++held;
  Prefetched p;
  p.owner = owner;
  for (size_t i = 0; i < keys.size(); ++i) {
    Entry* e = FindBlockLocked(keys[i], i > 0 ? keys[i - 1] : BlockKey{}, i > 0,
                               tokens.subspan(i * bt, bt));
    if (e == nullptr || !HasBytes(*e)) continue;  // absent, or a demotion still copying it
    ++info.found_blocks;
    ++e->pins;
    TouchLocked(keys[i], *e);
    p.keys.push_back(keys[i]);
    if (e->slots.empty() && e->spill == nullptr && e->segment != 0 && host_ != nullptr) {
      to_load.push_back(PinForReadLocked(keys[i], *e));
    }
  }
  info.loading_blocks = static_cast<int64_t>(to_load.size());
  info.handle = next_prefetch_++;
  prefetches_[info.handle] = std::move(p);
  for (ReadSource& src : to_load) {
    readers_->Submit([this, src = std::move(src)]() {
      std::vector<uint8_t> raw(static_cast<size_t>(src.header.raw_length));
      absl::Status s = ReadRaw(src, raw.data());
      OnReadFailure(src, s);
      absl::MutexLock lock(&mu_);
      auto it = entries_.find(src.key);
      if (s.ok() && it != entries_.end() && it->second.slots.empty()) {
        if (auto slots = AllocateSlotsLocked(host_->SlotsFor(src.header.raw_length))) {
          Entry& e = entries_.at(src.key);
          host_->Scatter(*slots, raw.data(), src.header.raw_length);
          e.slots = *std::move(slots);
          RecountLocked(e);
          TouchLocked(src.key, e);
        }
      }
      UnpinLocked(src.key);
    });
  }
  return info;
}

void TierStore::ForgetPrefetchLocked(const WorkerId& owner) {
  auto it = prefetches_of_.find(owner);
  if (it != prefetches_of_.end() && --it->second <= 0) prefetches_of_.erase(it);
}

absl::Status TierStore::ReleasePrefetch(uint64_t handle, const WorkerId& owner) {
  absl::MutexLock lock(&mu_);
  auto it = prefetches_.find(handle);
  if (it == prefetches_.end()) return absl::NotFoundError(absl::StrCat("no prefetch handle ", handle));
  if (it->second.owner != owner) {
    return absl::PermissionDeniedError(absl::StrCat("prefetch handle ", handle, " is another worker's"));
  }
  for (const BlockKey& k : it->second.keys) UnpinLocked(k);
  ForgetPrefetchLocked(owner);
  prefetches_.erase(it);
  return absl::OkStatus();
}

void TierStore::ReleasePrefetchesOf(const WorkerId& owner) {
  absl::MutexLock lock(&mu_);
  for (auto it = prefetches_.begin(); it != prefetches_.end();) {
    if (it->second.owner == owner) {
      for (const BlockKey& k : it->second.keys) UnpinLocked(k);
      ForgetPrefetchLocked(owner);
      prefetches_.erase(it++);
    } else {
      ++it;
    }
  }
}

absl::Status TierStore::PutObject(const Namespace& ns, const std::string& key, absl::string_view bytes) {
  if (key.empty()) return absl::InvalidArgumentError("object key is required");
  KVD_RETURN_IF_ERROR(PoolOf(ns.pool).status());
  const BlockKey k = ObjectKey(ns, key);
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(k);
  if (it != entries_.end()) {
    if (it->second.pins > 0) {
      return absl::FailedPreconditionError(absl::StrCat("object '", key, "' is being read"));
    }
    Entry& old = it->second;
    DropSlotsLocked(old);
    if (old.spill != nullptr) spill_bytes_ -= static_cast<int64_t>(old.spill->size());
    if (old.segment != 0) TombstoneLocked(k, old);
    UncountLocked(old);
    entries_.erase(it);
  }
  Entry fresh;
  fresh.header.kind = RecordKind::kObject;
  fresh.header.ns = ns;
  fresh.header.key = k;
  fresh.header.object_key = key;
  fresh.header.raw_length = static_cast<int64_t>(bytes.size());
  fresh.last_use = cache_->clock()->Now();
  Entry& e = entries_.emplace(k, std::move(fresh)).first->second;
  RecountLocked(e);
  if (host_ != nullptr) {
    if (auto slots = AllocateSlotsLocked(host_->SlotsFor(static_cast<int64_t>(bytes.size())))) {
      Entry& placed = entries_.at(k);
      host_->Scatter(*slots, reinterpret_cast<const uint8_t*>(bytes.data()),
                     static_cast<int64_t>(bytes.size()));
      placed.slots = *std::move(slots);
      RecountLocked(placed);
      TouchLocked(k, placed);
      return absl::OkStatus();
    }
  }
  if (SpillLocked(k, e, std::make_shared<const std::string>(bytes))) return absl::OkStatus();
  --stats_.dropped;  // refused, not dropped
  UncountLocked(entries_.at(k));
  entries_.erase(k);
  return absl::ResourceExhaustedError(absl::StrCat("no tier has room for an object of ",
                                                   bytes.size(), " bytes"));
}

void TierStore::GetObject(const Namespace& ns, const std::string& key,
                          std::function<void(absl::StatusOr<std::string>)> done) {
  const BlockKey k = ObjectKey(ns, key);
  ReadSource src;
  {
    absl::MutexLock lock(&mu_);
    auto it = entries_.find(k);
    if (it == entries_.end() || it->second.header.kind != RecordKind::kObject ||
        it->second.header.object_key != key || !(it->second.header.ns == ns)) {
      done(absl::NotFoundError(absl::StrCat("no object '", key, "' in ", ns.DebugString())));
      return;
    }
    Entry& e = it->second;
    if (!e.slots.empty() || e.spill != nullptr) {
      std::string out(static_cast<size_t>(e.header.raw_length), '\0');
      if (!e.slots.empty()) {
        host_->Gather(e.slots, e.header.raw_length, reinterpret_cast<uint8_t*>(out.data()));
      } else {
        out = *e.spill;
      }
      TouchLocked(k, e);
      done(std::move(out));
      return;
    }
    src = PinForReadLocked(k, e);
  }
  readers_->Submit([this, src = std::move(src), done = std::move(done)]() {
    std::string out(static_cast<size_t>(src.header.raw_length), '\0');
    absl::Status s = ReadRaw(src, reinterpret_cast<uint8_t*>(out.data()));
    {
      absl::MutexLock lock(&mu_);
      UnpinLocked(src.key);
    }
    OnReadFailure(src, s);
    if (!s.ok()) {
      done(s);
      return;
    }
    done(std::move(out));
  });
}

absl::Status TierStore::DeleteObject(const Namespace& ns, const std::string& key) {
  const BlockKey k = ObjectKey(ns, key);
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(k);
  if (it == entries_.end() || it->second.header.kind != RecordKind::kObject ||
      it->second.header.object_key != key) {
    return absl::NotFoundError(absl::StrCat("no object '", key, "' in ", ns.DebugString()));
  }
  Entry& e = it->second;
  if (e.pins > 0) return absl::FailedPreconditionError(absl::StrCat("object '", key, "' is being read"));
  DropSlotsLocked(e);
  if (e.spill != nullptr) spill_bytes_ -= static_cast<int64_t>(e.spill->size());
  if (e.segment != 0) {
    TombstoneLocked(k, e);
    ScheduleSpillWriteLocked();  // persists the tombstone with the next manifest
  }
  UncountLocked(e);
  entries_.erase(it);
  return absl::OkStatus();
}

void TierStore::DemoteIdle() {
  if (!idle_demotion()) return;
  const absl::Time cutoff = cache_->clock()->Now() - options_.idle_demote_after;
  absl::MutexLock lock(&mu_);
  if (options_.disk_dir.empty()) return;
  std::vector<BlockKey> idle;
  for (const auto& [tick, key] : g2_lru_) {
    const Entry& e = entries_.at(key);
    if (e.last_use > cutoff) break;  // LRU order: the rest are newer
    if (e.pins == 0 && e.segment == 0 && e.spill == nullptr) idle.push_back(key);
  }
  for (const BlockKey& key : idle) {
    Entry& e = entries_.at(key);
    auto raw = std::make_shared<std::string>(static_cast<size_t>(e.header.raw_length), '\0');
    host_->Gather(e.slots, e.header.raw_length, reinterpret_cast<uint8_t*>(raw->data()));
    if (!SpillLocked(key, e, std::move(raw))) break;
    ++stats_.demotions[kNumEvictReasons][2];
    DropSlotsLocked(e);
  }
}

void TierStore::DropMemory() {
  absl::MutexLock lock(&mu_);
  for (auto it = entries_.begin(); it != entries_.end();) {
    Entry& e = it->second;
    if (e.pins > 0) {
      ++it;
      continue;
    }
    DropSlotsLocked(e);
    if (e.spill != nullptr) spill_bytes_ -= static_cast<int64_t>(e.spill->size());
    e.spill = nullptr;
    RecountLocked(e);
    if (e.segment == 0) {
      UncountLocked(e);
      entries_.erase(it++);
    } else {
      ++it;
    }
  }
  spill_queue_.clear();
}

}  // namespace kvd
