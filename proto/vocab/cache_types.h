// Values passed to and returned by KvCache: request specs, acquire and publish results, handles
// and the report. Plain structs; no behaviour.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "proto/vocab/block_key.h"
#include "proto/vocab/pressure_level.h"
#include "proto/vocab/types.h"

namespace kvd {

// One generation as admitted.
struct RequestSpec {
  RequestId id;                 // unique among live requests; 1..256 bytes
  Namespace ns;                 // ns.pool names the pool
  std::vector<Token> prompt;    // at least one token
  int64_t max_new_tokens = 0;   // tokens the request may generate; >= 0
  SessionId session;            // optional conversation id
  RequestId resume_from;        // optional: resume this interrupted generation's checkpoint
  WorkerId owner;               // the attachment holding the request (daemon-assigned)
  // Who the per-worker limits count against: the calling process, so that attaching several
  // times does not multiply them (daemon-assigned). Empty: the owner.
  WorkerId principal;
  const WorkerId& limit_key() const { return principal.empty() ? owner : principal; }
};

enum class AdmitDecision { kAdmitted, kWait };

struct AdmitResult {
  AdmitDecision decision = AdmitDecision::kWait;
  int64_t projected_bytes = 0;  // what the request reserves (or would reserve)
  int64_t available_bytes = 0;  // budget not yet reserved, at the time of the answer
};

// What Acquire hands the caller: the request's block table and how much of it holds valid KV.
// A hybrid request's units of one KV group (docs/hybrid.md §2.4), as pool-wide indices from the
// group's range. Full: blocks for positions [0, n); sliding_window and chunked_local: blocks from
// block position first_block_position on (those below were released as the request advanced);
// state: the running slot, then the spare.
struct GroupTable {
  int group = 0;
  std::string name;
  int64_t first_block_position = 0;
  std::vector<BlockIndex> blocks;
  // A state group's table on a hit (docs/hybrid.md §2.6): the cached checkpoint slot holding the
  // state at exactly cached_tokens, which the engine copies into its running slot before its
  // first computed position; read-only, referenced by the request until it ends. -1: none (no
  // hit, or not a state group).
  int64_t checkpoint_slot = -1;
};

// A start's next prompt blocks that another live request of the same namespace (tenant salt
// included) is computing now: acquired, not yet published (docs/architecture.md, "Prefixes in
// flight"). Never names a request of another namespace.
struct InFlightInfo {
  int64_t first_block = 0;       // the first such block's position (the start's hit, in blocks)
  int64_t blocks = 0;            // how many of the start's next blocks in a row it computes
  RequestId request_id;          // the computing request
  int64_t published_tokens = 0;  // tokens of its chain it has published (or found cached) so far
  int64_t computed_tokens = 0;   // its engine's last computed_tokens report (hybrid grows; else 0)
  // Core only, not on the wire: the computing request's serial and the run's keys (what a wait watches).
  uint64_t serial = 0;
  std::vector<BlockKey> keys;
};

struct AcquireResult {
  PoolId pool = 0;
  std::vector<BlockIndex> blocks;  // block table: blocks[i] holds tokens [i*bt, (i+1)*bt)
  int64_t num_tokens = 0;          // tokens the table covers (prompt, or resumed tokens)
  // Tokens [0, cached_tokens) already hold valid KV: the engine computes only from here on.
  // Blocks at positions >= cached_tokens / block_tokens are writable by this request alone.
  int64_t cached_tokens = 0;
  bool resumed = false;               // state came from a checkpoint
  // Live workers that published the reused blocks: a reader orders its reads after their writes
  // (e.g. by waiting on their interprocess CUDA events) before it reads.
  std::vector<WorkerId> publishers;
  // Filled at the RPC edge, not by the core: the publishers' interprocess event handles.
  std::vector<std::string> publisher_events;
  // When resumed: the request's tokens, the checkpoint's or the prompt when that is longer.
  std::vector<Token> resumed_tokens;
  std::string engine_state;           // when resumed: the checkpoint's opaque engine bytes
  // Hybrid pools: one table per KV group, in the pool's group order; `blocks` is then the first
  // full group's table (empty without one). Empty for pools without groups.
  std::vector<GroupTable> group_tables;
  // Hybrid pools' diagnostics (§2.6): the spine's match in tokens, and the group that shortened
  // the hit below it (-1: none did).
  int64_t full_hit_tokens = 0;
  int limited_by = -1;
  // The lookup stopped at blocks another request of the namespace is computing now (this one
  // computes them too; a start may wait for them first: KvCache::InFlightAhead).
  std::optional<InFlightInfo> in_flight;
  // Acquire(id, OnInFlight::kDefer) found `in_flight` and acquired nothing: no table, the request
  // only admitted (the caller gives the reservation back and waits, holding nothing).
  bool deferred = false;
};

// What an Acquire does when its lookup stops at blocks another live request of the namespace is
// computing: compute them too (and learn who computes them), or acquire nothing (`deferred`).
enum class OnInFlight { kCompute, kDefer };

// A state group's checkpoint a publish offers (docs/hybrid.md §2.7): `slot`, one of the request's
// own slots of state group `group`, holds the state at exactly `position_tokens`.
struct StateCheckpoint {
  int group = 0;
  int64_t position_tokens = 0;
  BlockIndex slot = 0;
};

// §2.7's outcomes of one state checkpoint in a publish.
enum class CheckpointOutcome {
  kKept,           // the slot is now a cached, immutable checkpoint; the request got a fresh spare
  kAlreadyCached,  // the node holds one of this group: the slot stays the request's spare
  kNoChain,        // the spine does not hold nodes [0, d) of the request's chain
  kNoWindow,       // a window group's blocks [d - need, d) are neither held nor cached
  kNotAligned,     // d is 0, or neither on the k-grid nor an allowed tail
};

enum class PublishOutcome {
  kKept,           // now cached and immutable
  kAlreadyCached,  // the position already held a cached block (e.g. a prefix hit)
  kDuplicate,      // an identical block was cached first; this one stays private to the request
  kNoParent,       // an earlier block was not cached by this request, so the chain cannot extend
};
std::string PublishOutcomeName(PublishOutcome outcome);

struct PublishResult {
  std::vector<PublishOutcome> outcomes;  // one per published position
  int64_t kept = 0;
  // Hybrid pools: one per offered state checkpoint, in order; `fresh_slots[i]` is the spare slot
  // the request took in place of a kept one (-1 otherwise).
  std::vector<CheckpointOutcome> checkpoint_outcomes;
  std::vector<int64_t> fresh_slots;
};

enum class EvictReason { kCapacity = 0, kBoundary = 1, kGc = 2, kClear = 3 };
inline constexpr int kNumEvictReasons = 4;
std::string EvictReasonName(EvictReason reason);

struct GcStats {
  int64_t blocks_freed = 0;
  int64_t bytes_freed = 0;
  int64_t checkpoints_dropped = 0;
  int64_t sessions_expired = 0;
};

struct HandleInfo {
  RequestId id;
  std::string pool;
  WorkerId owner;
  SessionId session;
  bool acquired = false;
  int64_t num_tokens = 0;
  int64_t cached_tokens = 0;
  int64_t reserved_bytes = 0;
  std::vector<BlockIndex> blocks;
  bool has_checkpoint = false;
  absl::Time admitted_at;
};

// A checkpoint as KvCache::SnapshotCheckpoints sees it (for the disk tier's flush).
struct CheckpointSnapshot {
  RequestId id;
  PoolId pool = 0;
  Namespace ns;
  std::vector<Token> tokens;
  std::vector<BlockIndex> blocks;  // hold the KV of `tokens` (the last one may be partial)
  std::string engine_state;
  bool orphaned = false;           // its generation was interrupted
  uint64_t version = 0;            // names this content (TierPort::SetCheckpointDurable)
  bool durable = false;            // a tier said G3 holds this version
  // A hybrid pool's (docs/hybrid.md §2.9): per KV group, the units the checkpoint holds besides
  // `blocks` (the spine group's table, whose entry here stays empty): a window group's blocks from
  // block position `first` on, a state group's `slot` (kNoSlot: none). Empty for other pools.
  static constexpr BlockIndex kNoSlot = 0xFFFFFFFFu;
  struct Group {
    int64_t first = 0;
    std::vector<BlockIndex> blocks;
    BlockIndex slot = kNoSlot;
  };
  std::vector<Group> groups;
  // Every unit it holds, in record order: `blocks`, then per group its blocks and its slot.
  std::vector<BlockIndex> AllBlocks() const {
    std::vector<BlockIndex> out = blocks;
    for (const Group& g : groups) {
      out.insert(out.end(), g.blocks.begin(), g.blocks.end());
      if (g.slot != kNoSlot) out.push_back(g.slot);
    }
    return out;
  }
};

struct SessionInfo {
  SessionId id;
  WorkerId worker;           // who served the session's latest request
  int64_t protected_blocks = 0;
  absl::Time expires_at;
};

struct PoolReport {
  std::string name;
  int64_t block_bytes = 0;  // all shards
  int64_t capacity_blocks = 0;
  int64_t free_blocks = 0;
  int64_t owned_blocks = 0;        // writable, held by a request or an orphaned checkpoint
  int64_t cached_blocks = 0;       // immutable, in the index
  int64_t evictable_blocks = 0;    // cached and unreferenced (reclaimable)
  int64_t protected_blocks = 0;    // evictable but softly protected by a session
  int64_t reserved_blocks = 0;     // charged to the budget
  // Hybrid pools: the counts per KV group (free + owned + cached = capacity); empty otherwise.
  struct Group {
    std::string name;
    int64_t capacity = 0;
    int64_t unit_bytes = 0;  // all shards
    int64_t free = 0;
    int64_t owned = 0;
    int64_t cached = 0;
    int64_t evictable = 0;
    int64_t reserved = 0;
    // Lookups whose hit this group shortened (AcquireResult::limited_by), and the tokens they
    // lost to it (full-group hit minus the hit served). Counters since start.
    uint64_t limited_hits = 0;
    uint64_t limited_tokens = 0;
  };
  std::vector<Group> groups;
};

struct CacheReport {
  std::vector<PoolReport> pools;
  int64_t budget_bytes = 0;
  int64_t reserved_bytes = 0;
  int64_t checkpoint_bytes = 0;   // part of reserved_bytes pinned by orphaned checkpoints
  int64_t checkpoint_state_bytes = 0;  // daemon memory held by checkpoints (engine state + tokens)
  uint64_t lookups = 0;
  uint64_t hit_tokens = 0;
  uint64_t miss_tokens = 0;
  uint64_t resumed = 0;
  uint64_t published_blocks = 0;
  uint64_t duplicate_blocks = 0;  // positions published identical to a cached block (once each)
  uint64_t no_parent_blocks = 0;  // positions not cached because their chain broke (once each)
  uint64_t evictions[kNumEvictReasons] = {};
  uint64_t admitted = 0;
  uint64_t waited = 0;
  uint64_t rejected = 0;
  int64_t live_requests = 0;
  int64_t orphaned_checkpoints = 0;
  int64_t sessions = 0;
  int64_t indexed_blocks = 0;
  PressureLevel pressure = PressureLevel::kNormal;
  double available_fraction = 1.0;
  uint64_t last_event_sequence = 0;
};

}  // namespace kvd
