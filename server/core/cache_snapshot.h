// CacheSnapshot: what a KvCache hands to its successor at a hot handoff (docs/operations.md,
// "Upgrading kvd"): every cached block where it lies in the pool (its bytes stay in the slab the
// successor adopts, so nothing is copied), its prefix structure and recency, and the sessions
// that protect blocks. Live requests, their reservations and checkpoints do not cross: requests
// end with the clients' KvdRestarted error and are admitted again.
//
// Plain data in the engine's vocabulary; the handoff (server/handoff.h) converts it to and from
// its wire form, and KvCache::ImportSnapshot validates every field before it changes anything.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/time/time.h"
#include "proto/vocab/block_key.h"
#include "proto/vocab/types.h"

namespace kvd {

struct CacheSnapshot {
  struct Block {
    PoolId pool = 0;
    BlockIndex index = 0;     // where its bytes lie in the pool
    int64_t parent = -1;      // position in `blocks` of the block before it; -1 for a first block
    uint32_t ns = 0;          // position in `namespaces`
    uint64_t last_use = 0;    // recency tick (nanoseconds of the engine's clock)
    bool reused = false;      // SLRU: in the main tier
    std::vector<Token> tokens;
  };
  struct Session {
    SessionId id;
    WorkerId worker;
    std::vector<int64_t> protected_blocks;  // positions in `blocks`
    absl::Time expires_at;
  };
  std::vector<Namespace> namespaces;
  std::vector<Block> blocks;  // every parent before its children
  std::vector<Session> sessions;
};

}  // namespace kvd
