// Block keys and namespaces of the prefix index.
//
// A Namespace is everything besides the tokens that must match for KV to be reusable: the pool
// (model), the LoRA adapter, keys of prepared media (images, audio) the prompt refers to, the
// method (e.g. a prompt-format or quantization variant) and a tenant's cache salt. Each distinct
// namespace is its own root in the index; nothing is shared between roots.
//
// Each full block is keyed by a chained 128-bit XXH3 hash:
//   key(block i) = XXH3_128(key(block i-1) || root key || tokens of block i)
// with key(block -1) = 0. The key only finds a candidate; the index also stores each block's tokens
// and its parent, and compares both, so a hash collision can never serve wrong KV.
#pragma once

#include <climits>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/hash/hash.h"
#include "absl/types/span.h"
#include "proto/vocab/types.h"

namespace kvd {

struct BlockKey {
  uint64_t hi = 0;
  uint64_t lo = 0;
  friend bool operator==(const BlockKey& a, const BlockKey& b) { return a.hi == b.hi && a.lo == b.lo; }
  friend bool operator!=(const BlockKey& a, const BlockKey& b) { return !(a == b); }
  template <typename H>
  friend H AbslHashValue(H h, const BlockKey& k) {
    return H::combine(std::move(h), k.hi, k.lo);
  }
  // 32 lowercase hex digits, hi first.
  std::string ToHex() const;
};

struct Namespace {
  std::string pool;                     // pool (model) name; required
  std::string adapter;                  // LoRA adapter name, empty for the base model
  // Prepared-media keys, in prompt order. An entry made by PositionedMediaKey also says which
  // prompt positions the item covers (what the wire's Namespace.media items become).
  std::vector<std::string> media_keys;
  std::string method;                   // engine method / variant, empty for the default
  std::string cache_salt;               // tenant isolation salt, empty for none

  friend bool operator==(const Namespace& a, const Namespace& b) {
    return a.pool == b.pool && a.adapter == b.adapter && a.media_keys == b.media_keys &&
           a.method == b.method && a.cache_salt == b.cache_salt;
  }
  template <typename H>
  friend H AbslHashValue(H h, const Namespace& n) {
    return H::combine(std::move(h), n.pool, n.adapter, n.media_keys, n.method, n.cache_salt);
  }
  // Human-readable form for logs and errors (the salt is not printed).
  std::string DebugString() const;
};

// The root key of a namespace: XXH3_128 over a length-prefixed encoding of every field, so that
// ("ab", "c") and ("a", "bc") differ.
BlockKey NamespaceRootKey(const Namespace& ns);

// The chained key of one full block.
BlockKey ChainBlockKey(const BlockKey& parent, const BlockKey& root, absl::Span<const Token> tokens);

// The chained keys of the first min(max_blocks, tokens / block_tokens) full blocks of `tokens` in
// `ns`: what the prefix index files them under. Pure: callers compute them before any lock.
std::vector<BlockKey> ChainKeys(const Namespace& ns, absl::Span<const Token> tokens, int32_t block_tokens,
                                int64_t max_blocks = INT64_MAX);

}  // namespace kvd
