// TierStore's G4 side: write-through uploads of published blocks and prefix fetches from Redis;
// a hybrid pool's units (docs/hybrid.md §2.9) go up as they leave G1 and come back before the
// lookup (InstallUnits), one value per unit.
#include <algorithm>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "server/store/remote_value.h"
#include "server/store/tier_store.h"
#include "spdlog/spdlog.h"

namespace kvd {
namespace {

constexpr size_t kUploadBatch = 64;  // blocks per pipeline
// Values per pipelined GET round trip: up to 32, and at most ~8 MiB in flight. Deeper pipelines of
// large values make Redis queue tens of MiB of replies and slow it several-fold (2 MiB values:
// 0.24 GB/s at depth 32 against 1.4 GB/s at depth 4 on loopback).
constexpr size_t kFetchMaxDepth = 32;
constexpr int64_t kFetchWindowBytes = int64_t{8} << 20;
// Hybrid units are copied out of G1 as they leave it (the blocks are freed right after), so what
// waits for the uploader is bytes, not references: at most this much; more is dropped (counted).
constexpr int64_t kMaxPendingUnitBytes = int64_t{256} << 20;

// How much of a unit's value holds its header: the smallest header, the pool's name, the object
// key ("<64 hex digest>#<64 hex mac>" or "<digest>:<key id of 16 at most>") and the parts, with room.
int64_t UnitHeadBytes(const std::string& pool) {
  return static_cast<int64_t>(kMinRecordHeaderBytes + pool.size()) + 1024;
}

// Whether the unit whose value begins with `head` holds every part of `unit` (then an upload of
// `unit` would only lose what the stored one has more: it is left in place, its TTL renewed).
bool Covers(absl::string_view head, const RemoteBlockIdentity& unit) {
  absl::StatusOr<RecordHeader> h = DecodeRecordHeader(&head);
  if (!h.ok() || h->kind != RecordKind::kUnit || h->ns.pool != unit.pool || h->key != unit.key ||
      h->layout_tag != unit.layout_tag || !absl::StartsWith(h->object_key, unit.digest)) {
    return false;
  }
  return std::all_of(unit.parts.begin(), unit.parts.end(), [&](const UnitRecordPart& p) {
    return std::find(h->parts.begin(), h->parts.end(), p) != h->parts.end();
  });
}

}  // namespace

RemoteBlockIdentity TierStore::RemoteIdentityOf(const CachedBlockView& v, int64_t raw_length) const {
  // A shared server sees the pool and key only; what identifies the block (adapter, media,
  // method, salt, parent, tokens) travels as a keyed digest.
  return RemoteBlockIdentity{
      .pool = v.ns->pool,
      .key = v.key,
      .has_parent = v.has_parent,
      .parent_key = v.parent_key,
      .digest = remote_->ValueDigest(v.root_key, v.key, v.has_parent ? &v.parent_key : nullptr, v.tokens),
      .layout_tag = layout_tags_[v.pool],
      .raw_length = raw_length};
}

void TierStore::QueueUpload(const CacheEvent& e) {
  if (e.kind != CacheEventKind::kStored || !e.medium.empty()) return;  // only blocks new in G1
  absl::StatusOr<PoolId> pool = PoolOf(e.pool);
  if (!pool.ok()) return;
  // A hybrid pool's units go up whole as they leave G1 (QueueUnitUpload): only then are their
  // components (window blocks, checkpoints published after the full block) all known.
  if (pools_[*pool].hybrid()) return;
  Namespace ns;
  ns.pool = e.pool;
  ns.adapter = e.adapter;
  ns.media_keys = e.media_keys;
  ns.method = e.method;
  ns.cache_salt = e.cache_salt;
  Upload upload{CachedBlockRef{*pool, e.block, e.key}, remote_->KeyName(ns, pools_[*pool].model_fingerprint, e.key)};
  {
    absl::MutexLock lock(&upload_mu_);
    if (static_cast<int64_t>(upload_queue_.size()) >= options_.remote.max_pending_uploads) {
      remote_->CountUploadDropped(1);
      return;
    }
    upload_queue_.push_back(std::move(upload));
    if (upload_scheduled_) return;
    upload_scheduled_ = true;
  }
  uploader_->Submit([this] { UploadQueued(); });
}

void TierStore::QueueUnitUpload(const CachedBlockView& v, const RecordHeader& header) {
  if (!options_.remote.write_through || header.raw_length <= 0) return;
  {
    absl::MutexLock lock(&upload_mu_);
    if (static_cast<int64_t>(upload_queue_.size()) >= options_.remote.max_pending_uploads ||
        upload_unit_bytes_ + header.raw_length > kMaxPendingUnitBytes) {
      remote_->CountUploadDropped(1);
      return;
    }
    upload_unit_bytes_ += header.raw_length;  // claimed before the copy, so concurrent evictions cannot overshoot
  }
  auto raw = std::make_shared<std::string>(static_cast<size_t>(header.raw_length), '\0');
  if (!ReadFromDevice(v, reinterpret_cast<uint8_t*>(raw->data())).ok()) {
    absl::MutexLock lock(&upload_mu_);
    upload_unit_bytes_ -= header.raw_length;
    remote_->CountUploadDropped(1);
    return;
  }
  Upload upload{.ref = CachedBlockRef{v.pool, v.index, v.key},
                .name = remote_->KeyName(*v.ns, pools_[v.pool].model_fingerprint, v.key, layout_tags_[v.pool]),
                .unit_raw = std::move(raw),
                .unit = RemoteIdentityOf(v, header.raw_length)};
  upload.unit.kind = RecordKind::kUnit;
  upload.unit.parts = header.parts;
  {
    absl::MutexLock lock(&upload_mu_);
    upload_queue_.push_back(std::move(upload));
    if (upload_scheduled_) return;
    upload_scheduled_ = true;
  }
  uploader_->Submit([this] { UploadQueued(); });
}

void TierStore::UploadUnits(std::vector<Upload> batch) {
  std::vector<std::string> names;
  int64_t head_bytes = 0;
  for (const Upload& u : batch) {
    names.push_back(u.name);
    head_bytes = std::max(head_bytes, UnitHeadBytes(u.unit.pool));
  }
  absl::StatusOr<std::vector<std::string>> heads = remote_->Heads(names, head_bytes, /*lookup=*/false);
  if (!heads.ok()) {
    remote_->CountUploadDropped(batch.size());
    return;
  }
  // A unit goes up unless the stored one already holds all its parts: the newer replaces it
  // otherwise (as on G2/G3), so a unit that gained a checkpoint since is not kept from Redis.
  std::vector<std::pair<std::string, std::string>> items;
  uint64_t kept = 0;
  std::string compressed;
  for (size_t i = 0; i < batch.size(); ++i) {
    if (!(*heads)[i].empty() && Covers((*heads)[i], batch[i].unit)) {
      ++kept;
      continue;
    }
    const std::string& raw = *batch[i].unit_raw;
    const Codec codec = Compress(options_.codec, absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(raw.data()), raw.size()),
                                 &compressed);
    absl::StatusOr<std::string> value =
        SealRemoteValue(batch[i].unit, codec, codec == Codec::kNone ? absl::string_view(raw) : absl::string_view(compressed),
                        remote_->value_keys());
    if (!value.ok()) {
      remote_->CountUploadDropped(1);
      continue;
    }
    items.emplace_back(std::move(batch[i].name), *std::move(value));
  }
  remote_->CountRefreshed(kept);
  if (!remote_->Store(items).ok()) remote_->CountUploadDropped(items.size());
}

