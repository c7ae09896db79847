#include "server/core/hybrid_spine.h"

#include <algorithm>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "proto/vocab/status_macros.h"

namespace kvd {

absl::string_view CheckpointOutcomeName(CheckpointOutcome outcome) {
  switch (outcome) {
    case CheckpointOutcome::kKept: return "kept";
    case CheckpointOutcome::kAlreadyCached: return "already_cached";
    case CheckpointOutcome::kNoChain: return "no_chain";
    case CheckpointOutcome::kNoWindow: return "no_window";
    case CheckpointOutcome::kNotAligned: return "not_aligned";
  }
  return "unknown";
}

absl::StatusOr<HybridSpine> HybridSpine::Create(const PoolGeometry& pool, PoolId pool_id) {
  if (!pool.hybrid()) {
    return absl::InvalidArgumentError(absl::StrFormat("pool %s has no KV groups: it needs no hybrid spine", pool.name));
  }
  if (pool.groups.size() > static_cast<size_t>(kMaxKvGroups)) {
    return absl::InvalidArgumentError(absl::StrFormat("pool %s has %d KV groups; at most %d", pool.name,
                                                      pool.groups.size(), kMaxKvGroups));
  }
  if (pool.block_tokens <= 0) {
    return absl::InvalidArgumentError(absl::StrFormat("pool %s: block_tokens %d", pool.name, pool.block_tokens));
  }
  HybridSpine s;
  s.pool_id_ = pool_id;
  s.block_tokens_ = pool.block_tokens;
  s.spine_group_ = -1;
  for (size_t i = 0; i < pool.groups.size(); ++i) {
    if (pool.groups[i].kind == KvGroupKind::kFull) {
      s.spine_group_ = static_cast<int>(i);
      break;
    }
  }
  if (s.spine_group_ < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("pool %s has no full group: its spine would be sized by index_blocks", pool.name));
  }
  const KvGroup& spine = pool.groups[s.spine_group_];
  if (spine.capacity <= 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("pool %s: group %s has capacity %d (ResolveGroups not run?)", pool.name, spine.name,
                        spine.capacity));
  }
  s.spine_first_ = static_cast<BlockIndex>(spine.first_block);
  s.spine_capacity_ = spine.capacity;
  const size_t n = static_cast<size_t>(spine.capacity);
  for (size_t i = 0; i < pool.groups.size(); ++i) {
    const KvGroup& kg = pool.groups[i];
    Group g;
    g.kind = kg.kind;
    g.name = kg.name;
    g.first = static_cast<BlockIndex>(kg.first_block);
    g.end = static_cast<BlockIndex>(kg.first_block + kg.capacity);
    if (static_cast<int>(i) != s.spine_group_) {
      switch (kg.kind) {
        case KvGroupKind::kFull:
          break;
        case KvGroupKind::kSlidingWindow:
          if (kg.window < 1) {
            return absl::InvalidArgumentError(
                absl::StrFormat("pool %s: group %s has window %d", pool.name, kg.name, kg.window));
          }
          g.window_blocks = (int64_t{kg.window} - 1 + pool.block_tokens - 1) / pool.block_tokens;
          break;
        case KvGroupKind::kChunkedLocal:
          if (kg.chunk <= 0 || kg.chunk % pool.block_tokens != 0) {
            return absl::InvalidArgumentError(absl::StrFormat(
                "pool %s: group %s has chunk %d, not a positive multiple of block_tokens %d", pool.name, kg.name,
                kg.chunk, pool.block_tokens));
          }
          g.chunk_blocks = kg.chunk / pool.block_tokens;
          break;
        case KvGroupKind::kState:
          if (kg.checkpoint_every_blocks < 1) {
            return absl::InvalidArgumentError(absl::StrFormat("pool %s: group %s has checkpoint_every_blocks %d",
                                                              pool.name, kg.name, kg.checkpoint_every_blocks));
          }
          g.every = kg.checkpoint_every_blocks;
          g.at_end = kg.checkpoint_at_end;
          s.has_state_ = true;
          break;
      }
      g.comp.assign(n, kNone);
      if (g.window()) g.cover.assign(n, 0);
      if (g.kind == KvGroupKind::kState) {
        g.depth.assign(n, 0);
        g.tail.assign(n, 0);
      }
    }
    s.groups_.push_back(std::move(g));
  }
  for (const Group& g : s.groups_) {
    s.max_need_ = std::max(s.max_need_, g.kind == KvGroupKind::kSlidingWindow ? g.window_blocks
                                        : g.kind == KvGroupKind::kChunkedLocal ? g.chunk_blocks - 1
                                                                               : int64_t{0});
  }
  return s;
}

