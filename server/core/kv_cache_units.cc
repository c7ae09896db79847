// KvCache: a hybrid pool's units in and out of the lower tiers (docs/hybrid.md §2.9). A spine node
// leaves G1 with the components that hang off it (CarryOutPlanLocked holds them with it for the
// sink's copy, HeldBlock::parts); a tier brings units back into G1 before a lookup
// (BeginInstall / FinishInstall), which then runs §2.6 over G1 as for any hit, so what came back
// serves only where every group can.
#include <algorithm>
#include <array>

#include "absl/strings/str_cat.h"
#include "proto/vocab/status_macros.h"
#include "server/core/kv_cache.h"

namespace kvd {

std::vector<UnitComponent> KvCache::UnitPartsLocked(const Pool& pool, const CachedBlock& node) const {
  std::vector<UnitComponent> parts;
  if (pool.spine == nullptr) return parts;
  const HybridSpine& spine = *pool.spine;
  for (int g = 0; g < spine.num_groups(); ++g) {
    if (g == spine.spine_group()) continue;
    if (pool.geometry.groups[g].attention()) {
      if (const BlockIndex b = spine.block(node, g); b != HybridSpine::kNone) parts.push_back({g, b, false});
    } else if (const BlockIndex slot = spine.checkpoint(node, g); slot != HybridSpine::kNone) {
      parts.push_back({g, slot, spine.checkpoint_is_tail(node, g)});
    }
  }
  return parts;
}

std::vector<BlockIndex> KvCache::TakeHeldLocked(PoolId pool_id, int group, int64_t max, uint64_t owner) {
  std::vector<BlockIndex> out;
  if (max <= 0) return out;
  Pool& pool = *pools_[pool_id];
  const auto consider = [&](BlockIndex b) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (static_cast<int64_t>(out.size()) >= max || pool.allocator.GroupOf(b) != group) return;
    BlockState& s = pool.blocks[b];
    // Held for the copy and for nothing else: not yet handed to anyone.
    if (s.kind != BlockState::Kind::kOwned || s.owner != 0 || s.refs != 1) return;
    s.owner = owner;
    ++s.refs;
    out.push_back(b);
  };
  for (const cache_state::PendingDemotion& d : cache_state::ThreadDemotions()) {
    if (d.cache != this || d.block.pool != pool_id) continue;
    consider(d.block.index);
    for (const UnitComponent& part : d.block.parts) consider(part.index);
  }
  return out;
}

absl::StatusOr<int64_t> KvCache::SpineMatch(const Namespace& ns, absl::Span<const Token> prompt) {
  KVD_ASSIGN_OR_RETURN(PoolId id, FindPool(ns.pool));
  const PoolGeometry& g = pool_geometries_[id];
  const int64_t len = std::min<int64_t>(static_cast<int64_t>(prompt.size()), g.max_model_len);
  if (len <= 0) return 0;
  const std::vector<BlockKey> keys = ChainKeys(ns, prompt.first(static_cast<size_t>(len)), g.block_tokens,
                                               (len - 1) / g.block_tokens);
  absl::MutexLock lock(&mu_);
  const Pool& pool = *pools_[id];
  if (pool.spine == nullptr) return 0;
  return static_cast<int64_t>(index_.Match(index_.FindRoot(ns), prompt.first(static_cast<size_t>(len)),
                                           g.block_tokens, MaxHitBlocks(pool, len), keys)
                                  .size());
}

