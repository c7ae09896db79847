// KvCache: the spine of a hybrid pool with a full group (docs/hybrid.md §2.6-2.8). Publish attaches
// the request's blocks of the other groups and its state checkpoints to the spine's nodes; a hit
// runs HybridSpine::Lookup over the spine's match; evictions carry out HybridSpine's plans (a
// unit and its cascade) under the engine lock. Pools without a spine never reach this file.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "proto/vocab/status_macros.h"
#include "server/core/kv_cache.h"

namespace kvd {

void KvCache::LookupHybridLocked(const Pool& pool, const Namespace& ns, absl::Span<const Token> prompt,
                                 absl::Span<const BlockKey> keys, std::vector<CachedBlock*>* chain,
                                 HybridHit* hit) const {
  *chain = index_.Match(index_.FindRoot(ns), prompt, pool.geometry.block_tokens,
                        MaxHitBlocks(pool, static_cast<int64_t>(prompt.size())), keys);
  pool.spine->Lookup(absl::Span<const CachedBlock* const>(chain->data(), chain->size()), hit);
}

absl::Status KvCache::CheckStateCheckpointsLocked(const Request& req,
                                                  absl::Span<const StateCheckpoint> checkpoints) const {
  if (checkpoints.empty()) return absl::OkStatus();
  const Pool& pool = *pools_[req.pool];
  if (pool.spine == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("state_checkpoints: pool '", pool.geometry.name,
                                                   "' has no state group (or no full group to index them)"));
  }
  std::vector<BlockIndex> seen;
  for (const StateCheckpoint& c : checkpoints) {
    if (c.group < 0 || c.group >= static_cast<int>(pool.geometry.groups.size()) ||
        pool.geometry.groups[c.group].kind != KvGroupKind::kState) {
      return absl::InvalidArgumentError(absl::StrCat("state_checkpoints: group ", c.group, " of pool '",
                                                     pool.geometry.name, "' is not a state group"));
    }
    if (c.position_tokens < 0) {
      return absl::InvalidArgumentError(absl::StrCat("state_checkpoints: position_tokens ", c.position_tokens));
    }
    const std::vector<BlockIndex>& mine = req.groups[c.group].blocks;
    if (std::find(mine.begin(), mine.end(), c.slot) == mine.end() ||
        std::find(seen.begin(), seen.end(), c.slot) != seen.end()) {
      return absl::InvalidArgumentError(absl::StrCat("state_checkpoints: slot ", c.slot, " is not one of request '",
                                                     req.spec.id.value(), "''s slots of group '",
                                                     pool.geometry.groups[c.group].name, "' (or named twice)"));
    }
    seen.push_back(c.slot);
  }
  return absl::OkStatus();
}

