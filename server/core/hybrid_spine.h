// HybridSpine holds, for one hybrid pool with a full group, the components of its other KV groups
// that hang off each spine node (docs/hybrid.md §2.6-2.8), and answers the questions the engine
// asks of them: how long a hit every group serves, whether a state checkpoint may be published,
// and what goes with a unit when it is evicted.
//
// The spine is the PrefixIndex chain of the pool's *spine group* (its first full group): a node is
// a CachedBlock whose address.index lies in that group's range [first_block, first_block + cap).
// HybridSpine keeps side arrays indexed by `node.address.index - first_block`, one per other group:
//   attention groups (sliding_window, chunked_local, further full groups): the pool-wide index of
//     the node's block of that group, or kNone (a tombstone: the node lost, or never had, it);
//   state groups: the pool-wide index of the checkpoint slot holding the state at exactly the end
//     of the node (depth d: d * block_tokens tokens), or kNone, plus d and whether it is a tail;
//   window groups: how many checkpoints below (or at) the node read its block (`window_cover`).
// Block position j (0-based) of a chain is held by node n_{j+1} (depth j + 1). A hit of depth d
// reads, of window group g, the blocks [d - need_g(d), d) (WindowNeed), i.e. the nodes
// n_{d - need + 1} .. n_d: the node itself and need - 1 ancestors.
//
// The nodes themselves (keys, parent links, child counts) stay the PrefixIndex's; HybridSpine
// reads `parent`, `num_children` and `address` and writes nothing there. References (requests,
// generation checkpoints, pins) are KvCache's; it answers for them through SpineRefs.
//
// Memory: 4 bytes per node per attention group, 12 per window group (+cover), 9 per state group,
// allocated once at Create(); nothing here allocates afterwards except output vectors growing to
// their high-water mark.
// Thread-compatible: plain data, guarded by the engine lock of the KvCache that owns it.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "proto/vocab/cache_types.h"
#include "proto/vocab/pool_geometry.h"
#include "proto/vocab/types.h"
#include "server/core/prefix_index.h"

namespace kvd {

// What KvCache knows about references; asked by the eviction helpers and the checker.
class SpineRefs {
 public:
  virtual ~SpineRefs() = default;
  // A live request, a generation checkpoint or a pin references the node's full block.
  virtual bool NodeReferenced(const CachedBlock& node) const = 0;
  // A request references component `index` (a window block or a checkpoint slot).
  virtual bool ComponentReferenced(BlockIndex index) const = 0;
};

// No references at all (tests; a pool between requests).
class NoSpineRefs final : public SpineRefs {
 public:
  bool NodeReferenced(const CachedBlock&) const override { return false; }
  bool ComponentReferenced(BlockIndex) const override { return false; }
};

// §2.7's outcomes: CheckpointOutcome (proto/vocab/cache_types.h).
absl::string_view CheckpointOutcomeName(CheckpointOutcome outcome);

// The answer of Lookup (§2.6). Reused across calls so its vectors stop allocating.
struct HybridHit {
  int64_t depth = 0;       // L / block_tokens: the blocks every group serves
  int64_t full_depth = 0;  // F: the spine's match
  // The group that shortened the hit: of the groups that alone would serve less than F, the one
  // serving least (first in declaration order on a tie); -1 when depth == full_depth.
  int limited_by = -1;
  struct Group {
    // Attention groups other than the spine's: the hit reads blocks [first_position, depth),
    // whose indices are `blocks` (in position order).
    int64_t first_position = 0;
    std::vector<BlockIndex> blocks;
    // State groups: the checkpoint at depth to copy into the running slot; kNone at depth 0.
    BlockIndex checkpoint = 0xFFFFFFFFu;
  };
  std::array<Group, kMaxKvGroups> groups;  // indexed by group; the spine group's stays empty
};

// One component leaving the spine: node's block (attention) or checkpoint slot (state) of group.
struct SpineDrop {
  const CachedBlock* node = nullptr;
  int group = 0;
  BlockIndex index = 0;
  bool tail = false;  // a state group's tail checkpoint (the tiers keep it with its unit)
};

// What an eviction removed from the spine's side arrays, for KvCache to carry out under the same
// lock: erase `nodes` from the PrefixIndex in this order (each is a leaf once those before it are
// erased), free every index in `components` (now unreferenced and unindexed), announce them all in
// one event run. `clear()` keeps capacity.
struct EvictionPlan {
  std::vector<CachedBlock*> nodes;
  std::vector<SpineDrop> components;
  void clear() {
    nodes.clear();
    components.clear();
  }
};

// Blocks of a window group the publishing request itself holds (its table): positions
// [first_position, end_position).
struct HeldWindow {
  int64_t first_position = 0;
  int64_t end_position = 0;
};

class HybridSpine {
 public:
  static constexpr BlockIndex kNone = 0xFFFFFFFFu;

