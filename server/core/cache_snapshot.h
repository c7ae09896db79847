// CacheSnapshot: what a KvCache hands to its successor at a hot handoff (docs/operations.md,
// "Upgrading kvd"): every cached block where it lies in the pool (its bytes stay in the slab the
// successor adopts, so nothing is copied), its prefix structure and recency, and the sessions
// that protect blocks, and the checkpoints of interrupted requests (a request live at the handoff
// ends as interrupted first, so its latest checkpoint crosses and resumes it on the successor).
// Live requests and their reservations do not cross: they end with the clients' KvdRestarted
// error and are admitted again. What their workers may still be writing does cross, as fences:
// the blocks each live request owned, by its worker's pid, held by the successor until that
// process re-attaches having quiesced, dies, or a lease TTL has passed (docs/security.md).
//
// Plain data in the engine's vocabulary; the handoff (server/handoff.h) converts it to and from
// its wire form.
//
// KvCache::ExportSnapshot: every cached block with its structure and recency, the sessions, and
// the checkpoints of interrupted requests (end live requests first: theirs are not exported).
// O(cache size) under the engine's mutex: called only once the daemon serves nothing (the handoff
// has shut its gRPC server down), so no caller waits behind the scan.
//
// A hybrid pool's nodes carry their components and its checkpoints their per-group units: the
// successor serves the same hits (§2.6) and resumes the same generations. On import a component
// that does not fit its group (range, another use) is refused like a block; a state checkpoint
// whose window is not all there is dropped, and the units' rules (U2-U4) then drop what no hit can
// serve, so the successor's checker passes. Fences are charged per group.
//
// KvCache::ImportSnapshot: re-creates a snapshot, each block at its index (its bytes are in the
// adopted slab), recency and SLRU tiers kept, checkpoints resumable as before (within this
// configuration's checkpoint budgets; one that does not fit is dropped); listeners hear each block
// as stored. Returns the blocks indexed. FAILED_PRECONDITION unless the cache holds nothing yet
// (no block, request, session or checkpoint); INVALID_ARGUMENT naming the first field that does
// not fit this cache's pools (pool, index, token count, parent order, namespace, a checkpoint's
// blocks): nothing changes then. A snapshot's fences are kept (until their time) and a cache
// that holds a fence already refuses it too.
//
// Fences (kv_cache_fences.cc; docs/security.md, "Leases and fencing"). A fence is owned by an
// attachment (a worker id, unique across kvd processes) of one process (the kernel's pid), and
// its deadline is a reading of the engine's clock (monotonic: a wall-clock step moves no fence);
// callers pass durations, and a snapshot carries what is left of each.
// - EndAllFenced(ttl, pids): ends every live request as interrupted (checkpoints kept, as
//   Release does) and fences the blocks each owned and every worker's credit, which their
//   writers may still write, for `ttl`, owned by the worker's attachment and its pid in `pids`
//   (0 when absent). Returns the requests ended. For a daemon that stops serving.
// - FenceWorker(worker, pid, ttl): the same for one worker whose attach stream broke while its
//   lease was held (it may still be writing, and quiesces only after it notices). Returns the
//   requests ended.
// - FenceFreeBlocks(ttl): fences, for no owner, every free block of every pool and the tail of
//   every orphaned checkpoint (its blocks from the one its last token is in: a writer of the
//   ended request may be writing past the checkpoint there): a start on memory whose writers are
//   unknown (a crashed kvd's slabs, a failed handoff's, a predecessor that predates fences).
//   `ttl` is the lease its old workers were promised. Returns the blocks.
// - LiftFences(attachment, pid): hands on the blocks fenced for that attachment of that process
//   (it re-attached having quiesced); another attachment of the same process lifts nothing.
//   LiftFencesOfGone(pid): those of every attachment of `pid` (the process is gone). Both return
//   the blocks. ExpireFences(): lifts those past their time; returns the blocks still fenced.
//   FencedPids(): the pids blocks are fenced for (never 0).
#pragma once

#include <cstdint>
#include <optional>
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
    // Hybrid pools with a full group (docs/hybrid.md §2.9): per KV group of the pool, the node's
    // component (a window group's block, a state group's checkpoint slot holding the state at
    // exactly the node's end), kNoComponent for none and for the spine group itself; bit g of
    // `tail_checkpoints`: state group g's is an End's tail. Empty for other pools.
    std::vector<BlockIndex> components;
    uint32_t tail_checkpoints = 0;
  };
  static constexpr BlockIndex kNoComponent = 0xFFFFFFFFu;
  struct Session {
    SessionId id;
    WorkerId worker;
    std::vector<int64_t> protected_blocks;  // positions in `blocks`
    absl::Time expires_at;
    std::optional<std::string> salt;  // the tenant it belongs to (cache_salt)
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
    // Hybrid pools: per KV group (the spine group's entry empty: `blocks` is its table), a window
    // group's blocks from block position `first` on (cached[i]: a node's component in `blocks`,
    // else the checkpoint's own), or a state group's slot (always its own). Empty otherwise.
    struct Group {
      int64_t first = 0;
      std::vector<BlockIndex> blocks;
      std::vector<bool> cached;
      BlockIndex slot = kNoComponent;
    };
    std::vector<Group> groups;
  };
  // Blocks a request live at the handoff owned: its writer may still write them.
  // A block may be in several fences (each holds it until lifted).
  struct Fence {
    uint32_t pid = 0;                // the writer's process (kernel's word); 0: unknown
    WorkerId attachment;             // the writer's attachment; empty: unknown
    PoolId pool = 0;
    std::vector<BlockIndex> blocks;  // each also in a checkpoint's own blocks, or else free
    absl::Duration remaining;        // handed on this long after the import at the latest
  };
  std::vector<Namespace> namespaces;
  std::vector<Block> blocks;  // every parent before its children
  std::vector<Session> sessions;
  std::vector<Checkpoint> checkpoints;
  std::vector<Fence> fences;
  // False from a predecessor that predates fences: its live requests' blocks are unknown, so the
  // successor fences every free block for a lease TTL instead.
  bool fences_known = false;
  // The lease TTL the predecessor's workers were promised; zero when it did not say.
  absl::Duration lease_ttl;
};

}  // namespace kvd
