// TierStore's G4 side: write-through uploads of published blocks and prefix fetches from Redis.
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

}  // namespace

void TierStore::QueueUpload(const CacheEvent& e) {
  if (e.kind != CacheEventKind::kStored || !e.medium.empty()) return;  // only blocks new in G1
  absl::StatusOr<PoolId> pool = PoolOf(e.pool);
  if (!pool.ok()) return;
  if (pools_[*pool].hybrid()) return;  // G4 stores single blocks, not units (docs/hybrid.md §2.9)
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

void TierStore::UploadQueued() {
  for (;;) {
    std::vector<Upload> batch;
    {
      absl::MutexLock lock(&upload_mu_);
      const size_t n = std::min(kUploadBatch, upload_queue_.size());
      if (n == 0) {
        upload_scheduled_ = false;
        return;
      }
      batch.assign(std::make_move_iterator(upload_queue_.begin()), std::make_move_iterator(upload_queue_.begin() + n));
      upload_queue_.erase(upload_queue_.begin(), upload_queue_.begin() + n);
    }
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
      // A shared server sees the pool and key only; what identifies the block (adapter, media,
      // method, salt, parent, tokens) travels as a keyed digest.
      ids.push_back(RemoteBlockIdentity{
          .pool = v.ns->pool,
          .key = v.key,
          .has_parent = v.has_parent,
          .parent_key = v.parent_key,
          .digest = remote_->ValueDigest(v.root_key, v.key, v.has_parent ? &v.parent_key : nullptr, v.tokens),
          .layout_tag = layout_tags_[v.pool],
          .raw_length = static_cast<int64_t>(raw.size())});
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

}  // namespace kvd
