// PoolGeometry describes one KV layout (one model shape): how many tokens a block holds, how many
// layers, how many bytes one token takes in one layer, and how many blocks the pool has.
//
// A block is `block_tokens` tokens of KV for every layer of the pool. Its size on one device is
//   block_bytes = block_tokens * num_layers * bytes_per_token_per_layer
// and a pool spread over `num_shards` devices (a tensor-parallel group) holds that many bytes on
// each device, at the same block index. The core never touches these bytes; it only counts them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "proto/vocab/kv_format.h"

namespace kvd {

// How a pool's bytes are arranged in its slab; see gpu/slab_layout.h for the byte offsets.
enum class PoolLayout {
  kLayerMajor,  // each layer's blocks form one contiguous array [num_blocks][layer block bytes]
  kBlockMajor,  // each block is contiguous across its layers
};

// How the CUDA backend allocates a pool's slabs (the host backend ignores it; see
// gpu/cuda_arena.h): kIpc, cudaMalloc shared through CUDA IPC handles; kVmm, the driver's
// virtual-memory API with a POSIX-fd shareable handle, passable over a Unix socket so the memory
// can outlive kvd's process and cross a hot handoff.
enum class PoolAllocator { kIpc, kVmm };

inline constexpr size_t kMaxModelFingerprintBytes = 256;

struct PoolGeometry {
  std::string name;                    // pool (model) name, unique per daemon; required
  int32_t block_tokens = 16;           // tokens per block; (0, 4096]
  int32_t num_layers = 32;             // transformer layers; > 0
  int64_t bytes_per_token_per_layer = 4096;  // K and V of one token in one layer, one shard; > 0
  int64_t capacity_blocks = 1024;      // blocks in the pool; > 0
  int32_t max_model_len = 131072;      // position limit: no request may exceed it; >= block_tokens
  int32_t num_shards = 1;              // devices holding the pool (tensor parallel); > 0
  // CUDA device ordinal of each shard; empty means shard i on device i. Size num_shards if set.
  std::vector<int32_t> devices;
  PoolLayout layout = PoolLayout::kLayerMajor;
  KvFormat kv;  // what the bytes mean (dtype, heads, arrangement); optional, see kv_format.h
  PoolAllocator allocator = PoolAllocator::kIpc;
  // Which model (weights and whatever else decides the KV's values) the pool's bytes belong to, as
  // the operator names it: say "llama-3.1-8b-instruct@5206a32". Part of everything that identifies
  // a block outside this process (tier records and Redis keys, router event hashes, peer offers)
  // and of a worker's expectation, so that KV of other weights is never served. Empty (default):
  // the pool is identified by name and shape alone, as before fingerprints, and shares KV with any
  // pool of the same name and shape. At most kMaxModelFingerprintBytes of printable ASCII, no
  // spaces.
  std::string model_fingerprint;

  // Bytes of one block on one shard (one device).
  int64_t block_bytes() const { return int64_t{block_tokens} * num_layers * bytes_per_token_per_layer; }
  // Bytes of one block across all shards: what the KV budget is charged per block.
  int64_t block_bytes_all_shards() const { return block_bytes() * num_shards; }
  // Bytes of one layer of one block on one shard.
  int64_t layer_block_bytes() const { return int64_t{block_tokens} * bytes_per_token_per_layer; }
  // Blocks needed to hold `tokens` tokens.
  int64_t BlocksFor(int64_t tokens) const { return (tokens + block_tokens - 1) / block_tokens; }

  // INVALID_ARGUMENT naming the first field out of range.
  absl::Status Validate() const;
};

// OK for an empty or well-formed model fingerprint; INVALID_ARGUMENT saying what is wrong (not
// naming a pool: callers add where it came from).
absl::Status CheckModelFingerprint(const std::string& fingerprint);

std::string PoolLayoutName(PoolLayout layout);
// "ipc" or "vmm".
std::string PoolAllocatorName(PoolAllocator allocator);

}  // namespace kvd