void TierStore::UploadQueued() {
  for (;;) {
    std::vector<Upload> batch;
    std::vector<Upload> units;
    {
      absl::MutexLock lock(&upload_mu_);
      const size_t n = std::min(kUploadBatch, upload_queue_.size());
      if (n == 0) {
        upload_scheduled_ = false;
        return;
      }
      for (size_t i = 0; i < n; ++i) {
        Upload& u = upload_queue_[i];
        if (u.unit_raw != nullptr) upload_unit_bytes_ -= static_cast<int64_t>(u.unit_raw->size());
        (u.unit_raw != nullptr ? units : batch).push_back(std::move(u));
      }
      upload_queue_.erase(upload_queue_.begin(), upload_queue_.begin() + n);
    }
    if (!units.empty()) UploadUnits(std::move(units));
    if (batch.empty()) continue;
    // Blocks another node (or an earlier upload) already stored only get their TTL renewed.
    std::vector<std::string> names;
    for (const Upload& u : batch) names.push_back(u.name);
    absl::StatusOr<std::vector<bool>> present = remote_->Refresh(names);
    if (!present.ok()) {  // failing server: drop, do not queue up behind it
      remote_->CountUploadDropped(batch.size());
      continue;
    }
    std::vector<CachedBlockRef> refs;
    absl::flat_hash_map<BlockKey, std::string> name_of;
    for (size_t i = 0; i < batch.size(); ++i) {
      if ((*present)[i]) continue;
      refs.push_back(batch[i].ref);
      name_of[batch[i].ref.key] = std::move(batch[i].name);
    }
    if (refs.empty()) continue;
    // Copy each still-cached block out under the cache lock (as a flush does) with what identifies
    // it, compressing and sealing outside the lock (remote_value.h).
    std::vector<RemoteBlockIdentity> ids;
    std::vector<std::string> raws;
    std::vector<std::string> keys;
    cache_->VisitCached(refs, [&](const CachedBlockView& v) {
      std::string raw(static_cast<size_t>(pools_[v.pool].block_bytes_all_shards()), '\0');
      if (!arena_->ReadBlock(v.pool, v.index, reinterpret_cast<uint8_t*>(raw.data())).ok()) return;
      ids.push_back(RemoteIdentityOf(v, static_cast<int64_t>(raw.size())));
      keys.push_back(name_of[v.key]);
      raws.push_back(std::move(raw));
    });
    if (ids.size() < refs.size()) remote_->CountUploadDropped(refs.size() - ids.size());
    std::vector<std::pair<std::string, std::string>> items;
    items.reserve(ids.size());
    std::string compressed;
    for (size_t i = 0; i < ids.size(); ++i) {
      const std::string& raw = raws[i];
      const Codec codec = Compress(options_.codec, absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(raw.data()), raw.size()),
                                   &compressed);
      absl::StatusOr<std::string> value =
          SealRemoteValue(ids[i], codec, codec == Codec::kNone ? absl::string_view(raw) : absl::string_view(compressed),
                          remote_->value_keys());
      if (!value.ok()) {
        remote_->CountUploadDropped(1);
        continue;
      }
      items.emplace_back(std::move(keys[i]), *std::move(value));
    }
    if (!remote_->Store(items).ok()) remote_->CountUploadDropped(items.size());
  }
}