  // INVALID_ARGUMENT unless `pool` is hybrid, resolved (ResolveGroups) and has a full group.
  static absl::StatusOr<HybridSpine> Create(const PoolGeometry& pool, PoolId pool_id);

  int spine_group() const { return spine_group_; }
  int num_groups() const { return static_cast<int>(groups_.size()); }
  bool has_state_group() const { return has_state_; }
  // Blocks of group g before depth d that a hit of depth d reads: full d; sliding_window
  // min(d, ceil((W - 1) / bt)); chunked_local (d * bt mod C) / bt; state 0.
  int64_t WindowNeed(int g, int64_t depth) const;
  // Sliding window group g's anchor grid (docs/hybrid.md §2.8): the depths that are multiples of
  // kAnchorEvery windows (ceil((W - 1) / bt) blocks each). True when a hit at an anchor reads block
  // position `position` (0-based): its group keeps such a block like a chain end's, so that a hit
  // inside a chain whose other interior window blocks went still lands at most one anchor spacing
  // short of where it branches (as a k-grid does for state checkpoints), for 1/kAnchorEvery of
  // the chain's window blocks. False for other groups (a chunked group's chunk starts need none).
  static constexpr int64_t kAnchorEvery = 8;
  bool WindowAnchor(int g, int64_t position) const;

  // --- Components. REQUIRES throughout: `node` is a cached node of this pool's spine group and
  // g is another group of the right kind.

  // Attention group g's block of the node (kNone: tombstone).
  BlockIndex block(const CachedBlock& node, int g) const { return groups_[g].comp[Slot(node)]; }
  // REQUIRES: the node holds no block of g; `index` lies in g's range.
  void AttachBlock(const CachedBlock& node, int g, BlockIndex index);
  // Removes the node's block of window group g and returns it (kNone if there was none).
  // REQUIRES: no checkpoint reads it (window_cover == 0), else U3 would break.
  BlockIndex Tombstone(const CachedBlock& node, int g);
  // Checkpoints of any state group whose hit reads the node's block of window group g.
  int32_t window_cover(const CachedBlock& node, int g) const { return groups_[g].cover[Slot(node)]; }

  // State group g's checkpoint slot at the node (kNone: none), its depth and tail flag.
  BlockIndex checkpoint(const CachedBlock& node, int g) const { return groups_[g].comp[Slot(node)]; }
  bool checkpoint_is_tail(const CachedBlock& node, int g) const { return groups_[g].tail[Slot(node)] != 0; }
  // Indexes `slot` as g's checkpoint at the node, which is at `depth`; every window block it
  // reads gains a cover. REQUIRES: CanAcceptCheckpoint(...) == kKept for it, the window blocks
  // attached (publish attaches blocks before checkpoints).
  void AttachCheckpoint(const CachedBlock& node, int g, BlockIndex slot, int64_t depth, bool tail);
  // Removes g's checkpoint at the node and returns its slot (kNone if none); covers drop.
  BlockIndex DetachCheckpoint(const CachedBlock& node, int g);

  // --- Lookup (§2.6): O(F * groups), no allocation once `hit` has grown.
  // `chain` is the spine's Match for the prompt: n_1 .. n_F (already capped at
  // floor((prompt_len - 1) / bt)). Fills `hit` with the largest d in [0, F] every group serves.
  void Lookup(absl::Span<const CachedBlock* const> chain, HybridHit* hit) const;

  // §2.7: may the request publish state group g's checkpoint at `depth` (`tail`: End's tail at the
  // last full block)? `chain` is what the spine holds of the request's chain after this publish's
  // blocks (n_1 .. n_m, a prefix of it); `held`, indexed by group (may be shorter), the window
  // blocks the request holds. Checked in the order not_aligned, no_chain, already_cached,
  // no_window. O(groups * need).
  CheckpointOutcome CanAcceptCheckpoint(int g, absl::Span<const CachedBlock* const> chain, int64_t depth,
                                        bool tail, absl::Span<const HeldWindow> held = {}) const;

  // --- Eviction as one unit (§2.8). Each call removes what goes from the side arrays and appends
  // to `plan` what KvCache must now do (see EvictionPlan). The PrefixIndex must still hold every
  // node in plan.nodes when the call returns (parent links are read).

