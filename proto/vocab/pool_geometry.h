// PoolGeometry describes one KV layout (one model shape): how many tokens a block holds, how many
// layers, how many bytes one token takes in one layer, and how many blocks the pool has.
//
// A block is `block_tokens` tokens of KV for every layer of the pool. Its size on one device is
//   block_bytes = block_tokens * num_layers * bytes_per_token_per_layer
// and a pool spread over `num_shards` devices (a tensor-parallel group) holds that many bytes on
// each device, at the same block index. The core never touches these bytes; it only counts them.
//
// A hybrid pool (docs/hybrid.md) lists KV groups: layers of one attention kind (full, sliding
// window, chunked local) or recurrent state. Its BlockIndex space is the concatenation of the
// groups' ranges in declaration order: group g owns [first_block_g, first_block_g + capacity_g)
// (a state group's units are slots), so an index stays unique per pool and capacity_blocks is the
// sum. A pool without groups is one implicit full group of every layer, exactly as before groups.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <algorithm>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
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
inline constexpr int kMaxKvGroups = 8;
inline constexpr int32_t kDefaultStepTokens = 2048;

enum class KvGroupKind { kFull, kSlidingWindow, kChunkedLocal, kState };

// One KV group of a hybrid pool, as configured (docs/configuration.md, "KV groups") plus what
// ResolveGroups() computes. Keys that do not belong to the kind stay 0.
struct KvGroup {
  std::string name;  // [a-z0-9_-]{1,32}, unique in the pool
  KvGroupKind kind = KvGroupKind::kFull;
  std::vector<int32_t> layers;  // model layer indices, in the group's memory order
  int64_t bytes_per_token = 0;  // attention kinds: one token of one layer, one shard; 0: the pool's
  int64_t bytes_per_state = 0;  // state: one request's state in one layer, one shard; > 0
  int32_t window = 0;           // sliding_window: W, positions one token attends to, itself included
  int32_t chunk = 0;            // chunked_local: C, a multiple of block_tokens
  int32_t checkpoint_every_blocks = 0;  // state: k, required
  bool checkpoint_at_end = true;        // state: End may store the state at the last full block
  // Units of the group: blocks (attention) or slots (state). 0 in a config: a share of the pool's
  // capacity_bytes (the default split, docs/hybrid.md §2.3); ResolveGroups() fills it.
  int64_t capacity = 0;
  // Computed by ResolveGroups(): the group's first pool-wide index, and its region's offset in
  // the slab of each shard (a multiple of 2 MiB).
  int64_t first_block = 0;
  int64_t region_offset_bytes = 0;

  bool attention() const { return kind != KvGroupKind::kState; }
};

// "full", "sliding_window", "chunked_local", "state".
std::string KvGroupKindName(KvGroupKind kind);
// False for a name that is none of the four.
bool ParseKvGroupKind(absl::string_view name, KvGroupKind* kind);
// One entry of a group's `layers`: "7", "0-3" (both ends included) or "1-35/2" (every second).
// INVALID_ARGUMENT saying what is wrong with `spec`.
absl::StatusOr<std::vector<int32_t>> ParseLayerSpec(absl::string_view spec);
// The shortest list of entries ParseLayerSpec reads back as `layers`, in order ("0-34/2", "7").
std::vector<std::string> FormatLayers(const std::vector<int32_t>& layers);

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
  // KV groups (docs/hybrid.md); empty: one implicit full group of every layer (today's pool).
  // A hybrid pool's capacity_blocks is the groups' sum, set by ResolveGroups().
  std::vector<KvGroup> groups;
  // Hybrid pools: bytes per shard that ResolveGroups() splits over the groups without a capacity
  // (docs/hybrid.md §2.3); 0: every group names its capacity. Refused on a pool without groups.
  int64_t capacity_bytes = 0;
  // Most tokens one request computes between two reports; 0: min(2048, max_model_len). The
  // window and chunk reservations grow with it (docs/hybrid.md §2.5).
  int32_t step_tokens = 0;

  bool hybrid() const { return !groups.empty(); }
  int32_t step_tokens_or_default() const {
    return step_tokens != 0 ? step_tokens : std::min(kDefaultStepTokens, max_model_len);
  }
  // The group holding pool-wide index `index` (0 for a pool without groups), or -1 past the end.
  int GroupOf(int64_t index) const;
  // Bytes of one unit of group g in one layer, one shard: block_tokens * bytes_per_token for
  // attention, bytes_per_state for state. REQUIRES: hybrid(), 0 <= g < groups.size().
  int64_t GroupLayerUnitBytes(int g) const;
  // Bytes of one unit of group g across its layers, one shard.
  int64_t GroupUnitBytes(int g) const { return GroupLayerUnitBytes(g) * static_cast<int64_t>(groups[g].layers.size()); }
  // Bytes of group g's region (before alignment), one shard.
  int64_t GroupRegionBytes(int g) const { return GroupUnitBytes(g) * groups[g].capacity; }
  // Units group g must hold for one request of max_model_len tokens (docs/hybrid.md §2.5), and
  // for one of `tokens` tokens.
  int64_t GroupUnitsFor(int g, int64_t tokens) const;

  // Checks the groups (docs/hybrid.md §2.1, rules 1-8), splits capacity_bytes over the groups
  // without a capacity, and computes first_block, region_offset_bytes and capacity_blocks.
  // INVALID_ARGUMENT naming "groups[j].<field>" (or the pool's field), its value and what is
  // allowed. A no-op for a pool without groups, except that capacity_bytes is refused there.
  absl::Status ResolveGroups();

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

// The attach check of a worker's declared groups (Hello.expect_pools[].groups): as many as the
// pool's, in order, each with the same name and kind, and every field the worker sets (non-empty
// layers, non-zero numbers) equal. FAILED_PRECONDITION naming the pool, the group, the field and
// both values. A hybrid pool refuses a worker that declares none (it would index the slab as one
// group); a pool without groups refuses a worker that declares some.
absl::Status CheckExpectedGroups(const PoolGeometry& pool, const std::vector<KvGroup>& expected);

std::string PoolLayoutName(PoolLayout layout);
// "ipc" or "vmm".
std::string PoolAllocatorName(PoolAllocator allocator);

}  // namespace kvd