int64_t TierStore::FetchRemote(PoolId pool, const Namespace& ns, absl::Span<const Token> prompt,
                               absl::Span<const BlockKey> keys, int64_t from,
                               absl::Span<const BlockIndex> targets) {
  const int32_t bt = pools_[pool].block_tokens;
  const int64_t raw_length = pools_[pool].block_bytes_all_shards();
  std::vector<std::string> names;
  for (size_t i = 0; i < targets.size(); ++i) names.push_back(remote_->KeyName(ns, pools_[pool].model_fingerprint, keys[from + i]));
  absl::StatusOr<int64_t> run = remote_->RunLength(names);
  if (!run.ok() || *run == 0) return 0;
  const BlockKey root_key = NamespaceRootKey(ns);
  names.resize(static_cast<size_t>(*run));
  std::vector<uint8_t> buf(static_cast<size_t>(raw_length));
  std::string opened;  // decrypted bytes, reused across values
  int64_t copied = 0;
  const size_t depth = static_cast<size_t>(std::clamp<int64_t>(kFetchWindowBytes / raw_length, 1, kFetchMaxDepth));
  for (size_t start = 0; start < names.size(); start += depth) {
    const std::vector<std::string> chunk(names.begin() + start,
                                         names.begin() + std::min(names.size(), start + depth));
    bool ok = true;
    const absl::Status fetched = remote_->Fetch(chunk, [&](size_t, const absl::string_view* value) {
      const int64_t i = from + copied;
      if (value == nullptr) {  // expired between the lookup and the fetch
        ok = false;
        return false;
      }
      const absl::Span<const Token> tokens = prompt.subspan(static_cast<size_t>(i * bt), static_cast<size_t>(bt));
      const RemoteBlockIdentity want{
          .pool = ns.pool,
          .key = keys[i],
          .has_parent = i > 0,
          .parent_key = i > 0 ? keys[i - 1] : BlockKey{},
          .digest = remote_->ValueDigest(root_key, keys[i], i > 0 ? &keys[i - 1] : nullptr, tokens),
          .layout_tag = layout_tags_[pool],
          .raw_length = raw_length};
      // Verified, authenticated and decoded into `buf`: nothing in the value is trusted
      // (remote_value.h), and exactly one block's bytes reach the pool.
      if (absl::Status s = OpenRemoteValue(*value, want, remote_->value_keys(), &opened, buf.data()); !s.ok()) {
        remote_->CountCorrupt();
        spdlog::warn("redis tier: the value for block {} of pool {} is not served ({})", keys[i].ToHex(),
                     pools_[pool].name, std::string(s.message()));
        ok = false;
        return false;
      }
      const uint8_t* src = buf.data();
      if (!arena_->WriteBlock(pool, targets[copied], src).ok()) {
        ok = false;
        return false;
      }
      ++copied;
      return true;
    });
    if (!fetched.ok() || !ok) break;
  }
  absl::MutexLock lock(&mu_);
  stats_.remote_promotions += static_cast<uint64_t>(copied);
  return copied;
}

