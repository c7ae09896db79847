// The msgpack payload of one router-event batch, in the formats vLLM's ZmqEventPublisher and its
// consumers use (router_event_publisher.h has the socket side). Field order and names follow
// vLLM's vllm/distributed/kv_events.py (KVEventBatch, BlockStored, BlockRemoved,
// AllBlocksCleared) read at commit 0181ea3173e53eea8cf04a86891488e3dc89bb34:
//
//   BlockStored   block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
//                 lora_name, extra_keys = None, group_idx = None, kv_cache_spec_kind = None,
//                 kv_cache_spec_sliding_window = None
//   BlockRemoved  block_hashes, medium, group_idx = None
//
// Format "vllm" writes each event as an array led by its type name (msgspec array_like with
// tag=True, which writes every field, defaults included: msgspec issue #720), "vllm-map" as a
// map with the class name under "type" (omit_defaults: a field left at its default is left out).
// An event without a group (every event of a pool without KV groups) stops after lora_name /
// medium, exactly as before hybrid pools existed, so those streams are unchanged byte for byte.
// An event with a group (a hybrid pool's, docs/hybrid.md §2.9) adds extra_keys (nil: kvd's
// extra keys are already in its ids), group_idx, kv_cache_spec_kind and
// kv_cache_spec_sliding_window (nil unless the group has a window), so that llm-d's indexer,
// which decodes arrays by position ([9] group_idx, [10] kind, [11] window; BlockRemoved [3]
// group_idx: pkg/kvevents/engineadapter/vllm_adapter.go at llm-d/llm-d-kv-cache
// 7be76e119ca50c5700b3bca65a19b6a0218a9b62), finds them where vLLM puts them.
// Pure functions; thread-compatible.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "proto/vocab/cache_event.h"
#include "proto/vocab/types.h"

namespace kvd {

// The KV group of an event's blocks (vLLM's KV cache group), for hybrid pools.
struct RouterEventGroup {
  int32_t index = 0;           // group_idx: the group's place in the pool's declaration order
  std::string kind;            // kv_cache_spec_kind, in vLLM's words: "full_attention", ...
  int32_t sliding_window = 0;  // kv_cache_spec_sliding_window; 0: the group has none (nil)
  bool operator==(const RouterEventGroup& o) const {
    return index == o.index && kind == o.kind && sliding_window == o.sliding_window;
  }
};

// One router event as it goes on the wire.
struct RouterEvent {
  CacheEventKind kind = CacheEventKind::kStored;
  std::string medium;          // kStored, kRemoved
  std::vector<uint64_t> ids;   // kStored, kRemoved: block ids (router_hash.h)
  bool has_parent = false;     // kStored
  uint64_t parent_id = 0;      // kStored, when has_parent
  std::vector<Token> tokens;   // kStored: every block's tokens, in order
  int32_t block_size = 0;      // kStored
  std::string lora_name;       // kStored: the adapter; empty (nil) for the base model
  std::optional<RouterEventGroup> group;  // kStored, kRemoved: set on hybrid pools only
};

// vLLM's kv_cache_spec_kind for a kvd group kind (KvGroupKindName's words): full ->
// "full_attention", sliding_window -> "sliding_window", chunked_local ->
// "chunked_local_attention", state -> "mamba" (the kinds llm-d's pkg/kvevents/events.go lists at
// 7be76e11). Empty for any other word.
std::string RouterSpecKind(const std::string& kvd_kind);

// The payload [ts, [events], data_parallel_rank] (or its map form with `map`).
std::string EncodeRouterBatch(double ts, const std::vector<RouterEvent>& events, int64_t data_parallel_rank,
                              bool map);

}  // namespace kvd