void KvCache::PublishSideLocked(Request& req, absl::Span<const StateCheckpoint> checkpoints, bool end,
                                PublishResult& published) {
  Pool& pool = *pools_[req.pool];
  if (pool.spine == nullptr) return;
  HybridSpine& spine = *pool.spine;
  const Owner writer = WriterOf(req);
  // The request's chain as the spine holds it now: its table's cached prefix.
  std::vector<const CachedBlock*> chain;
  for (BlockIndex b : req.table) {
    const BlockState& s = pool.blocks[b];
    if (s.kind != BlockState::Kind::kCached) break;
    chain.push_back(s.node);
  }
  // Blocks first: a checkpoint's window must be attached before it (HybridSpine::AttachCheckpoint).
  std::vector<HeldWindow> held(req.groups.size());
  for (size_t g = 0; g < req.groups.size(); ++g) {
    if (static_cast<int>(g) == pool.spine_group || !pool.geometry.groups[g].attention()) continue;
    Request::Group& rg = req.groups[g];
    held[g] = HeldWindow{rg.first, rg.first + static_cast<int64_t>(rg.blocks.size())};
    for (size_t i = 0; i < rg.blocks.size(); ++i) {
      const int64_t pos = rg.first + static_cast<int64_t>(i);
      if (pos >= static_cast<int64_t>(chain.size())) break;
      const BlockIndex b = rg.blocks[i];
      BlockState& s = pool.blocks[b];
      if (s.kind != BlockState::Kind::kOwned || s.owner != req.serial) continue;  // a hit's cached block
      const CachedBlock& node = *chain[pos];
      if (spine.block(node, static_cast<int>(g)) != HybridSpine::kNone) continue;  // the node has one
      const Owner* w = owners_.OwnerOf(req.pool, b);
      if (w != nullptr && !(*w == writer)) continue;  // a pull still writes it
      // Published bytes are never rewritten: the request writes it no more.
      if (w != nullptr) KVD_CHECK(owners_.Release(req.pool, b, writer).ok());
      s.kind = BlockState::Kind::kCached;
      s.owner = 0;
      s.node = nullptr;
      --pool.num_owned;
      ++pool.num_cached;
      ++pool.side[g].cached;
      pool.component_node[b] = const_cast<CachedBlock*>(&node);
      spine.AttachBlock(node, static_cast<int>(g), b);
    }
  }
  const int32_t bt = pool.geometry.block_tokens;
  const int64_t published_blocks = static_cast<int64_t>(published.outcomes.size());
  for (const StateCheckpoint& c : checkpoints) {
    const int g = c.group;
    const int64_t depth = c.position_tokens / bt;
    const bool tail = end && depth == published_blocks;
    const CheckpointOutcome outcome =
        c.position_tokens % bt != 0 ? CheckpointOutcome::kNotAligned
                                    : spine.CanAcceptCheckpoint(g, chain, depth, tail, held);
    published.checkpoint_outcomes.push_back(outcome);
    published.fresh_slots.push_back(-1);
    if (outcome != CheckpointOutcome::kKept) continue;
    std::vector<BlockIndex>& slots = req.groups[g].blocks;
    const auto at = std::find(slots.begin(), slots.end(), c.slot);
    KVD_CHECK(at != slots.end());
    const size_t k = static_cast<size_t>(at - slots.begin());
    BlockState& s = pool.blocks[c.slot];
    KVD_CHECK(s.kind == BlockState::Kind::kOwned && s.owner == req.serial && s.refs == 1);
    if (const Owner* w = owners_.OwnerOf(req.pool, c.slot); w != nullptr && *w == writer) {
      KVD_CHECK(owners_.Release(req.pool, c.slot, writer).ok());
    }
    // The slot is the pool's now, unreferenced: an immutable checkpoint its group may evict.
    s.kind = BlockState::Kind::kCached;
    s.owner = 0;
    s.refs = 0;
    s.node = nullptr;
    --pool.num_owned;
    ++pool.num_cached;
    ++pool.num_cached_unreferenced;
    cache_state::Pool::SideGroup& sg = pool.side[g];
    ++sg.cached;
    sg.evictable.Push(c.slot);
    const CachedBlock& node = *chain[depth - 1];
    pool.component_node[c.slot] = const_cast<CachedBlock*>(&node);
    spine.AttachCheckpoint(node, g, c.slot, depth, tail);
    slots.erase(at);
    // A fresh spare in its place, within the request's reservation (the kept one is uncharged).
    absl::StatusOr<std::vector<BlockIndex>> fresh = AllocateOwnedLocked(req.pool, 1, req.serial, &writer, g);
    if (fresh.ok()) {
      slots.insert(slots.begin() + static_cast<std::ptrdiff_t>(k), fresh->front());
      published.fresh_slots.back() = fresh->front();
    }
  }
}

