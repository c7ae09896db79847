// Router block hashes: the block identifiers kvd puts in router events, computed the way vLLM's
// prefix cache does with `--prefix-caching-hash-algo sha256_cbor`, so that a cluster router that
// hashes prompts itself (vLLM's KV-event consumers, the llm-d KV-cache indexer) finds kvd's blocks:
//
//   root          = SHA-256(cbor(seed))                       seed: the engine's PYTHONHASHSEED
//   hash(block i) = SHA-256(cbor([hash(block i-1) or root, [tokens of block i], extra_keys]))
//   event id      = the low 64 bits of hash(block i): its last 8 bytes, big-endian
//
// with canonical CBOR (cbor2.dumps(..., canonical=True)); the chain carries the full 32-byte
// digests and only the identifier reported in events is cut to 64 bits. extra_keys is null or an
// array of text strings and [text, integer] pairs (see RouterExtraKeys).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/types/span.h"
#include "proto/vocab/block_key.h"
#include "proto/vocab/types.h"

namespace kvd {

using RouterHash = std::array<uint8_t, 32>;

// One extra key: a text string, or (with `positioned`) the pair [text, offset] vLLM gives a
// multimodal item — its identifier and its offset from the block's first position.
struct RouterExtraKey {
  std::string text;
  bool positioned = false;
  int64_t offset = 0;
  bool operator==(const RouterExtraKey& o) const {
    return text == o.text && positioned == o.positioned && offset == o.offset;
  }
};

class RouterHasher {
 public:
  explicit RouterHasher(const std::string& seed);

  const RouterHash& root() const { return root_; }
  // `parent` is nullptr for the first block of a prompt (the root is used). Empty `extra_keys`
  // encodes as null, as vLLM hashes a block without LoRA, media or salt.
  RouterHash BlockHash(const RouterHash* parent, absl::Span<const Token> tokens,
                       absl::Span<const RouterExtraKey> extra_keys) const;
  // The identifier events carry: the digest's last 8 bytes as a big-endian integer.
  static uint64_t EventId(const RouterHash& h);

 private:
  RouterHash root_;
};

// The extra keys of the block taking prompt positions [block_start, block_end), in vLLM's order
// (vllm/v1/core/kv_cache_utils.py, generate_block_hash_extra_keys, at 001cabc1be16): the LoRA
// adapter name; for each positioned media item the block overlaps (media_span.h), the pair
// (identifier, item offset - block_start); the cache salt on the first block only. Media keys
// without positions are added to every block (routers match those prompts only if they do the
// same). Then kvd's own, with no vLLM equivalent, so that namespaces a router cannot tell apart
// still get distinct identifiers: the pool's model fingerprint on the first block only (the chain
// carries it to every later block; a pool without one adds nothing), and `method` last.
std::vector<RouterExtraKey> RouterExtraKeys(const std::string& adapter, const std::vector<std::string>& media_keys,
                                            const std::string& cache_salt, const std::string& method,
                                            int64_t block_start, int64_t block_end,
                                            const std::string& model_fingerprint = "");

}  // namespace kvd
