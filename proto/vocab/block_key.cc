#include "proto/vocab/block_key.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
// XXH3_state_t is only complete with static linking declarations.
#define XXH_STATIC_LINKING_ONLY
#include "xxhash.h"

namespace kvd {
namespace {

constexpr size_t kOneShotTokenBytes = 1024;

void AppendField(std::string* out, const std::string& field) {
  uint64_t n = field.size();
  out->append(reinterpret_cast<const char*>(&n), sizeof(n));
  out->append(field);
}

}  // namespace

std::string BlockKey::ToHex() const { return absl::StrFormat("%016x%016x", hi, lo); }

std::string Namespace::DebugString() const {
  return absl::StrCat("{pool=", pool, " adapter=", adapter, " media=[", absl::StrJoin(media_keys, ","),
                      "] method=", method, " salted=", cache_salt.empty() ? "no" : "yes", "}");
}

BlockKey NamespaceRootKey(const Namespace& ns) {
  std::string enc;
  AppendField(&enc, ns.pool);
  AppendField(&enc, ns.adapter);
  AppendField(&enc, std::to_string(ns.media_keys.size()));
  for (const auto& m : ns.media_keys) AppendField(&enc, m);
  AppendField(&enc, ns.method);
  AppendField(&enc, ns.cache_salt);
  XXH128_hash_t h = XXH3_128bits(enc.data(), enc.size());
  return BlockKey{h.high64, h.low64};
}

BlockKey ChainBlockKey(const BlockKey& parent, const BlockKey& root, absl::Span<const Token> tokens) {
  const uint64_t head[4] = {parent.hi, parent.lo, root.hi, root.lo};
  const size_t token_bytes = tokens.size() * sizeof(Token);
  XXH128_hash_t h;
  if (token_bytes <= kOneShotTokenBytes) {
    // One pass over a contiguous copy is faster than the streaming state for typical blocks.
    alignas(64) unsigned char buf[sizeof(head) + kOneShotTokenBytes];
    std::memcpy(buf, head, sizeof(head));
    std::memcpy(buf + sizeof(head), tokens.data(), token_bytes);
    h = XXH3_128bits(buf, sizeof(head) + token_bytes);
  } else {
    XXH3_state_t state;
    XXH3_128bits_reset(&state);
    XXH3_128bits_update(&state, head, sizeof(head));
    XXH3_128bits_update(&state, tokens.data(), token_bytes);
    h = XXH3_128bits_digest(&state);
  }
  return BlockKey{h.high64, h.low64};
}

std::vector<BlockKey> ChainKeys(const Namespace& ns, absl::Span<const Token> tokens, int32_t block_tokens,
                                int64_t max_blocks) {
  const BlockKey root = NamespaceRootKey(ns);
  const int64_t n = std::min<int64_t>(max_blocks, static_cast<int64_t>(tokens.size()) / block_tokens);
  std::vector<BlockKey> keys;
  keys.reserve(static_cast<size_t>(std::max<int64_t>(n, 0)));
  BlockKey parent;
  for (int64_t i = 0; i < n; ++i) {
    parent = ChainBlockKey(parent, root, tokens.subspan(i * block_tokens, block_tokens));
    keys.push_back(parent);
  }
  return keys;
}

}  // namespace kvd