void KvCache::ReorderReleasedWindowsLocked(const Request& req) {
  Pool& pool = *pools_[req.pool];
  if (pool.spine == nullptr) return;
  // The request's chain in the spine ends at its table's cached prefix: a hit there (the next turn
  // continuing it) reads each window group's blocks before it; every earlier one is interior,
  // unless the request's own hit read it (those stay hot, §2.8).
  int64_t leaf = 0;
  while (leaf < static_cast<int64_t>(req.table.size()) &&
         pool.blocks[req.table[leaf]].kind == BlockState::Kind::kCached) {
    ++leaf;
  }
  const int64_t read_end = req.cached_tokens / pool.geometry.block_tokens;
  for (size_t g = 0; g < req.groups.size(); ++g) {
    const KvGroupKind kind = pool.geometry.groups[g].kind;
    if (kind != KvGroupKind::kSlidingWindow && kind != KvGroupKind::kChunkedLocal) continue;
    const int64_t keep_from = leaf - pool.spine->WindowNeed(static_cast<int>(g), leaf);
    const Request::Group& rg = req.groups[g];
    // Shallow first: the shallowest interior block is the oldest.
    for (size_t i = 0; i < rg.blocks.size() && rg.first + static_cast<int64_t>(i) < keep_from; ++i) {
      const int64_t pos = rg.first + static_cast<int64_t>(i);
      if (pos < read_end || pool.spine->WindowAnchor(static_cast<int>(g), pos)) continue;
      pool.side[g].evictable.MakeInterior(rg.blocks[i]);
    }
  }
}

void KvCache::FreeComponentLocked(Pool& pool, BlockIndex index) {
  BlockState& s = pool.blocks[index];
  KVD_CHECK(s.kind == BlockState::Kind::kCached && s.refs == 0 && s.node == nullptr);
  cache_state::Pool::SideGroup& sg = pool.side[pool.allocator.GroupOf(index)];
  KVD_CHECK(sg.evictable.contains(index));
  sg.evictable.Erase(index);
  --sg.cached;
  --pool.num_cached;
  --pool.num_cached_unreferenced;
  s.kind = BlockState::Kind::kFree;
  pool.component_node[index] = nullptr;
  pool.allocator.Free(index);
}

void KvCache::CarryOutPlanLocked(Pool& pool, EvictReason reason) {
  // With a sink, every node goes down as one unit with the components the plan drops with it
  // (docs/hybrid.md §2.9); a component that goes alone (a tombstone, a dropped internal
  // checkpoint) is freed. The pairing is computed before any node leaves the index.
  const bool demote = sink_ != nullptr && reason != EvictReason::kClear && !side_pressure_;
  std::vector<std::vector<UnitComponent>> parts(demote ? pool.plan.nodes.size() : 0);
  std::vector<bool> with_node(pool.plan.components.size(), false);
  if (demote) {
    for (size_t c = 0; c < pool.plan.components.size(); ++c) {
      const SpineDrop& d = pool.plan.components[c];
      for (size_t n = 0; n < pool.plan.nodes.size(); ++n) {
        if (pool.plan.nodes[n] != d.node) continue;
        parts[n].push_back(UnitComponent{d.group, d.index, d.tail});
        with_node[c] = true;
        break;
      }
    }
    for (std::vector<UnitComponent>& p : parts) {
      std::sort(p.begin(), p.end(), [](const UnitComponent& a, const UnitComponent& b) { return a.group < b.group; });
    }
  }
  for (size_t n = 0; n < pool.plan.nodes.size(); ++n) {
    EvictNodeLocked(pool, pool.plan.nodes[n], reason, demote ? &parts[n] : nullptr);
  }
  for (size_t c = 0; c < pool.plan.components.size(); ++c) {
    const BlockIndex index = pool.plan.components[c].index;
    if (with_node[c]) {
      // Held for the sink's copy with its node (RunDemotions lets it go): owned by nobody,
      // pinned, not free.
      BlockState& s = pool.blocks[index];
      KVD_CHECK(s.kind == BlockState::Kind::kCached && s.refs == 0 && s.node == nullptr);
      cache_state::Pool::SideGroup& sg = pool.side[pool.allocator.GroupOf(index)];
      KVD_CHECK(sg.evictable.contains(index));
      sg.evictable.Erase(index);
      --sg.cached;
      --pool.num_cached;
      --pool.num_cached_unreferenced;
      pool.component_node[index] = nullptr;
      s.kind = BlockState::Kind::kOwned;
      s.owner = 0;
      s.refs = 1;
      ++pool.pins[index];
      ++pool.num_owned;
    } else {
      FreeComponentLocked(pool, index);
    }
    ++counters_.evictions[static_cast<int>(reason)];
  }
  pool.plan.clear();
}