size_t HybridSpine::Slot(const CachedBlock& node) const {
  KVD_CHECK(node.address.pool == pool_id_);
  KVD_CHECK(node.address.index >= spine_first_);
  const size_t slot = node.address.index - spine_first_;
  KVD_CHECK(slot < static_cast<size_t>(spine_capacity_));
  return slot;
}

int64_t HybridSpine::WindowNeed(int g, int64_t depth) const {
  const Group& group = groups_[g];
  switch (group.kind) {
    case KvGroupKind::kFull: return depth;
    case KvGroupKind::kSlidingWindow: return std::min(depth, group.window_blocks);
    case KvGroupKind::kChunkedLocal: return depth % group.chunk_blocks;  // (d*bt mod C)/bt, C = chunk_blocks*bt
    case KvGroupKind::kState: return 0;
  }
  return 0;
}

bool HybridSpine::WindowAnchor(int g, int64_t position) const {
  const Group& group = groups_[g];
  if (group.kind != KvGroupKind::kSlidingWindow || group.window_blocks == 0) return false;
  const int64_t spacing = kAnchorEvery * group.window_blocks;
  return position % spacing >= spacing - group.window_blocks;
}

void HybridSpine::AttachBlock(const CachedBlock& node, int g, BlockIndex index) {
  Group& group = groups_[g];
  KVD_CHECK(g != spine_group_ && group.kind != KvGroupKind::kState);
  KVD_CHECK(index >= group.first && index < group.end);
  BlockIndex& c = group.comp[Slot(node)];
  KVD_CHECK(c == kNone);
  c = index;
}

BlockIndex HybridSpine::Tombstone(const CachedBlock& node, int g) {
  Group& group = groups_[g];
  KVD_CHECK(group.window());
  const size_t slot = Slot(node);
  KVD_CHECK(group.cover[slot] == 0);
  return std::exchange(group.comp[slot], kNone);
}

void HybridSpine::AddCover(const CachedBlock& node, int64_t depth, int32_t delta) {
  for (int h = 0; h < num_groups(); ++h) {
    if (!groups_[h].window()) continue;
    const CachedBlock* n = &node;
    for (int64_t i = WindowNeed(h, depth); i > 0; --i) {
      KVD_CHECK(n != nullptr);
      groups_[h].cover[Slot(*n)] += delta;
      n = n->parent;
    }
  }
}

void HybridSpine::AttachCheckpoint(const CachedBlock& node, int g, BlockIndex slot, int64_t depth, bool tail) {
  Group& group = groups_[g];
  KVD_CHECK(group.kind == KvGroupKind::kState);
  KVD_CHECK(slot >= group.first && slot < group.end);
  KVD_CHECK(depth > 0);
  const size_t i = Slot(node);
  KVD_CHECK(group.comp[i] == kNone);
  group.comp[i] = slot;
  group.depth[i] = static_cast<int32_t>(depth);
  group.tail[i] = tail ? 1 : 0;
  AddCover(node, depth, +1);
}

BlockIndex HybridSpine::DetachCheckpoint(const CachedBlock& node, int g) {
  Group& group = groups_[g];
  KVD_CHECK(group.kind == KvGroupKind::kState);
  const size_t i = Slot(node);
  const BlockIndex slot = std::exchange(group.comp[i], kNone);
  if (slot != kNone) AddCover(node, group.depth[i], -1);
  group.depth[i] = 0;
  group.tail[i] = 0;
  return slot;
}

void HybridSpine::Lookup(absl::Span<const CachedBlock* const> chain, HybridHit* hit) const {
  const int64_t full = static_cast<int64_t>(chain.size());
  std::array<int64_t, kMaxKvGroups> run{};
  std::array<int64_t, kMaxKvGroups> last_ok{};  // largest d group g alone serves (0 always)
  int64_t best = 0;
  for (int64_t d = 1; d <= full; ++d) {
    const size_t slot = Slot(*chain[d - 1]);
    bool all = true;
    for (int g = 0; g < num_groups(); ++g) {
      if (g == spine_group_) continue;
      const Group& group = groups_[g];
      bool ok;
      if (group.kind == KvGroupKind::kState) {
        ok = group.comp[slot] != kNone;
      } else {
        run[g] = group.comp[slot] != kNone ? run[g] + 1 : 0;
        ok = run[g] >= WindowNeed(g, d);
      }
      if (ok) {
        last_ok[g] = d;
      } else {
        all = false;
      }
    }
    if (all) best = d;
  }
  hit->full_depth = full;
  hit->depth = best;
  hit->limited_by = -1;
  if (best < full) {
    for (int g = 0; g < num_groups(); ++g) {
      if (g == spine_group_ || last_ok[g] == full) continue;
      if (hit->limited_by < 0 || last_ok[g] < last_ok[hit->limited_by]) hit->limited_by = g;
    }
  }
  for (int g = 0; g < kMaxKvGroups; ++g) {
    HybridHit::Group& out = hit->groups[g];
    out.blocks.clear();
    out.first_position = 0;
    out.checkpoint = kNone;
    if (g >= num_groups() || g == spine_group_) continue;
    const Group& group = groups_[g];
    if (group.kind == KvGroupKind::kState) {
      if (best > 0) out.checkpoint = group.comp[Slot(*chain[best - 1])];
      continue;
    }
    out.first_position = best - WindowNeed(g, best);
    for (int64_t j = out.first_position; j < best; ++j) out.blocks.push_back(group.comp[Slot(*chain[j])]);
  }
}

