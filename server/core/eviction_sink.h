// EvictionSink lets a lower tier catch blocks as they leave the device pool (G1), so that they are
// demoted (copied down) instead of dropped. KvCache calls it *without* its mutex, on the thread of
// the operation that evicted, before that operation returns: the block has left the index and is
// held (pinned, owned by nobody or by the request the operation handed it to, whose worker learns
// of it only when the operation returns), so its bytes are intact and nothing writes them until
// OnEvict returns. The sink copies what it needs; it must not call back into KvCache.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/types/span.h"
#include "proto/vocab/block_key.h"
#include "proto/vocab/cache_types.h"
#include "proto/vocab/types.h"

namespace kvd {

struct CachedBlock;
class PrefixIndex;

// A component of a hybrid pool's unit (docs/hybrid.md §2.9): the block of another attention
// group, or a state group's checkpoint slot, hanging off a spine node. `tail`: an End tail
// checkpoint (off the k-grid).
struct UnitComponent {
  int32_t group = 0;
  BlockIndex index = 0;
  bool tail = false;
};

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
  // A hybrid pool's spine node: the components that travel with it as one unit, in group order
  // (held like the block while the view is in use). Empty for a pool without groups.
  absl::Span<const UnitComponent> parts;
};

// The view of a node of `index` (its tokens in the pool's slab). REQUIRES: `block` is in `index`.
CachedBlockView ViewOf(const PrefixIndex& index, const CachedBlock& block);

// A block's identity and tokens, owned: a CachedBlockView that outlives the cache's mutex (the
// block itself stays held while the view is in use).
struct HeldBlock {
  PoolId pool = 0;
  BlockIndex index = 0;
  Namespace ns;
  BlockKey root_key;
  BlockKey key;
  BlockKey parent_key;
  bool has_parent = false;
  std::vector<Token> tokens;
  std::vector<UnitComponent> parts;
  EvictReason reason = EvictReason::kCapacity;  // for demotions

  explicit HeldBlock(const CachedBlockView& v)
      : pool(v.pool), index(v.index), ns(*v.ns), root_key(v.root_key), key(v.key),
        parent_key(v.parent_key), has_parent(v.has_parent), tokens(v.tokens.begin(), v.tokens.end()),
        parts(v.parts.begin(), v.parts.end()) {}
  // Valid while this HeldBlock lives.
  CachedBlockView view() const {
    return CachedBlockView{pool, index, &ns, root_key, key, parent_key, has_parent, tokens, parts};
  }
};

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
