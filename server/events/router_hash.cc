#include "server/events/router_hash.h"

#include <openssl/sha.h>

#include <optional>

#include "proto/vocab/media_span.h"
#include "server/events/cbor_writer.h"

namespace kvd {
namespace {

RouterHash Sha256(const std::string& bytes) {
  RouterHash h;
  SHA256(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size(), h.data());
  return h;
}

}  // namespace

RouterHasher::RouterHasher(const std::string& seed) {
  CborWriter w;
  w.Text(seed);
  root_ = Sha256(w.data());
}

RouterHash RouterHasher::BlockHash(const RouterHash* parent, absl::Span<const Token> tokens,
                                   absl::Span<const RouterExtraKey> extra_keys) const {
  CborWriter w;
  w.Array(3);
  w.Bytes(parent != nullptr ? *parent : root_);
  w.Array(tokens.size());
  for (Token t : tokens) w.Uint(t);
  if (extra_keys.empty()) {
    w.Null();
  } else {
    w.Array(extra_keys.size());
    for (const RouterExtraKey& k : extra_keys) {
      if (k.positioned) {
        w.Array(2);
        w.Text(k.text);
        w.Int(k.offset);
      } else {
        w.Text(k.text);
      }
    }
  }
  return Sha256(w.data());
}

uint64_t RouterHasher::EventId(const RouterHash& h) {
  uint64_t v = 0;
  for (size_t i = h.size() - 8; i < h.size(); ++i) v = (v << 8) | h[i];
  return v;
}

std::vector<RouterExtraKey> RouterExtraKeys(const std::string& adapter, const std::vector<std::string>& media_keys,
                                            const std::string& cache_salt, const std::string& method,
                                            int64_t block_start, int64_t block_end,
                                            const std::string& model_fingerprint) {
  std::vector<RouterExtraKey> keys;
  if (!adapter.empty()) keys.push_back({adapter});
  for (const std::string& m : media_keys) {
    if (std::optional<MediaSpan> span = ParsePositionedMediaKey(m)) {
      if (span->Overlaps(block_start, block_end)) keys.push_back({span->identifier, true, span->offset - block_start});
    } else {
      keys.push_back({m});
    }
  }
  if (block_start == 0 && !cache_salt.empty()) keys.push_back({cache_salt});
  if (block_start == 0 && !model_fingerprint.empty()) keys.push_back({model_fingerprint});
  if (!method.empty()) keys.push_back({method});
  return keys;
}

}  // namespace kvd
