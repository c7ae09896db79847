// CacheEvent: one change of a node's prefix index (a block stored, a block removed, everything
// cleared), as the engine records it (server/core/event_log.h) and watchers receive it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "proto/vocab/block_key.h"
#include "proto/vocab/types.h"

namespace kvd {

enum class CacheEventKind { kStored, kRemoved, kCleared };
std::string CacheEventKindName(CacheEventKind kind);

struct CacheEvent {
  uint64_t sequence = 0;  // assigned by EventLog::Append; first event is 1
  CacheEventKind kind = CacheEventKind::kStored;
  absl::Time time;
  std::string pool;        // empty for kCleared (all pools)
  std::string adapter;     // the namespace's adapter, for routers that key by LoRA
  BlockKey key;            // kStored, kRemoved
  BlockKey parent_key;     // kStored; zero for the first block of a prefix
  bool has_parent = false;
  BlockIndex block = 0;    // kStored, kRemoved
  int32_t block_tokens = 0;
  std::vector<Token> tokens;  // kStored
  // kStored: the rest of the namespace, for router block hashes (server/events/router_hash.h).
  // Internal: never sent on the WatchEvents stream.
  std::vector<std::string> media_keys;
  std::string method;
  std::string cache_salt;
  // Where the block is: empty for the device pool (G1), "disk" for blocks a warm restart reloaded
  // onto G3 (their `block` index means nothing then).
  std::string medium;
};

}  // namespace kvd