absl::StatusOr<TierPort::UnitInstall> KvCache::BeginInstall(const Namespace& ns, absl::Span<const Token> prompt,
                                                            int64_t first_depth,
                                                            std::vector<std::vector<UnitComponent>> units) {
  KVD_ASSIGN_OR_RETURN(PoolId id, FindPool(ns.pool));
  const PoolGeometry& geo = pool_geometries_[id];
  const int32_t bt = geo.block_tokens;
  const int64_t n = static_cast<int64_t>(units.size());
  const int64_t len = std::min<int64_t>(static_cast<int64_t>(prompt.size()), geo.max_model_len);
  if (n == 0 || first_depth < 0 || len <= 0 || first_depth + n > (len - 1) / bt) {
    return absl::InvalidArgumentError(absl::StrCat("units [", first_depth, ", ", first_depth + n,
                                                   ") do not lie within the prompt's ", len, " tokens"));
  }
  const std::vector<BlockKey> keys =
      ChainKeys(ns, prompt.first(static_cast<size_t>(first_depth * bt)), bt, first_depth);
  absl::StatusOr<UnitInstall> result;
  {
    absl::MutexLock lock(&mu_);
    ExpireLocked(nullptr);
    result = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> absl::StatusOr<UnitInstall> {
      Pool& pool = *pools_[id];
      if (pool.spine == nullptr) {
        return absl::FailedPreconditionError(absl::StrCat("pool '", geo.name, "' has no spine to install units on"));
      }
      const int spine_group = pool.spine->spine_group();
      std::vector<int64_t> per_group(geo.groups.size(), 0);
      per_group[spine_group] = n;
      for (const std::vector<UnitComponent>& parts : units) {
        std::vector<bool> seen(geo.groups.size(), false);
        for (const UnitComponent& p : parts) {
          if (p.group < 0 || p.group >= static_cast<int>(geo.groups.size()) || p.group == spine_group ||
              seen[p.group] || (p.tail && geo.groups[p.group].attention())) {
            return absl::InvalidArgumentError(absl::StrCat("a unit names group ", p.group, " of pool '", geo.name,
                                                           "' twice, or one that cannot hang off the spine"));
          }
          seen[p.group] = true;
          ++per_group[p.group];
        }
      }
      const std::vector<CachedBlock*> chain =
          index_.Match(index_.FindRoot(ns), prompt.first(static_cast<size_t>(first_depth * bt)), bt, first_depth, keys);
      if (static_cast<int64_t>(chain.size()) != first_depth) {
        return absl::FailedPreconditionError("the device tier's match changed since the tier looked");
      }
      // Reserved while held, so that admission counts them (and they cannot take the units
      // admitted requests are owed).
      KVD_RETURN_IF_ERROR(ledger_.ReserveUnits(id, per_group));
      UnitInstall install;
      install.pool = id;
      install.first_depth = first_depth;
      for (CachedBlock* node : chain) {
        HoldLocked(id, node->address.index);
        install.chain.push_back(node->address.index);
      }
      std::vector<std::vector<BlockIndex>> got(geo.groups.size());
      for (size_t g = 0; g < geo.groups.size(); ++g) {
        if (per_group[g] == 0) continue;
        absl::StatusOr<std::vector<BlockIndex>> blocks =
            AllocateOwnedLocked(id, per_group[g], /*owner=*/0, /*writer=*/nullptr, static_cast<int>(g));
        if (!blocks.ok()) {
          for (const std::vector<BlockIndex>& taken : got) {
            for (BlockIndex b : taken) UnrefLocked(id, b);  // owned by nobody: freed
          }
          for (auto it = install.chain.rbegin(); it != install.chain.rend(); ++it) UnholdLocked(id, *it);
          ledger_.UnreserveUnits(id, per_group);
          return blocks.status();
        }
        got[g] = *std::move(blocks);
      }
      // Held like a demotion's (owned by nobody, pinned) until FinishInstall.
      for (const std::vector<BlockIndex>& taken : got) {
        for (BlockIndex b : taken) ++pool.pins[b];
      }
      std::vector<size_t> next(geo.groups.size(), 0);
      for (std::vector<UnitComponent>& parts : units) {
        install.spine.push_back(got[spine_group][next[spine_group]++]);
        for (UnitComponent& p : parts) p.index = got[p.group][next[p.group]++];
        install.parts.push_back(std::move(parts));
      }
      UpdatePressureLocked();
      return install;
    }();
  }
  Deliver();  // the copies of what making room demoted, before the caller writes these blocks
  return result;
}

