// TierStore's G4 side: write-through uploads of published blocks and prefix fetches from Redis.
#include <algorithm>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
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
  Namespace ns;
  ns.pool = e.pool;
  ns.adapter = e.adapter;
  ns.media_keys = e.media_keys;
  ns.method = e.method;
  ns.cache_salt = e.cache_salt;
  Upload upload{CachedBlockRef{*pool, e.block, e.key}, remote_->KeyName(ns, e.key)};
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
    // Copy each still-cached block out under the cache lock (as a flush does) straight into its
    // value (header + stored bytes), compressing outside the lock.
    std::vector<RecordHeader> headers;
    std::vector<std::string> raws;
    std::vector<std::string> keys;
    cache_->VisitCached(refs, [&](const CachedBlockView& v) {
      std::string raw(static_cast<size_t>(pools_[v.pool].block_bytes_all_shards()), '\0');
      if (!arena_->ReadBlock(v.pool, v.index, reinterpret_cast<uint8_t*>(raw.data())).ok()) return;
      // Sealed for a shared server: the value names its pool and key only; what identifies the
      // block (adapter, media, method, salt, parent, tokens) travels as a keyed digest.
      RecordHeader h = BlockHeader(v);
      h.object_key = remote_->ValueDigest(v.root_key, v.key, v.has_parent ? &v.parent_key : nullptr, v.tokens);
      h.ns = Namespace{.pool = v.ns->pool};
      h.tokens.clear();
      headers.push_back(std::move(h));
      keys.push_back(name_of[v.key]);
      raws.push_back(std::move(raw));
    });
    if (headers.size() < refs.size()) remote_->CountUploadDropped(refs.size() - headers.size());
    std::vector<std::pair<std::string, std::string>> items;
    items.reserve(headers.size());
    std::string compressed;
    for (size_t i = 0; i < headers.size(); ++i) {
      RecordHeader& h = headers[i];
      const std::string& raw = raws[i];
      h.codec = Compress(options_.codec, absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(raw.data()), raw.size()),
                         &compressed);
      std::string sealed;
      const std::string* stored_ptr = h.codec == Codec::kNone ? &raw : &compressed;
      if (const ValueCipher* cipher = remote_->cipher(); cipher != nullptr) {
        // Encrypted after compression, bound to the value's identity digest; the key id rides in
        // the header ("<digest>:<key id>") so keys can rotate.
        absl::StatusOr<std::string> s = cipher->Seal(*stored_ptr, h.object_key);
        if (!s.ok()) {
          remote_->CountUploadDropped(1);
          continue;
        }
        sealed = *std::move(s);
        stored_ptr = &sealed;
        h.object_key = absl::StrCat(h.object_key, ":", cipher->sealing_key_id());
      }
      const std::string& stored = *stored_ptr;
      h.stored_length = static_cast<int64_t>(stored.size());
      h.checksum = Checksum(stored.data(), stored.size());
      std::string value;
      EncodeRecordHeader(h, &value);
      value += stored;
      items.emplace_back(std::move(keys[i]), std::move(value));
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
  for (size_t i = 0; i < targets.size(); ++i) names.push_back(remote_->KeyName(ns, keys[from + i]));
  absl::StatusOr<int64_t> run = remote_->RunLength(names);
  if (!run.ok() || *run == 0) return 0;
  const BlockKey root_key = NamespaceRootKey(ns);
  names.resize(static_cast<size_t>(*run));
  std::vector<uint8_t> buf(static_cast<size_t>(raw_length));
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
      absl::string_view in = *value;
      absl::StatusOr<RecordHeader> h = DecodeRecordHeader(&in);
      const absl::Span<const Token> tokens = prompt.subspan(static_cast<size_t>(i * bt), static_cast<size_t>(bt));
      // object_key: "<digest>" or, encrypted, "<digest>:<key id>".
      const std::string digest = remote_->ValueDigest(root_key, keys[i], i > 0 ? &keys[i - 1] : nullptr, tokens);
      absl::string_view key_id;
      bool digest_ok = false;
      if (h.ok()) {
        absl::string_view rest = h->object_key;
        digest_ok = absl::ConsumePrefix(&rest, digest) && (rest.empty() || (rest[0] == ':' && rest.size() > 1));
        if (digest_ok && !rest.empty()) key_id = rest.substr(1);
      }
      const bool valid =
          h.ok() && h->kind == RecordKind::kBlock && h->key == keys[i] && h->ns.pool == ns.pool &&
          h->has_parent == (i > 0) && (i == 0 || h->parent_key == keys[i - 1]) && h->tokens.empty() && digest_ok &&
          h->layout_tag == layout_tags_[pool] && h->raw_length == raw_length &&
          static_cast<int64_t>(in.size()) == h->stored_length && Checksum(in.data(), in.size()) == h->checksum;
      if (!valid) {
        remote_->CountCorrupt();
        spdlog::warn("redis tier: the record for block {} of pool {} failed verification; not served",
                     keys[i].ToHex(), pools_[pool].name);
        ok = false;
        return false;
      }
      // Encrypted values are opened first (authenticated against the digest).
      std::string opened;
      if (!key_id.empty()) {
        absl::StatusOr<std::string> o = remote_->cipher() != nullptr
                                            ? remote_->cipher()->Open(key_id, in, digest)
                                            : absl::DataLossError("encrypted, and no tiers.redis_encryption_key_file");
        if (!o.ok()) {
          remote_->CountCorrupt();
          spdlog::warn("redis tier: block {} of pool {} could not be decrypted ({}); not served", keys[i].ToHex(),
                       pools_[pool].name, std::string(o.status().message()));
          ok = false;
          return false;
        }
        opened = *std::move(o);
        in = opened;
      }
      // Uncompressed values go straight into the pool; others are decoded into `buf` first.
      const uint8_t* src = reinterpret_cast<const uint8_t*>(in.data());
      if (h->codec != Codec::kNone) {
        if (!Decompress(h->codec, absl::MakeConstSpan(src, in.size()), buf.data(), raw_length).ok()) {
          remote_->CountCorrupt();
          ok = false;
          return false;
        }
        src = buf.data();
      }
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