CheckpointOutcome HybridSpine::CanAcceptCheckpoint(int g, absl::Span<const CachedBlock* const> chain, int64_t depth,
                                                   bool tail, absl::Span<const HeldWindow> held) const {
  const Group& group = groups_[g];
  KVD_CHECK(group.kind == KvGroupKind::kState);
  if (depth <= 0 || !(depth % group.every == 0 || (tail && group.at_end))) return CheckpointOutcome::kNotAligned;
  if (static_cast<int64_t>(chain.size()) < depth) return CheckpointOutcome::kNoChain;
  if (group.comp[Slot(*chain[depth - 1])] != kNone) return CheckpointOutcome::kAlreadyCached;
  for (int h = 0; h < num_groups(); ++h) {
    if (h == spine_group_ || groups_[h].kind == KvGroupKind::kState) continue;
    for (int64_t j = depth - WindowNeed(h, depth); j < depth; ++j) {
      const bool by_request = static_cast<size_t>(h) < held.size() && held[h].first_position <= j &&
                              j < held[h].end_position;
      if (!by_request && groups_[h].comp[Slot(*chain[j])] == kNone) return CheckpointOutcome::kNoWindow;
    }
  }
  return CheckpointOutcome::kKept;
}

int HybridSpine::UnservableBy(const CachedBlock& node) const {
  const size_t slot = Slot(node);
  int64_t depth = -1;  // known from a checkpoint in a pool with a state group
  for (int g = 0; g < num_groups(); ++g) {
    const Group& group = groups_[g];
    if (group.kind != KvGroupKind::kState) continue;
    if (group.comp[slot] == kNone) return g;
    depth = group.depth[slot];
  }
  for (int g = 0; g < num_groups(); ++g) {
    const Group& group = groups_[g];
    if (g == spine_group_ || group.kind == KvGroupKind::kState || group.comp[slot] != kNone) continue;
    // A missing block is fine only where the leaf's own hit does not read it.
    if (depth < 0 || WindowNeed(g, depth) > 0) return g;
  }
  return -1;
}

void HybridSpine::DropAll(const CachedBlock& node, EvictionPlan* plan) {
  // Checkpoints first: their covers leave the window blocks, this node's included.
  for (int g = 0; g < num_groups(); ++g) {
    if (groups_[g].kind != KvGroupKind::kState) continue;
    const bool tail = checkpoint_is_tail(node, g);
    const BlockIndex slot = DetachCheckpoint(node, g);
    if (slot != kNone) plan->components.push_back({&node, g, slot, tail});
  }
  const size_t slot = Slot(node);
  for (int g = 0; g < num_groups(); ++g) {
    if (g == spine_group_ || groups_[g].kind == KvGroupKind::kState) continue;
    const BlockIndex b = std::exchange(groups_[g].comp[slot], kNone);
    if (b != kNone) plan->components.push_back({&node, g, b});
  }
}

void HybridSpine::DropUncovered(const CachedBlock* from, int64_t levels, const SpineRefs& refs,
                                EvictionPlan* plan) {
  for (const CachedBlock* n = from; n != nullptr && levels > 0; n = n->parent, --levels) {
    const size_t slot = Slot(*n);
    for (int g = 0; g < num_groups(); ++g) {
      Group& group = groups_[g];
      if (!group.window() || group.comp[slot] == kNone || group.cover[slot] != 0) continue;
      if (refs.ComponentReferenced(group.comp[slot])) continue;
      plan->components.push_back({n, g, std::exchange(group.comp[slot], kNone)});
    }
  }
}