int64_t KvCache::FinishInstall(const Namespace& ns, absl::Span<const Token> prompt, UnitInstall install,
                               int64_t written) {
  const PoolId id = install.pool;
  const PoolGeometry& geo = pool_geometries_[id];
  const int32_t bt = geo.block_tokens;
  const int64_t n = static_cast<int64_t>(install.spine.size());
  written = std::clamp<int64_t>(written, 0, n);
  const int64_t end = install.first_depth + n;
  const std::vector<BlockKey> keys = ChainKeys(ns, prompt.first(static_cast<size_t>(end * bt)), bt, end);
  int64_t installed = 0;
  {
    absl::MutexLock lock(&mu_);
    ExpireLocked(nullptr);
    Pool& pool = *pools_[id];
    HybridSpine& spine = *pool.spine;
    std::vector<const CachedBlock*> path;
    for (BlockIndex b : install.chain) path.push_back(pool.blocks[b].node);  // held: still cached
    CachedBlock* parent = install.chain.empty() ? nullptr : pool.blocks[install.chain.back()].node;
    NamespaceRoot* root = index_.GetOrCreateRoot(ns, id);
    // Blocks to let go of, in this order: accepted checkpoints, window blocks, unused blocks,
    // then spine nodes deepest first, then the chain (deepest first), so that U2-U4 judge each
    // unit once everything it reads is in place.
    std::vector<BlockIndex> states, windows, unused, nodes;
    const auto to_component = [&](BlockIndex b, const CachedBlock& node, int g) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      BlockState& s = pool.blocks[b];
      KVD_CHECK(s.kind == BlockState::Kind::kOwned && s.owner == 0 && s.refs == 1);
      s.kind = BlockState::Kind::kCached;
      s.node = nullptr;
      --pool.num_owned;
      ++pool.num_cached;
      ++pool.side[g].cached;
      pool.component_node[b] = const_cast<CachedBlock*>(&node);
    };
    for (int64_t i = 0; i < n; ++i) {
      const int64_t pos = install.first_depth + i;
      const absl::Span<const Token> tokens = prompt.subspan(static_cast<size_t>(pos * bt), static_cast<size_t>(bt));
      CachedBlock* node = nullptr;
      if (i < written && index_.FindChild(*root, parent, tokens, &keys[pos]) == nullptr) {
        node = CacheBlockLocked(id, root, parent, install.spine[i], tokens, &keys[pos]);
      }
      if (node == nullptr) {  // not written, or published (or colliding) meanwhile: the run ends
        written = i;
        unused.push_back(install.spine[i]);
        for (const UnitComponent& p : install.parts[i]) unused.push_back(p.index);
        continue;
      }
      ++installed;
      nodes.push_back(node->address.index);
      path.push_back(node);
      for (const UnitComponent& p : install.parts[i]) {  // window blocks before the checkpoints reading them
        if (!geo.groups[p.group].attention()) continue;
        to_component(p.index, *node, p.group);
        spine.AttachBlock(*node, p.group, p.index);
        windows.push_back(p.index);
      }
      for (const UnitComponent& p : install.parts[i]) {
        if (geo.groups[p.group].attention()) continue;
        if (spine.CanAcceptCheckpoint(p.group, path, pos + 1, p.tail) != CheckpointOutcome::kKept) {
          unused.push_back(p.index);  // its window did not come back (or one exists): never served
          continue;
        }
        to_component(p.index, *node, p.group);
        spine.AttachCheckpoint(*node, p.group, p.index, pos + 1, p.tail);
        states.push_back(p.index);
      }
      parent = node;
    }
    // What U2-U4 drop now goes at once: the tier still holds it.
    side_pressure_ = true;
    for (BlockIndex b : states) UnholdLocked(id, b);
    for (BlockIndex b : windows) UnholdLocked(id, b);
    for (BlockIndex b : unused) UnholdLocked(id, b);  // owned by nobody: freed
    for (auto it = nodes.rbegin(); it != nodes.rend(); ++it) UnholdLocked(id, *it);
    for (auto it = install.chain.rbegin(); it != install.chain.rend(); ++it) UnholdLocked(id, *it);
    side_pressure_ = false;
    std::vector<int64_t> per_group(geo.groups.size(), 0);
    per_group[spine.spine_group()] = n;
    for (const std::vector<UnitComponent>& parts : install.parts) {
      for (const UnitComponent& p : parts) ++per_group[p.group];
    }
    ledger_.UnreserveUnits(id, per_group);
    UpdatePressureLocked();
  }
  Deliver();
  return installed;
}

