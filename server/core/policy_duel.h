// PolicyDuel decides, for one pool under the horizon policy, which of two eviction orders the
// pool follows now: SLRU's recency order or the reuse-horizon order (eviction_queue.h). It runs
// both as miniature shadow caches over a fixed sample of block keys (one key in `sample_every`,
// chosen by hash, so every shadow sees the same keys) with 1/sample_every of the pool's capacity
// each, counts the hits each shadow would have had with exponential decay, and answers the order
// whose shadow hits more (by a margin: the recency order is SLRU's, the safer default). Each
// shadow is an EvictionQueue in its order over stand-in nodes (keys only: no tokens, no prefix
// structure), at most kMaxShadowKeys of them (a big pool samples more sparsely; ~2 MB a pool), so
// a shadow costs a few ordered-map operations per sampled block.
//
// Thread-compatible: KvCache calls it under its mutex. It never touches block data.
#pragma once

#include <cstdint>

#include "absl/container/node_hash_map.h"
#include "proto/vocab/block_key.h"
#include "server/core/eviction_queue.h"

namespace kvd {

class PolicyDuel {
 public:
  struct Options {
    int64_t capacity_blocks = 0;    // the pool's blocks
    int64_t probation_horizon = 0;  // as EvictionQueue::set_horizons, in the pool's store clock
    int64_t main_horizon = 0;
    double main_share = 0.5;        // the recency shadow's SLRU share
    int64_t sample_every = 32;      // one key in this many (at least capacity / kMaxShadowKeys)
    // Scores decay by 1 - 1/(memory × shadow capacity) per sampled access: they weigh about the
    // last `memory` shadow-fulls of accesses, the same span of the pool's traffic at any size.
    double memory = 4;
    double margin = 1.1;            // horizon wins when its score exceeds recency's × margin
  };
  static constexpr int64_t kMaxShadowKeys = 8192;
  explicit PolicyDuel(const Options& options);

  // Records one use of `key` at store clock `clock`: a hit when the block was cached, else a
  // store; `reused` says whether the pool files it as reused (SLRU's main tier). Sampled keys
  // only; others return at once.
  void Access(const BlockKey& key, bool reused, uint64_t clock);
  // kHorizon when its shadow's score exceeds the recency shadow's by the margin, else kRecency.
  EvictionQueue::Order preferred() const {
    return shadows_[1].score > options_.margin * shadows_[0].score ? EvictionQueue::Order::kHorizon
                                                 : EvictionQueue::Order::kRecency;
  }
  double score(EvictionQueue::Order order) const { return shadows_[static_cast<int>(order)].score; }
  // Keys are XXH3 hashes: one in sample_every falls below the threshold (a compare, no division).
  bool Sampled(const BlockKey& key) const { return key.lo <= threshold_; }

 private:
  // A shadow is an EvictionQueue in one order over stand-in nodes for its keys (no parent, no
  // tokens), so it evicts by exactly the rules the pool would follow.
  struct Shadow {
    EvictionQueue queue;
    absl::node_hash_map<BlockKey, CachedBlock> blocks;  // stable addresses: the queue holds them
    double score = 0;
  };
  void Touch(Shadow& shadow, const BlockKey& key, bool reused, uint64_t clock);

  Options options_;
  int64_t capacity_;
  uint64_t threshold_;
  double decay_;
  uint64_t serial_ = 0;
  Shadow shadows_[2];
};

}  // namespace kvd
