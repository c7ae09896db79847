// The state KvCache keeps per pool, request, checkpoint and session, and the notifications it
// queues while holding its mutex. Plain structs, used only by KvCache (its private aliases name
// them); split out of kv_cache.h to keep the engine's interface readable.
#pragma once

#include <cstdint>
#include <list>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/time/time.h"
#include "server/core/block_allocator.h"
#include "proto/vocab/cache_types.h"
#include "server/core/event_log.h"
#include "server/core/eviction_sink.h"
#include "server/core/eviction_queue.h"
#include "server/core/hybrid_spine.h"
#include "server/core/policy_duel.h"
#include "proto/vocab/pool_geometry.h"
#include "server/core/prefix_index.h"
#include "server/core/pressure_monitor.h"
#include "server/core/side_queue.h"

namespace kvd::cache_state {

struct BlockState {
  enum class Kind : uint8_t { kFree, kOwned, kCached };
  Kind kind = Kind::kFree;
  int32_t refs = 0;             // request tables + checkpoints referencing the block
  uint64_t owner = 0;           // kOwned: serial of the owning request / checkpoint
  CachedBlock* node = nullptr;  // kCached
};
struct Pool {
  PoolGeometry geometry;
  BlockAllocator allocator;
  std::vector<BlockState> blocks;
  EvictionQueue queue;
  int64_t num_owned = 0;
  int64_t num_cached = 0;
  int64_t num_cached_unreferenced = 0;
  int64_t reserve_blocks = 0;  // free blocks the data mover keeps (CacheOptions::demote_reserve)
  absl::flat_hash_map<BlockIndex, int32_t> pins;  // PinBlocks references, by block
  std::unique_ptr<PolicyDuel> duel;                // horizon policy only
  // Hybrid pools (docs/hybrid.md §2.2, §2.4). The spine group's blocks are the prefix index's
  // nodes, as every block of a pool without groups is: the first full group (-1 without one).
  // Published blocks of every other group (a window's blocks, a second full group's) are cached
  // with no index node (BlockState::node null) until the spine carries them as components: they
  // are counted in num_cached (and, unreferenced, num_cached_unreferenced) and per group in
  // `side`, whose `evictable` queue is what that group's allocation evicts, in its order. Nothing
  // references one again once its request let it go (hits are 0 on hybrid pools for now).
  struct SideGroup {
    int64_t cached = 0;
    // The group's evictable units in eviction order (docs/hybrid.md §2.8): unread interior window
    // blocks first, oldest first (SideQueue::MakeInterior), then the rest by release age: window
    // blocks at chain ends and anchors and those a hit read, checkpoints, further full blocks.
    SideQueue evictable;
  };
  int spine_group = 0;
  std::vector<SideGroup> side;  // one per group of a hybrid pool; empty otherwise
  // Per group of a hybrid pool: lookups whose hit it shortened and the tokens they lost
  // (PoolReport::Group::limited_hits / limited_tokens).
  struct Limits {
    uint64_t hits = 0;
    uint64_t tokens = 0;
  };
  std::vector<Limits> limits;
  // A hybrid pool with a full group: the components of the other groups hanging off each spine
  // node (docs/hybrid.md §2.6-2.8). Every cached block of another group is one: a window block
  // or a state checkpoint slot, attached at a publish; `component_node[b]` is its spine node
  // (BlockState::node stays null for it). Null for other pools.
  std::unique_ptr<HybridSpine> spine;
  std::vector<CachedBlock*> component_node;
  EvictionPlan plan;  // scratch for the spine's evictions (keeps its capacity)
  static std::vector<int64_t> GroupCapacities(const PoolGeometry& g) {
    if (!g.hybrid()) return {g.capacity_blocks};
    std::vector<int64_t> caps;
    for (const KvGroup& k : g.groups) caps.push_back(k.capacity);
    return caps;
  }
  explicit Pool(PoolGeometry g)
      : geometry(std::move(g)), allocator(GroupCapacities(geometry)), blocks(geometry.capacity_blocks) {
    if (geometry.hybrid()) {
      side.resize(geometry.groups.size());
      limits.resize(geometry.groups.size());
      spine_group = -1;
      for (size_t i = 0; i < geometry.groups.size() && spine_group < 0; ++i) {
        if (geometry.groups[i].kind == KvGroupKind::kFull) spine_group = static_cast<int>(i);
      }
    }
  }
  // Cached, unreferenced blocks of group g that an allocation there may evict.
  int64_t EvictableIn(int g) const {
    if (side.empty()) return num_cached_unreferenced;
    if (g == spine_group) {
      int64_t others = 0;
      for (const SideGroup& sg : side) others += sg.evictable.size();
      return num_cached_unreferenced - others;
    }
    return side[g].evictable.size();
  }
  int64_t CachedIn(int g) const {
    if (side.empty()) return num_cached;
    if (g == spine_group) {
      int64_t others = 0;
      for (const SideGroup& sg : side) others += sg.cached;
      return num_cached - others;
    }
    return side[g].cached;
  }
  // A use of a cached block: its recency tick and the pool's store clock (EvictionQueue).
  void StampUse(CachedBlock& node, uint64_t tick) const {
    node.last_use = tick;
    node.use_clock = static_cast<uint32_t>(queue.clock());
  }
  // Tells the horizon policy's duel of a use (a hit, or a store that was or was not `reused`) and
  // files the order it prefers. No-op under other policies.
  void NoteUse(const CachedBlock& node, bool reused) {
    if (duel == nullptr) return;
    duel->Access(node.key, reused, queue.clock());
    queue.set_order(duel->preferred());
  }
};
// KvCache's references as the spine asks for them: a block (a node's full block, or a component)
// is referenced while a request table, a pin or a checkpoint counts in its refs.
class PoolRefs final : public SpineRefs {
 public:
  explicit PoolRefs(const Pool& pool) : pool_(pool) {}
  bool NodeReferenced(const CachedBlock& node) const override { return pool_.blocks[node.address.index].refs > 0; }
  bool ComponentReferenced(BlockIndex index) const override { return pool_.blocks[index].refs > 0; }