absl::StatusOr<int64_t> KvCache::PeekInstalled(const Namespace& ns, absl::Span<const Token> prompt,
                                               int64_t first_depth,
                                               absl::Span<const std::vector<UnitComponent>> units) const {
  KVD_ASSIGN_OR_RETURN(PoolId id, FindPool(ns.pool));
  const PoolGeometry& geo = pool_geometries_[id];
  const int32_t bt = geo.block_tokens;
  const int64_t len = std::min<int64_t>(static_cast<int64_t>(prompt.size()), geo.max_model_len);
  if (len <= 0) return 0;
  const absl::Span<const Token> capped = prompt.first(static_cast<size_t>(len));
  const std::vector<BlockKey> keys = ChainKeys(ns, capped, bt, (len - 1) / bt);
  const int num_groups = static_cast<int>(geo.groups.size());
  const int64_t n = static_cast<int64_t>(units.size());
  absl::MutexLock lock(&mu_);
  const Pool& pool = *pools_[id];
  if (pool.spine == nullptr) return 0;
  const HybridSpine& spine = *pool.spine;
  const int spine_group = spine.spine_group();
  const std::vector<CachedBlock*> chain =
      index_.Match(index_.FindRoot(ns), capped, bt, MaxHitBlocks(pool, len), keys);
  HybridHit g1;
  spine.Lookup(absl::Span<const CachedBlock* const>(chain.data(), chain.size()), &g1);
  if (n == 0 || first_depth < 0 || static_cast<int64_t>(chain.size()) != first_depth ||
      first_depth + n > MaxHitBlocks(pool, len)) {
    return g1.depth * bt;
  }
  // BeginInstall reserves every unit: without room now the start would install nothing.
  std::vector<int64_t> per_group(geo.groups.size(), 0);
  per_group[spine_group] = n;
  for (const std::vector<UnitComponent>& parts : units) {
    for (const UnitComponent& p : parts) {
      if (p.group < 0 || p.group >= num_groups || p.group == spine_group) return g1.depth * bt;
      ++per_group[p.group];
    }
  }
  if (!ledger_.CanReserveUnits(id, per_group)) return g1.depth * bt;
  // has[(d - 1) * num_groups + g]: the node at depth d would hold group g's block or checkpoint.
  const int64_t total = first_depth + n;
  std::vector<uint8_t> has(static_cast<size_t>(total * num_groups), 0);
  const auto at = [&](int64_t depth, int g) -> uint8_t& {
    return has[static_cast<size_t>((depth - 1) * num_groups + g)];
  };
  for (int64_t d = 1; d <= first_depth; ++d) {
    for (int g = 0; g < num_groups; ++g) {
      at(d, g) = g == spine_group || spine.block(*chain[d - 1], g) != HybridSpine::kNone;  // block or slot
    }
  }
  // FinishInstall: every unit's window blocks, then its checkpoints where §2.7 keeps them (their
  // window is there, in G1 or in the run; a unit's own blocks never read a deeper one).
  for (int64_t i = 0; i < n; ++i) {
    at(first_depth + i + 1, spine_group) = 1;
    for (const UnitComponent& p : units[i]) {
      if (geo.groups[p.group].attention()) at(first_depth + i + 1, p.group) = 1;
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    const int64_t d = first_depth + i + 1;
    for (const UnitComponent& p : units[i]) {
      const KvGroup& group = geo.groups[p.group];
      if (group.attention()) continue;
      bool kept = d % group.checkpoint_every_blocks == 0 || (p.tail && group.checkpoint_at_end);
      for (int h = 0; kept && h < num_groups; ++h) {
        if (h == spine_group || !geo.groups[h].attention()) continue;
        for (int64_t j = d - spine.WindowNeed(h, d); kept && j < d; ++j) kept = at(j + 1, h) != 0;
      }
      at(d, p.group) = kept;
    }
  }
  // U2 from the run's deepest unit up: an unservable leaf goes, and its parent is a leaf next.
  int64_t end = total;
  while (end > first_depth) {
    bool servable = true;
    bool any_state = false;
    for (int g = 0; g < num_groups && servable; ++g) {
      if (geo.groups[g].kind != KvGroupKind::kState) continue;
      any_state = true;
      servable = at(end, g) != 0;
    }
    for (int g = 0; g < num_groups && servable; ++g) {
      if (g == spine_group || geo.groups[g].kind == KvGroupKind::kState || at(end, g) != 0) continue;
      servable = any_state && spine.WindowNeed(g, end) == 0;
    }
    if (servable) break;
    --end;
  }
  // §2.6 over the combined chain n_1 .. n_end (HybridSpine::Lookup's pass).
  std::array<int64_t, kMaxKvGroups> run{};
  int64_t best = 0;
  for (int64_t d = 1; d <= end; ++d) {
    bool all = true;
    for (int g = 0; g < num_groups; ++g) {
      if (g == spine_group) continue;
      if (geo.groups[g].kind == KvGroupKind::kState) {
        all = all && at(d, g) != 0;
      } else {
        run[g] = at(d, g) != 0 ? run[g] + 1 : 0;
        all = all && run[g] >= spine.WindowNeed(g, d);
      }
    }
    if (all) best = d;
  }
  return std::max(best, g1.depth) * bt;
}

}  // namespace kvd