void HybridSpine::Cascade(CachedBlock* node, const SpineRefs& refs, EvictionPlan* plan) {
  // `node` is an unreferenced leaf (once the nodes already in plan are erased) that goes.
  CachedBlock* stop = nullptr;
  for (CachedBlock* cur = node; cur != nullptr;) {
    plan->nodes.push_back(cur);
    DropAll(*cur, plan);
    CachedBlock* parent = cur->parent;
    // The parent is a leaf now iff `cur` was its only child.
    if (parent == nullptr || parent->num_children != 1 || refs.NodeReferenced(*parent) ||
        UnservableBy(*parent) < 0) {
      stop = parent;
      break;
    }
    cur = parent;
  }
  if (stop == nullptr || !has_state_) return;
  // U4: the erased checkpoints' windows reached at most max_need_ - 1 nodes above the highest
  // erased node, i.e. `stop` and up to max_need_ - 2 above it. `stop` stays servable: by U3 its
  // own checkpoints read the blocks its hit needs, so none of those is uncovered.
  DropUncovered(stop, max_need_, refs, plan);
}

void HybridSpine::EvictLeaf(CachedBlock* leaf, const SpineRefs& refs, EvictionPlan* plan) {
  KVD_CHECK(leaf->num_children == 0);
  KVD_CHECK(!refs.NodeReferenced(*leaf));
  Cascade(leaf, refs, plan);
}

void HybridSpine::EvictCheckpoint(CachedBlock* node, int g, const SpineRefs& refs, EvictionPlan* plan) {
  KVD_CHECK(groups_[g].kind == KvGroupKind::kState);
  KVD_CHECK(groups_[g].comp[Slot(*node)] != kNone);
  if (node->num_children == 0 && !refs.NodeReferenced(*node)) {
    Cascade(node, refs, plan);
    return;
  }
  plan->components.push_back({node, g, DetachCheckpoint(*node, g)});
  DropUncovered(node, max_need_, refs, plan);
}

bool HybridSpine::EvictWindowBlock(CachedBlock* node, int g, const SpineRefs& refs, EvictionPlan* plan) {
  KVD_CHECK(groups_[g].window());
  const size_t slot = Slot(*node);
  KVD_CHECK(groups_[g].comp[slot] != kNone);
  if (groups_[g].cover[slot] != 0) return false;
  if (node->num_children == 0) {
    if (refs.NodeReferenced(*node)) return false;
    Cascade(node, refs, plan);
    return true;
  }
  plan->components.push_back({node, g, Tombstone(*node, g)});
  return true;
}

bool HybridSpine::WindowBlockEarnsPlace(const CachedBlock& node, int g) const {
  KVD_CHECK(groups_[g].window());
  return !has_state_ || groups_[g].cover[Slot(node)] > 0;
}

