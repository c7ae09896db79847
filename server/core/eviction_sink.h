// EvictionSink lets a lower tier catch blocks as they leave the device pool (G1), so that they are
// demoted (copied down) instead of dropped. KvCache calls it under its mutex, after the block has
// left the eviction order and before its index is freed: the block's bytes are still intact and
// nothing can write them. The sink must copy what it needs and return; it must not call back into
// KvCache.
#pragma once

#include <cstdint>

#include "absl/types/span.h"
#include "server/core/block_key.h"
#include "server/core/cache_types.h"
#include "server/core/types.h"

namespace kvd {

struct CachedBlock;

// A cached block as seen from outside the cache: where it is and what it holds.
struct CachedBlockView {
  PoolId pool = 0;
  BlockIndex index = 0;
  const Namespace* ns = nullptr;  // valid during the call
  BlockKey root_key;              // NamespaceRootKey(*ns)
  BlockKey key;
  BlockKey parent_key;            // zero when !has_parent
  bool has_parent = false;
  absl::Span<const Token> tokens;  // valid during the call
};

// The view of an index node. REQUIRES: `block` is in the index.
CachedBlockView ViewOf(const CachedBlock& block);

class EvictionSink {
 public:
  virtual ~EvictionSink() = default;
  // `block` is leaving the device pool for `reason` (never kClear: cleared blocks are dropped).
  virtual void OnEvict(const CachedBlockView& block, EvictReason reason) = 0;
};

// A reference to a cached block, taken by KvCache::SnapshotCached; it may be stale by the time it
// is used (the block evicted, the index reused), which KvCache::VisitCached detects by the key.
struct CachedBlockRef {
  PoolId pool = 0;
  BlockIndex index = 0;
  BlockKey key;
};

}  // namespace kvd
