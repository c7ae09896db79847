// CacheSnapshot: what a KvCache hands to its successor at a hot handoff (docs/operations.md,
// "Upgrading kvd"): every cached block where it lies in the pool (its bytes stay in the slab the
// successor adopts, so nothing is copied), its prefix structure and recency, and the sessions
// that protect blocks, and the checkpoints of interrupted requests (a request live at the handoff
// ends as interrupted first, so its latest checkpoint crosses and resumes it on the successor).
// Live requests and their reservations do not cross: they end with the clients' KvdRestarted
// error and are admitted again.
//
// Plain data in the engine's vocabulary; the handoff (server/handoff.h) converts it to and from
// its wire form, and KvCache::ImportSnapshot validates every field before it changes anything.
#pragma once

#include <cstdint>
#include <string>
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
  struct Checkpoint {
    RequestId id;
    uint32_t ns = 0;                    // position in `namespaces`
    std::vector<Token> tokens;
    std::string engine_state;
    std::vector<BlockIndex> blocks;     // the checkpoint's block table
    std::vector<int64_t> cached;        // per block: its position in `blocks` when cached, else -1
                                        // (owned by the checkpoint alone)
    absl::Time expires_at;
  };
  std::vector<Namespace> namespaces;
  std::vector<Block> blocks;  // every parent before its children
  std::vector<Session> sessions;
  std::vector<Checkpoint> checkpoints;
};

}  // namespace kvd