  // The spine leaf `leaf` is evicted: its components go, then the cascade: each ancestor left a
  // leaf that is unreferenced and unservable (U2, see UnservableBy) is erased with its
  // components, and every unreferenced window block no checkpoint reads any more is tombstoned
  // (U4).
  // REQUIRES: leaf->num_children == 0 and !refs.NodeReferenced(*leaf).
  void EvictLeaf(CachedBlock* leaf, const SpineRefs& refs, EvictionPlan* plan);
  // A state group under pressure drops g's checkpoint at `node`: at an (unreferenced) leaf the
  // whole unit goes (EvictLeaf); elsewhere a state tombstone, and window blocks only it kept go
  // (U4). REQUIRES: the slot is unreferenced.
  void EvictCheckpoint(CachedBlock* node, int g, const SpineRefs& refs, EvictionPlan* plan);
  // A window group under pressure drops g's block at `node`. False, changing nothing, when the
  // block may not go alone: a checkpoint reads it (U3), or the node is a referenced leaf. At an
  // unreferenced leaf the whole unit goes. REQUIRES: the block is present and unreferenced.
  bool EvictWindowBlock(CachedBlock* node, int g, const SpineRefs& refs, EvictionPlan* plan);
  // U4 for a window block a request releases into the cache: false when, in a pool with a state
  // group, no checkpoint reads it (free it instead of attaching/keeping it).
  bool WindowBlockEarnsPlace(const CachedBlock& node, int g) const;
  // U2 for a leaf that is (or is about to be) unreferenced: true when it may stay (UnservableBy).
  bool LeafServable(const CachedBlock& leaf) const { return UnservableBy(leaf) < 0; }

  // Recomputes U2, U3 and U4 from scratch over this pool's nodes in `index`, plus what the side
  // arrays alone can tell of U1 (no component on a slot without a node; every node holds each
  // further full group's block) and U6 (each component in its group's range, held once). INTERNAL
  // naming the first node (index and depth) and rule that fails. O(nodes * depth).
  // U1's node/full-block agreement, U5 and U6's ledger counts need KvCache's state: its checker
  // calls this and adds them.
  absl::Status CheckInvariants(const PrefixIndex& index, const SpineRefs& refs) const;

 private:
  struct Group {
    KvGroupKind kind = KvGroupKind::kFull;
    std::string name;
    int64_t window_blocks = 0;  // sliding_window: ceil((W - 1) / bt)
    int64_t chunk_blocks = 0;   // chunked_local: C / bt
    int64_t every = 0;          // state: k
    bool at_end = false;        // state: checkpoint_at_end
    BlockIndex first = 0, end = 0;  // the group's pool-wide range
    std::vector<BlockIndex> comp;   // per node: block or slot, kNone
    std::vector<int32_t> cover;     // window groups: covering checkpoints per node
    std::vector<int32_t> depth;     // state groups: the checkpoint's depth
    std::vector<uint8_t> tail;      // state groups: 1 for a tail checkpoint
    bool window() const { return kind == KvGroupKind::kSlidingWindow || kind == KvGroupKind::kChunkedLocal; }
  };

  HybridSpine() = default;
  size_t Slot(const CachedBlock& node) const;
  // Adds `delta` to the cover of every window block g's checkpoint at `node` (depth d) reads.
  void AddCover(const CachedBlock& node, int64_t depth, int32_t delta);
  // U2 for a leaf: the first group whose component it lacks, or -1. In a pool with a state group a
  // leaf needs a checkpoint of every state group and the attention blocks a hit at the
  // checkpoint's depth reads of itself (a chunked group's block at a chunk start is not read);
  // without one, every attention group's block (SGLang's "no tombstone leaf").
  int UnservableBy(const CachedBlock& node) const;
  // Moves every component of `node` to plan->components, dropping covers of its checkpoints.
  void DropAll(const CachedBlock& node, EvictionPlan* plan);
  // Tombstones the unreferenced window blocks at `from` and up to `levels` - 1 ancestors that no
  // checkpoint reads any more (U4); stops at nodes in plan->nodes' tail (already going).
  void DropUncovered(const CachedBlock* from, int64_t levels, const SpineRefs& refs, EvictionPlan* plan);
  // The erase-and-cascade loop shared by the Evict* calls.
  void Cascade(CachedBlock* start, const SpineRefs& refs, EvictionPlan* plan);

  PoolId pool_id_ = 0;
  int32_t block_tokens_ = 0;
  int spine_group_ = 0;
  bool has_state_ = false;
  BlockIndex spine_first_ = 0;
  int64_t spine_capacity_ = 0;
  int64_t max_need_ = 0;  // largest window need of any window group (bounds the U4 walk)
  std::vector<Group> groups_;
};

}  // namespace kvd