void KvCache::AfterLastUnrefLocked(Pool& pool, BlockIndex index) {
  HybridSpine& spine = *pool.spine;
  const int g = pool.allocator.GroupOf(index);
  if (g == spine.spine_group()) {
    CachedBlock* node = pool.blocks[index].node;
    if (node->num_children == 0 && !spine.LeafServable(*node)) EvictOneLocked(pool, node, EvictReason::kGc);
    return;
  }
  const KvGroupKind kind = pool.geometry.groups[g].kind;
  if (kind != KvGroupKind::kSlidingWindow && kind != KvGroupKind::kChunkedLocal) return;
  const CachedBlock& node = *pool.component_node[index];
  if (spine.WindowBlockEarnsPlace(node, g)) return;
  KVD_CHECK(spine.Tombstone(node, g) == index);
  FreeComponentLocked(pool, index);
}

bool KvCache::EvictSideLocked(Pool& pool, int g) {
  HybridSpine& spine = *pool.spine;
  const cache_state::PoolRefs refs(pool);
  cache_state::Pool::SideGroup& sg = pool.side[g];
  const KvGroupKind kind = pool.geometry.groups[g].kind;
  if (kind == KvGroupKind::kState) {
    if (sg.evictable.empty()) return false;
    spine.EvictCheckpoint(pool.component_node[sg.evictable.hot().front()], g, refs, &pool.plan);
    CarryOutPlanLocked(pool, EvictReason::kCapacity);
    return true;
  }
  if (kind == KvGroupKind::kFull) {  // a further full group's block goes only with its node (U1)
    for (BlockIndex b : sg.evictable.hot()) {  // oldest first
      CachedBlock* node = pool.component_node[b];
      if (node->num_children != 0 || refs.NodeReferenced(*node)) continue;
      EvictOneLocked(pool, node, EvictReason::kCapacity);
      return true;
    }
  } else if (!spine.has_state_group() && !sg.evictable.empty()) {
    // Without a state group no checkpoint reads a window block (U3): the queue's victim goes. With
    // one, every evictable window block is read by a checkpoint (U4) and none may go alone, so
    // pressure goes to the checkpoints below (O(1), no pass over the group's blocks).
    const BlockIndex b = sg.evictable.Victim();
    CachedBlock* node = pool.component_node[b];
    if (!spine.EvictWindowBlock(node, g, refs, &pool.plan)) {
      // A referenced leaf: U2 binds it once it is unreferenced (AfterLastUnrefLocked erases it then).
      pool.plan.components.push_back({node, g, spine.Tombstone(*node, g)});
    }
    CarryOutPlanLocked(pool, EvictReason::kCapacity);
    return true;
  }
  // Every evictable block of g is read by a checkpoint, each of them unreferenced (a hit
  // references the window it reads): checkpoints go first, oldest first, then spine leaves.
  for (size_t h = 0; h < pool.side.size(); ++h) {
    if (pool.geometry.groups[h].kind != KvGroupKind::kState || pool.side[h].evictable.empty()) continue;
    spine.EvictCheckpoint(pool.component_node[pool.side[h].evictable.hot().front()], static_cast<int>(h), refs,
                          &pool.plan);
    CarryOutPlanLocked(pool, EvictReason::kCapacity);
    return true;
  }
  if (CachedBlock* victim = pool.queue.Peek(); victim != nullptr) {
    EvictOneLocked(pool, victim, EvictReason::kCapacity);
    return true;
  }
  return false;
}

}  // namespace kvd