absl::Status HybridSpine::CheckInvariants(const PrefixIndex& index, const SpineRefs& refs) const {
  const size_t n = static_cast<size_t>(spine_capacity_);
  std::vector<const CachedBlock*> nodes(n, nullptr);
  absl::Status status;
  auto fail = [&](const CachedBlock* node, int64_t depth, const std::string& what) {
    if (!status.ok()) return;
    status = node == nullptr
                 ? absl::InternalError(absl::StrFormat("pool %d: %s", pool_id_, what))
                 : absl::InternalError(absl::StrFormat("pool %d node %d (depth %d): %s", pool_id_,
                                                       node->address.index, depth, what));
  };
  index.ForEach([&](CachedBlock* node) {
    if (node->address.pool != pool_id_) return;
    if (node->address.index < spine_first_ || node->address.index - spine_first_ >= n) {
      fail(node, -1, "U1: a spine node outside the full group's range");
      return;
    }
    nodes[node->address.index - spine_first_] = node;
  });
  if (!status.ok()) return status;

  // Depths, memoized bottom-up along parent links.
  std::vector<int64_t> depth(n, -1);
  std::vector<const CachedBlock*> path;
  for (size_t i = 0; i < n; ++i) {
    if (nodes[i] == nullptr || depth[i] >= 0) continue;
    path.clear();
    const CachedBlock* c = nodes[i];
    int64_t base = 0;
    while (c != nullptr) {
      const size_t s = Slot(*c);
      if (depth[s] >= 0) {
        base = depth[s];
        break;
      }
      path.push_back(c);
      c = c->parent;
    }
    for (auto it = path.rbegin(); it != path.rend(); ++it) depth[Slot(**it)] = ++base;
  }
  auto group_name = [&](int g) { return groups_[g].name; };

  // U1 (what the side arrays tell) and U6 (range, held once).
  BlockIndex pool_end = 0;
  for (const Group& g : groups_) pool_end = std::max(pool_end, g.end);
  std::vector<uint8_t> seen(pool_end, 0);
  for (int g = 0; g < num_groups(); ++g) {
    if (g == spine_group_) continue;
    const Group& group = groups_[g];
    for (size_t i = 0; i < n; ++i) {
      const BlockIndex c = group.comp[i];
      if (nodes[i] == nullptr) {
        if (c != kNone || (group.window() && group.cover[i] != 0)) {
          fail(nullptr, 0,
               absl::StrFormat("U1: slot %d holds a component of group %s (%d) but no spine node",
                               spine_first_ + i, group_name(g), c == kNone ? -1 : int64_t{c}));
        }
        continue;
      }
      if (c == kNone) {
        if (group.kind == KvGroupKind::kFull) {
          fail(nodes[i], depth[i], absl::StrFormat("U1: node without a block of full group %s", group_name(g)));
        }
        continue;
      }
      if (c < group.first || c >= group.end) {
        fail(nodes[i], depth[i],
             absl::StrFormat("U6: component %d of group %s outside its range [%d, %d)", c, group_name(g),
                             group.first, group.end));
      } else if (seen[c]++ != 0) {
        fail(nodes[i], depth[i], absl::StrFormat("U6: component %d of group %s held twice", c, group_name(g)));
      }
    }
  }
  if (!status.ok()) return status;

  // U2: leaves are servable unless referenced.
  for (size_t i = 0; i < n; ++i) {
    const CachedBlock* node = nodes[i];
    if (node == nullptr || node->num_children != 0 || refs.NodeReferenced(*node)) continue;
    const int g = UnservableBy(*node);
    if (g < 0) continue;
    fail(node, depth[i],
         absl::StrCat("U2: leaf without a ", groups_[g].kind == KvGroupKind::kState ? "checkpoint" : "block",
                      " of group ", group_name(g)));
  }
  if (!status.ok()) return status;

  // U3: checkpoints on the grid (or tails) with their windows; the covers they imply.
  std::vector<std::vector<int32_t>> expected(groups_.size());
  for (int h = 0; h < num_groups(); ++h) {
    if (groups_[h].window()) expected[h].assign(n, 0);
  }
  for (int g = 0; g < num_groups(); ++g) {
    const Group& group = groups_[g];
    if (group.kind != KvGroupKind::kState) continue;
    for (size_t i = 0; i < n; ++i) {
      if (nodes[i] == nullptr || group.comp[i] == kNone) continue;
      const int64_t d = depth[i];
      if (group.depth[i] != d) {
        fail(nodes[i], d, absl::StrFormat("U3: checkpoint of group %s records depth %d", group_name(g), group.depth[i]));
      }
      if (!(d % group.every == 0 || (group.tail[i] != 0 && group.at_end))) {
        fail(nodes[i], d,
             absl::StrFormat("U3: checkpoint of group %s off the %d-block grid and not a tail", group_name(g),
                             group.every));
      }
      for (int h = 0; h < num_groups(); ++h) {
        if (h == spine_group_ || groups_[h].kind == KvGroupKind::kState) continue;
        const CachedBlock* c = nodes[i];
        for (int64_t j = d - 1; j >= d - WindowNeed(h, d); --j, c = c->parent) {
          const size_t s = Slot(*c);
          if (groups_[h].comp[s] == kNone) {
            fail(nodes[i], d,
                 absl::StrFormat("U3: checkpoint of group %s lacks group %s's block at position %d (node %d)",
                                 group_name(g), group_name(h), j, c->address.index));
          }
          if (groups_[h].window()) ++expected[h][s];
        }
      }
    }
  }
  if (!status.ok()) return status;

  // U4: covers agree; in a pool with a state group every unreferenced window block is read.
  for (int h = 0; h < num_groups(); ++h) {
    const Group& group = groups_[h];
    if (!group.window()) continue;
    for (size_t i = 0; i < n; ++i) {
      if (nodes[i] == nullptr) continue;
      if (group.cover[i] != expected[h][i]) {
        fail(nodes[i], depth[i],
             absl::StrFormat("U4: group %s's window cover is %d; %d checkpoints read the block", group_name(h),
                             group.cover[i], expected[h][i]));
      }
      if (has_state_ && group.comp[i] != kNone && expected[h][i] == 0 &&
          !refs.ComponentReferenced(group.comp[i])) {
        fail(nodes[i], depth[i],
             absl::StrFormat("U4: window block %d of group %s is read by no checkpoint below it", group.comp[i],
                             group_name(h)));
      }
    }
  }
  return status;
}

}  // namespace kvd
