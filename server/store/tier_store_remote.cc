// TierStore's G4 side: write-through uploads of published blocks and prefix fetches from Redis.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "server/store/tier_store.h"
#include "spdlog/spdlog.h"

namespace kvd {
namespace {

constexpr size_t kUploadBatch = 64;  // blocks per pipeline
constexpr size_t kFetchBatch = 32;   // values per pipelined GET round trip (bounds memory)

}  // namespace

void TierStore::QueueUpload(const CacheEvent& e) {
  if (e.kind != CacheEventKind::kStored || !e.medium.empty()) return;  // only blocks new in G1
  absl::StatusOr<PoolId> pool = PoolOf(e.pool);
  if (!pool.ok()) return;
  {
    absl::MutexLock lock(&upload_mu_);
    if (static_cast<int64_t>(upload_queue_.size()) >= options_.remote.max_pending_uploads) {
      remote_->CountUploadDropped(1);
      return;
    }
    upload_queue_.push_back(CachedBlockRef{*pool, e.block, e.key});
    if (upload_scheduled_) return;
    upload_scheduled_ = true;
  }
  uploader_->Submit([this] { UploadQueued(); });
}

void TierStore::UploadQueued() {
  for (;;) {
    std::vector<CachedBlockRef> refs;
    {
      absl::MutexLock lock(&upload_mu_);
      const size_t n = std::min(kUploadBatch, upload_queue_.size());
      if (n == 0) {
        upload_scheduled_ = false;
        return;
      }
      refs.assign(upload_queue_.begin(), upload_queue_.begin() + n);
      upload_queue_.erase(upload_queue_.begin(), upload_queue_.begin() + n);
    }
    if (!remote_->available()) {  // skip, do not queue up behind a failing server
      remote_->CountUploadDropped(refs.size());
      continue;
    }
    // Copy each still-cached block out under the cache lock (as a flush does), encode outside it.
    std::vector<RecordHeader> headers;
    std::vector<std::string> raws;
    std::vector<std::string> names;
    cache_->VisitCached(refs, [&](const CachedBlockView& v) {
      std::string raw(static_cast<size_t>(pools_[v.pool].block_bytes_all_shards()), '\0');
      if (!arena_->ReadBlock(v.pool, v.index, reinterpret_cast<uint8_t*>(raw.data())).ok()) return;
      headers.push_back(BlockHeader(v));
      names.push_back(remote_->KeyName(*v.ns, v.key));
      raws.push_back(std::move(raw));
    });
    if (headers.size() < refs.size()) remote_->CountUploadDropped(refs.size() - headers.size());
    std::vector<std::pair<std::string, std::string>> items;
    items.reserve(headers.size());
    for (size_t i = 0; i < headers.size(); ++i) {
      RecordHeader& h = headers[i];
      std::string stored;
      h.codec = Compress(options_.codec,
                         absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(raws[i].data()), raws[i].size()),
                         &stored);
      if (h.codec == Codec::kNone) stored = std::move(raws[i]);
      h.stored_length = static_cast<int64_t>(stored.size());
      h.checksum = Checksum(stored.data(), stored.size());
      std::string value;
      EncodeRecordHeader(h, &value);
      value += stored;
      items.emplace_back(std::move(names[i]), std::move(value));
    }
    (void)remote_->Store(items);  // failures are counted and start the back-off
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
  names.resize(static_cast<size_t>(*run));
  std::vector<uint8_t> buf(static_cast<size_t>(raw_length));
  int64_t copied = 0;
  for (size_t start = 0; start < names.size(); start += kFetchBatch) {
    const std::vector<std::string> chunk(names.begin() + start,
                                         names.begin() + std::min(names.size(), start + kFetchBatch));
    absl::StatusOr<std::vector<std::optional<std::string>>> values = remote_->Fetch(chunk);
    if (!values.ok()) return copied;
    for (const std::optional<std::string>& value : *values) {
      const int64_t i = from + copied;
      if (!value.has_value()) return copied;  // expired between the lookup and the fetch
      absl::string_view in(*value);
      absl::StatusOr<RecordHeader> h = DecodeRecordHeader(&in);
      const absl::Span<const Token> tokens = prompt.subspan(static_cast<size_t>(i * bt), static_cast<size_t>(bt));
      const bool valid =
          h.ok() && h->kind == RecordKind::kBlock && h->key == keys[i] && h->ns == ns &&
          h->has_parent == (i > 0) && (i == 0 || h->parent_key == keys[i - 1]) &&
          std::equal(h->tokens.begin(), h->tokens.end(), tokens.begin(), tokens.end()) &&
          h->layout_tag == layout_tags_[pool] && h->raw_length == raw_length &&
          static_cast<int64_t>(in.size()) == h->stored_length && Checksum(in.data(), in.size()) == h->checksum &&
          Decompress(h->codec, absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(in.data()), in.size()),
                     buf.data(), raw_length)
              .ok();
      if (!valid) {
        remote_->CountCorrupt();
        spdlog::warn("redis tier: the record for block {} of pool {} failed verification; not served",
                     keys[i].ToHex(), pools_[pool].name);
        return copied;
      }
      if (!arena_->WriteBlock(pool, targets[copied], buf.data()).ok()) return copied;
      ++copied;
    }
  }
  absl::MutexLock lock(&mu_);
  stats_.remote_promotions += static_cast<uint64_t>(copied);
  return copied;
}

}  // namespace kvd