std::vector<RecordHeader> TierStore::PeekRemoteUnits(PoolId pool, const Namespace& ns, absl::Span<const BlockKey> keys,
                                                     int64_t from, int64_t to) {
  std::vector<RecordHeader> run;
  std::vector<std::string> names;
  for (int64_t i = from; i < to; ++i) {
    names.push_back(remote_->KeyName(ns, pools_[pool].model_fingerprint, keys[i], layout_tags_[pool]));
  }
  absl::StatusOr<std::vector<std::string>> heads = remote_->Heads(names, UnitHeadBytes(ns.pool), /*lookup=*/true);
  if (!heads.ok()) return run;
  for (size_t j = 0; j < heads->size() && !(*heads)[j].empty(); ++j) {
    const int64_t i = from + static_cast<int64_t>(j);
    absl::string_view in = (*heads)[j];
    absl::StatusOr<RecordHeader> h = DecodeRecordHeader(&in);
    // Only the header's shape is checked here (it sizes the blocks allocated for the unit);
    // FetchRemoteUnits authenticates it with the bytes before any reach the pool.
    std::string why;
    if (!h.ok()) {
      why = std::string(h.status().message());
    } else if (h->kind != RecordKind::kUnit || !h->tokens.empty()) {
      why = "not a unit record";
    } else if (h->ns.pool != ns.pool || h->key != keys[i] || h->has_parent != (i > 0) ||
               (i > 0 && h->parent_key != keys[i - 1])) {
      why = "pool, key or parent key differs";
    } else if (h->layout_tag != layout_tags_[pool]) {
      why = DescribeTagMismatch(pools_[pool], h->layout_tag);
    } else if (h->raw_length <= 0 || h->raw_length != UnitRawLength(pool, h->parts)) {
      why = "its parts or length are not a unit of this pool";
    }
    if (!why.empty()) {
      remote_->CountCorrupt();
      spdlog::warn("redis tier: the value for unit {} of pool {} is not served ({})", keys[i].ToHex(),
                   pools_[pool].name, why);
      break;
    }
    run.push_back(*std::move(h));
  }
  return run;
}

int64_t TierStore::FetchRemoteUnits(PoolId pool, const Namespace& ns, absl::Span<const Token> prompt,
                                    absl::Span<const BlockKey> keys, int64_t from, absl::Span<const RecordHeader> heads,
                                    const TierPort::UnitInstall& install, size_t at) {
  const int32_t bt = pools_[pool].block_tokens;
  const BlockKey root_key = NamespaceRootKey(ns);
  std::vector<std::string> names;
  int64_t largest = 1;
  for (size_t j = 0; j < heads.size(); ++j) {
    names.push_back(remote_->KeyName(ns, pools_[pool].model_fingerprint, keys[from + static_cast<int64_t>(j)],
                                     layout_tags_[pool]));
    largest = std::max(largest, heads[j].raw_length);
  }
  std::vector<uint8_t> buf;
  std::string opened;
  int64_t written = 0;
  const size_t depth = static_cast<size_t>(std::clamp<int64_t>(kFetchWindowBytes / largest, 1, kFetchMaxDepth));
  for (size_t start = 0; start < names.size(); start += depth) {
    const std::vector<std::string> chunk(names.begin() + start, names.begin() + std::min(names.size(), start + depth));
    bool ok = true;
    const absl::Status fetched = remote_->Fetch(chunk, [&](size_t, const absl::string_view* value) {
      const size_t j = static_cast<size_t>(written);
      const int64_t i = from + written;
      if (value == nullptr) {  // expired since the lookup
        ok = false;
        return false;
      }
      const RemoteBlockIdentity want{
          .kind = RecordKind::kUnit,
          .parts = heads[j].parts,
          .pool = ns.pool,
          .key = keys[i],
          .has_parent = i > 0,
          .parent_key = i > 0 ? keys[i - 1] : BlockKey{},
          .digest = remote_->ValueDigest(root_key, keys[i], i > 0 ? &keys[i - 1] : nullptr,
                                         prompt.subspan(static_cast<size_t>(i * bt), static_cast<size_t>(bt))),
          .layout_tag = layout_tags_[pool],
          .raw_length = heads[j].raw_length};
      buf.resize(static_cast<size_t>(want.raw_length));
      // Verified, authenticated and decoded whole before a byte reaches the pool: one unit, the
      // parts its blocks were allocated for (remote_value.h).
      if (absl::Status s = OpenRemoteValue(*value, want, remote_->value_keys(), &opened, buf.data()); !s.ok()) {
        remote_->CountCorrupt();
        spdlog::warn("redis tier: the value for unit {} of pool {} is not served ({})", keys[i].ToHex(),
                     pools_[pool].name, std::string(s.message()));
        ok = false;
        return false;
      }
      if (!WriteUnitToDevice(pool, install.spine[at + j], install.parts[at + j], buf.data()).ok()) {
        ok = false;
        return false;
      }
      ++written;
      return true;
    });
    if (!fetched.ok() || !ok) break;
  }
  return written;
}

}  // namespace kvd