 private:
  const Pool& pool_;
};
struct Request {
  RequestSpec spec;
  uint64_t serial = 0;
  PoolId pool = 0;
  int64_t reserved_blocks = 0;
  bool acquired = false;
  std::vector<BlockIndex> table;
  int64_t num_tokens = 0;
  int64_t cached_tokens = 0;
  std::vector<Token> known_tokens;  // prompt, then generated tokens learned from publish/checkpoint
  std::vector<BlockKey> keys;       // chained keys of the prompt's full blocks, computed before the lock
  absl::Time admitted_at;
  // Hybrid pools (docs/hybrid.md §2.4, §2.5). `table` is the spine group's table (positions
  // [0, n)); groups[g] holds every other group's units: blocks from block position `first` on
  // (window groups release those below as computed_tokens advances), or the state group's running
  // and spare slots. reserved_units[g] is what admission reserved in group g (reserved_blocks is
  // their sum); computed_tokens the engine's last report.
  // `checkpoint`: on a hit, a state group's cached checkpoint the request reads (referenced,
  // read-only, until it ends); kNone otherwise.
  struct Group {
    int64_t first = 0;
    std::vector<BlockIndex> blocks;
    BlockIndex checkpoint = HybridSpine::kNone;
  };
  std::vector<Group> groups;
  std::vector<int64_t> reserved_units;
  int64_t computed_tokens = 0;
  // Chains continue past duplicates (kv_cache_publish.cc; docs/architecture.md, "Publish and
  // duplicates"). When the request published a block identical to a cached one, `table` holds the
  // cached one at that position (referenced, so its later blocks can be its children) and the
  // request's own copy stays here: referenced, written by the request in the ledger, private (the
  // engine may still read it), freed at release. Ordered by position; each one past End's
  // publish is covered by reserved_blocks (table.size() + own_copies.size() <= reserved_blocks).
  struct OwnCopy {
    int64_t position = 0;
    BlockIndex block = 0;
  };
  std::vector<OwnCopy> own_copies;
  // Positions [0, counted) whose publish outcomes are counted (a repeat publish counts nothing).
  int64_t counted = 0;
};
struct CheckpointRecord {
  uint64_t serial = 0;  // owner serial of its owned blocks
  RequestId id;
  PoolId pool = 0;
  Namespace ns;
  std::vector<Token> tokens;
  std::vector<BlockIndex> blocks;
  std::string engine_state;
  int64_t state_bytes = 0;      // engine_state + tokens: daemon memory charged for it
  // The worker (process) whose per-worker limit its state counts against: its request's, also
  // once orphaned (a worker cannot push other tenants' resumable checkpoints out by ending its
  // own as interrupted); empty when restored from disk or a handoff.
  WorkerId owner;
  bool orphaned = false;        // its request ended interrupted
  int64_t charged_blocks = 0;   // when orphaned: blocks charged to the ledger
  absl::Time expires_at;        // when orphaned
  uint64_t version = 0;         // unique per record: names this content for the tiers
  bool durable = false;         // a tier said G3 holds this version (TierPort::SetCheckpointDurable)
  // Hybrid pools (docs/hybrid.md §2.9; kv_cache_group_checkpoints.cc): per KV group, what the
  // record holds besides `blocks` (the spine group's table, whose entry here stays empty): a
  // window group's blocks from block position `first` on, covering the window before the
  // checkpoint's position; a state group's `slot` holding the state at exactly that position
  // (owned by the record alone, never written again). charged_units: when orphaned, the units
  // charged per group (charged_blocks is their sum). Empty for other pools.
  struct Group {
    int64_t first = 0;
    std::vector<BlockIndex> blocks;
    BlockIndex slot = HybridSpine::kNone;
  };
  std::vector<Group> groups;
  std::vector<int64_t> charged_units;
};
// Blocks a writer kvd can no longer reach may still write (a request live at a restart or
// handoff, or held by an attachment whose stream broke; every free block after a restart that
// kept memory but not who wrote it). The fence holds one reference on each, so none is handed to
// a new owner until it is lifted: the attachment that held them is named by a re-attach of the
// same process that says it quiesced, or that process is gone (pid), or `until` passed on the
// engine's clock (docs/security.md).
// The key of a block in KvCache::fenced_ (how many fences hold it).
inline uint64_t FencedBlockKey(PoolId pool, BlockIndex index) { return (static_cast<uint64_t>(pool) << 40) | index; }
// Who may still write a fenced block: one attachment (its worker id, unique across kvd
// processes) of one process. An empty attachment and pid 0: unknown, lifted only by time.
struct FenceOwner {
  WorkerId attachment;
  uint32_t pid = 0;  // the kernel's word; 0: unknown
};
struct FenceRecord {
  uint64_t serial = 0;  // owner serial of blocks held by the fence alone
  WorkerId attachment;  // FenceOwner
  uint32_t pid = 0;
  PoolId pool = 0;
  std::vector<BlockIndex> blocks;
  int64_t charged_blocks = 0;  // charged to the ledger (the blocks it claimed from free)
  std::vector<int64_t> charged_units;  // a hybrid pool's: per group (charged_blocks is their sum)
  absl::Time until;
};
// A worker's block credit (proto/vocab/step_types.h) in one pool: blocks it may place into its
// requests' tables without asking, owned under `serial` (BlockState::owner) and charged to the
// budget and to the worker's principal one block each until a grow names them or the worker
// gives them back by name. Which blocks it holds is the BlockLedger's record of Owner{kCredit,
// worker, serial} (KvCache::owners_): a grow checks and takes each one in O(1) under the lock.
struct PoolCredit {
  uint64_t serial = 0;
};
struct WorkerCredit {
  WorkerId principal;  // whose per-worker limits the credit counts against
  absl::flat_hash_map<PoolId, PoolCredit> pools;
};
// A pull writing into a request's own blocks between TierPort::PinBlocks and UnpinBlocks (a lower
// tier's promotion, or a peer's blocks: server/store, server/transfer). Its ledger owner
// Owner{kPull, the request's worker, epoch} holds the pinned blocks the request wrote, so that
// meanwhile the request's worker is not their writer; UnpinBlocks naming exactly `blocks` gives
// them back to the request (BlockState::owner stays the request's serial throughout), or lets
// them go when the request has ended.
struct PullRecord {
  RequestId id;
  uint64_t request_serial = 0;
  WorkerId attachment;  // the request's worker
  PoolId pool = 0;
  std::vector<BlockIndex> blocks;  // as PinBlocks named them
};
struct ProtectedRef { PoolId pool; BlockIndex index; uint64_t node_serial; };
struct Session {
  // The tenant it belongs to: the cache_salt of the request that made it. A request of another
  // salt naming it is refused (it could otherwise move the protection off the tenant's blocks).
  // Unset for a session a handoff brought from a kvd that did not record it: any salt may use it.
  std::optional<std::string> salt;
  WorkerId worker;
  std::vector<ProtectedRef> protected_blocks;  // leading cached blocks of its latest request
  absl::Time expires_at;
};
// Notifications produced under mu_ and delivered after it is released.
struct Outbox {
  std::vector<CacheEvent> events;
  bool pressure_changed = false;  // then `level` and `available` are the latest reading
  PressureLevel level = PressureLevel::kNormal;
  double available = 1.0;
  bool empty() const { return events.empty() && !pressure_changed; }
};
// A block an operation evicted while a sink was set: held (pinned) until RunDemotions, on the same
// thread, has handed it to the sink. Kept per thread, so that each operation copies exactly the
// blocks it evicted before it returns (and no other thread can hand them out meanwhile).
struct PendingDemotion {
  const void* cache;  // the KvCache that evicted it (tests run several in one thread)
  HeldBlock block;
};
std::vector<PendingDemotion>& ThreadDemotions();
}  // namespace kvd::cache_state
