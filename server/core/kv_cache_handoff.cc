// KvCache: export and import of the cached state at a hot handoff (cache_snapshot.h).
#include <algorithm>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "server/core/kv_cache.h"
#include "proto/vocab/status_macros.h"

namespace kvd {

CacheSnapshot KvCache::ExportSnapshot() const {
  CacheSnapshot out;
  absl::MutexLock lock(&mu_);
  // Depth first, so that sorting by depth puts every parent before its children.
  std::vector<std::pair<int64_t, const CachedBlock*>> by_depth;
  by_depth.reserve(index_.num_blocks());
  index_.ForEach([&by_depth](const CachedBlock* b) {
    int64_t depth = 0;
    for (const CachedBlock* p = b->parent; p != nullptr; p = p->parent) ++depth;
    by_depth.emplace_back(depth, b);
  });
  std::stable_sort(by_depth.begin(), by_depth.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  absl::flat_hash_map<const CachedBlock*, int64_t> position;
  absl::flat_hash_map<const NamespaceRoot*, uint32_t> ns_position;
  position.reserve(by_depth.size());
  out.blocks.reserve(by_depth.size());
  for (const auto& [depth, b] : by_depth) {
    auto [ns_it, added] = ns_position.try_emplace(b->root, static_cast<uint32_t>(out.namespaces.size()));
    if (added) out.namespaces.push_back(b->root->ns);
    CacheSnapshot::Block& e = out.blocks.emplace_back();
    e.pool = b->address.pool;
    e.index = b->address.index;
    e.parent = b->parent != nullptr ? position.at(b->parent) : -1;
    e.ns = ns_it->second;
    e.last_use = b->last_use;
    e.reused = b->reused;
    const absl::Span<const Token> tokens = index_.TokensOf(*b);
    e.tokens.assign(tokens.begin(), tokens.end());
    ExportComponentsLocked(*pools_[b->address.pool], *b, &e);
    position.emplace(b, static_cast<int64_t>(out.blocks.size()) - 1);
  }
  const absl::Time now = clock_->Now();
  absl::flat_hash_map<Namespace, uint32_t> ns_index;
  for (uint32_t i = 0; i < out.namespaces.size(); ++i) ns_index.emplace(out.namespaces[i], i);
  for (const auto& [id, ckpt] : checkpoints_) {
    if (!ckpt->orphaned || ckpt->expires_at <= now) continue;  // live ones end before an export
    CacheSnapshot::Checkpoint& c = out.checkpoints.emplace_back();
    c.id = id;
    auto [it, added] = ns_index.try_emplace(ckpt->ns, static_cast<uint32_t>(out.namespaces.size()));
    if (added) out.namespaces.push_back(ckpt->ns);
    c.ns = it->second;
    c.tokens = ckpt->tokens;
    c.engine_state = ckpt->engine_state;
    c.blocks = ckpt->blocks;
    c.expires_at = ckpt->expires_at;
    for (BlockIndex b : ckpt->blocks) {
      const BlockState& st = pools_[ckpt->pool]->blocks[b];
      c.cached.push_back(st.kind == BlockState::Kind::kCached ? position.at(st.node) : -1);
    }
    for (const CheckpointRecord::Group& g : ckpt->groups) {  // a hybrid pool's window blocks and state
      CacheSnapshot::Checkpoint::Group& e = c.groups.emplace_back();
      e.first = g.first;
      e.blocks = g.blocks;
      for (BlockIndex b : g.blocks) e.cached.push_back(pools_[ckpt->pool]->blocks[b].kind == BlockState::Kind::kCached);
      e.slot = g.slot;
    }
  }
  out.fences_known = true;
  // What is left of each: the successor's clock is another process's monotonic clock.
  for (const auto& [key, f] : fences_) {
    if (f.until <= now) continue;
    out.fences.push_back(CacheSnapshot::Fence{
        .pid = f.pid, .attachment = f.attachment, .pool = f.pool, .blocks = f.blocks, .remaining = f.until - now});
  }
  for (const auto& [id, session] : sessions_) {
    if (session.expires_at <= now) continue;
    CacheSnapshot::Session& s = out.sessions.emplace_back();
    s.id = id;
    s.salt = session.salt;
    s.worker = session.worker;
    s.expires_at = session.expires_at;
    for (const ProtectedRef& ref : session.protected_blocks) {
      const BlockState& st = pools_[ref.pool]->blocks[ref.index];
      if (st.kind == BlockState::Kind::kCached && st.node->serial == ref.node_serial) {
        s.protected_blocks.push_back(position.at(st.node));
      }
    }
  }
  return out;
}

absl::StatusOr<int64_t> KvCache::ImportSnapshot(const CacheSnapshot& snap) {
  // Everything a field can be checked against is fixed at Create: check before the lock.
  const int64_t n = static_cast<int64_t>(snap.blocks.size());
  for (size_t i = 0; i < snap.namespaces.size(); ++i) {
    if (!FindPool(snap.namespaces[i].pool).ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("snapshot namespace ", i, " names pool '", snap.namespaces[i].pool, "', which is not configured"));
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    const CacheSnapshot::Block& b = snap.blocks[i];
    const auto bad = [i](absl::string_view what) {
      return absl::InvalidArgumentError(absl::StrCat("snapshot block ", i, ": ", what));
    };
    if (b.pool >= pool_geometries_.size()) return bad(absl::StrCat("pool ", b.pool, " is not configured"));
    const PoolGeometry& g = pool_geometries_[b.pool];
    if (b.index >= static_cast<uint64_t>(g.capacity_blocks)) {
      return bad(absl::StrCat("block index ", b.index, " is past pool '", g.name, "' (", g.capacity_blocks, " blocks)"));
    }
    if (static_cast<int64_t>(b.tokens.size()) != g.block_tokens) {
      return bad(absl::StrCat(b.tokens.size(), " tokens, pool '", g.name, "' has ", g.block_tokens, "-token blocks"));
    }
    if (b.ns >= snap.namespaces.size() || snap.namespaces[b.ns].pool != g.name) {
      return bad(absl::StrCat("namespace ", b.ns, " is unknown or of another pool"));
    }
    if (b.parent >= i || b.parent < -1) return bad("its parent does not come before it");
    if (b.parent >= 0 && (snap.blocks[b.parent].pool != b.pool || snap.blocks[b.parent].ns != b.ns)) {
      return bad("its parent is in another pool or namespace");
    }
  }
  for (const CacheSnapshot::Session& s : snap.sessions) {
    if (s.id.value().empty()) return absl::InvalidArgumentError("snapshot session without an id");
    for (int64_t p : s.protected_blocks) {
      if (p < 0 || p >= n) {
        return absl::InvalidArgumentError(absl::StrCat("snapshot session '", s.id.value(), "' protects block ", p, " of ", n));
      }
    }
  }

  // Checkpoints: their own blocks must be free of every cached block and of each other.
  std::vector<absl::flat_hash_set<BlockIndex>> taken(pool_geometries_.size());
  for (const CacheSnapshot::Block& b : snap.blocks) taken[b.pool].insert(b.index);
  // A hybrid pool's components: each in its group's range, used once (docs/hybrid.md §2.9).
  std::vector<absl::flat_hash_set<BlockIndex>> components(pool_geometries_.size());
  for (int64_t i = 0; i < n; ++i) {
    KVD_RETURN_IF_ERROR(CheckSnapshotComponents(snap.blocks[i], i, taken[snap.blocks[i].pool],
                                                components[snap.blocks[i].pool]));
  }
  for (const CacheSnapshot::Checkpoint& c : snap.checkpoints) {
    const auto bad = [&c](absl::string_view what) {
      return absl::InvalidArgumentError(absl::StrCat("snapshot checkpoint '", c.id.value(), "': ", what));
    };
    if (c.id.value().empty()) return absl::InvalidArgumentError("snapshot checkpoint without an id");
    if (c.ns >= snap.namespaces.size()) return bad("unknown namespace");
    absl::StatusOr<PoolId> pool = FindPool(snap.namespaces[c.ns].pool);
    if (!pool.ok()) return bad("its pool is not configured");
    const PoolGeometry& g = pool_geometries_[*pool];
    if (c.tokens.empty() || static_cast<int64_t>(c.tokens.size()) > g.max_model_len ||
        c.blocks.size() != c.cached.size() || static_cast<int64_t>(c.blocks.size()) > g.BlocksFor(c.tokens.size())) {
      return bad("its tokens and blocks do not fit the pool");
    }
    for (size_t i = 0; i < c.blocks.size(); ++i) {
      const int64_t pos = c.cached[i];
      if (pos >= n || pos < -1 || (pos >= 0 && (snap.blocks[pos].pool != *pool || snap.blocks[pos].index != c.blocks[i]))) {
        return bad(absl::StrCat("block ", i, " names a cached block that is not there"));
      }
      if (pos < 0 && (c.blocks[i] >= static_cast<uint64_t>(g.capacity_blocks) || !taken[*pool].insert(c.blocks[i]).second)) {
        return bad(absl::StrCat("block ", c.blocks[i], " is past the pool or not its own"));
      }
    }
    KVD_RETURN_IF_ERROR(CheckSnapshotCheckpointGroups(c, *pool, taken[*pool], components[*pool]));
  }

  // Fences: blocks in range. A block may be in several fences (a checkpoint's block fenced at one
  // handoff, then again with the request that resumed it at the next): each holds it.
  for (size_t i = 0; i < snap.fences.size(); ++i) {
    const CacheSnapshot::Fence& f = snap.fences[i];
    if (f.pool >= pool_geometries_.size()) {
      return absl::InvalidArgumentError(absl::StrCat("snapshot fence ", i, ": pool ", f.pool, " is not configured"));
    }
    absl::flat_hash_set<BlockIndex> seen;
    for (BlockIndex b : f.blocks) {
      if (b >= static_cast<uint64_t>(pool_geometries_[f.pool].capacity_blocks) || !seen.insert(b).second) {
        return absl::InvalidArgumentError(
            absl::StrCat("snapshot fence ", i, ": block ", b, " is past the pool or named twice"));
      }
    }
  }

  int64_t indexed = 0;
  {
    absl::MutexLock lock(&mu_);
    ExpireLocked(nullptr);
    if (index_.num_blocks() != 0 || !requests_.empty() || !checkpoints_.empty() || !sessions_.empty() ||
        !fences_.empty()) {
      return absl::FailedPreconditionError("a snapshot is imported only into a cache that holds nothing yet");
    }
    std::vector<std::vector<BlockIndex>> per_pool(pools_.size());
    for (const CacheSnapshot::Block& b : snap.blocks) {
      per_pool[b.pool].push_back(b.index);
      for (BlockIndex c : b.components) {
        if (c != CacheSnapshot::kNoComponent) per_pool[b.pool].push_back(c);
      }
    }
    for (size_t p = 0; p < pools_.size(); ++p) {
      if (absl::Status s = pools_[p]->allocator.Claim(per_pool[p]); !s.ok()) {
        for (size_t q = 0; q < p; ++q) pools_[q]->allocator.Free(per_pool[q]);
        return absl::InvalidArgumentError(absl::StrCat("snapshot of pool '", pools_[p]->geometry.name, "': ", s.message()));
      }
    }
    // Each block as if a request had just published it (owned, then cached), then given its
    // recorded recency, then let go children first so that leaves queue for eviction.
    const uint64_t owner = next_serial_++;
    std::vector<CachedBlock*> nodes(n, nullptr);
    for (int64_t i = 0; i < n; ++i) {
      const CacheSnapshot::Block& b = snap.blocks[i];
      Pool& pool = *pools_[b.pool];
      BlockState& s = pool.blocks[b.index];
      s.kind = BlockState::Kind::kOwned;
      s.refs = 1;
      s.owner = owner;
      ++pool.num_owned;
      CachedBlock* parent = b.parent >= 0 ? nodes[b.parent] : nullptr;
      if (b.parent >= 0 && parent == nullptr) continue;  // its parent was not indexed
      NamespaceRoot* root = index_.GetOrCreateRoot(snap.namespaces[b.ns], b.pool);
      // A repeated block (same namespace, parent and tokens) is indexed once; the repeat is freed.
      if (index_.FindChild(*root, parent, b.tokens) != nullptr) continue;
      nodes[i] = CacheBlockLocked(b.pool, root, parent, b.index, b.tokens);
    }
    // The nodes' components: window blocks first, then the checkpoints that read them; what
    // cannot be attached goes back to the free list.
    std::vector<std::pair<PoolId, BlockIndex>> attached = ImportComponentsLocked(snap, nodes);
    for (int64_t i = 0; i < n; ++i) {
      if (nodes[i] == nullptr) continue;
      nodes[i]->last_use = snap.blocks[i].last_use;
      nodes[i]->reused = snap.blocks[i].reused;
      last_tick_ = std::max(last_tick_, snap.blocks[i].last_use);
      ++indexed;
    }
    // Interrupted requests' checkpoints: their own blocks owned again, their cached ones referenced.
    for (const CacheSnapshot::Checkpoint& c : snap.checkpoints) {
      if (c.expires_at <= clock_->Now() || checkpoints_.contains(c.id)) continue;
      const PoolId pool_id = *FindPool(snap.namespaces[c.ns].pool);
      Pool& pool = *pools_[pool_id];
      bool whole = true;
      for (size_t i = 0; i < c.blocks.size(); ++i) whole &= c.cached[i] < 0 || nodes[c.cached[i]] != nullptr;
      for (const CacheSnapshot::Checkpoint::Group& g : c.groups) {
        for (size_t i = 0; i < g.blocks.size(); ++i) {
          whole &= !g.cached[i] || (pool.blocks[g.blocks[i]].kind == BlockState::Kind::kCached &&
                                    pool.component_node[g.blocks[i]] != nullptr);
        }
      }
      if (!whole) continue;  // a block it reads was not indexed
      std::vector<BlockIndex> own;
      for (size_t i = 0; i < c.blocks.size(); ++i) {
        if (c.cached[i] < 0) own.push_back(c.blocks[i]);
      }
      for (const CacheSnapshot::Checkpoint::Group& g : c.groups) {
        for (size_t i = 0; i < g.blocks.size(); ++i) {
          if (!g.cached[i]) own.push_back(g.blocks[i]);
        }
        if (g.slot != CacheSnapshot::kNoComponent) own.push_back(g.slot);
      }
      KVD_CHECK(pool.allocator.Claim(own).ok());  // checked free above
      auto rec = std::make_unique<CheckpointRecord>();
      rec->serial = next_serial_++;
      rec->version = next_serial_++;  // not known to be on this daemon's G3 until a flush says so
      for (size_t i = 0; i < c.blocks.size(); ++i) {
        if (c.cached[i] >= 0) {
          RefLocked(pool_id, c.blocks[i], /*touch=*/false);
          continue;
        }
        BlockState& s = pool.blocks[c.blocks[i]];
        s.kind = BlockState::Kind::kOwned;
        s.refs = 1;
        s.owner = rec->serial;
        ++pool.num_owned;
      }
      for (const CacheSnapshot::Checkpoint::Group& g : c.groups) {
        CheckpointRecord::Group& rg = rec->groups.emplace_back();
        rg.first = g.first;
        rg.blocks = g.blocks;
        rg.slot = g.slot;
        for (size_t i = 0; i <= g.blocks.size(); ++i) {
          const bool is_slot = i == g.blocks.size();
          if (is_slot && g.slot == CacheSnapshot::kNoComponent) break;
          const BlockIndex b = is_slot ? g.slot : g.blocks[i];
          if (!is_slot && g.cached[i]) {
            RefLocked(pool_id, b, /*touch=*/false);
            continue;
          }
          BlockState& s = pool.blocks[b];
          s.kind = BlockState::Kind::kOwned;
          s.refs = 1;
          s.owner = rec->serial;
          ++pool.num_owned;
        }
      }
      rec->id = c.id;
      rec->pool = pool_id;
      rec->ns = snap.namespaces[c.ns];
      rec->tokens = c.tokens;
      rec->blocks = c.blocks;
      rec->engine_state = c.engine_state;
      rec->state_bytes = static_cast<int64_t>(c.engine_state.size() + c.tokens.size() * sizeof(Token));
      rec->orphaned = true;
      rec->charged_blocks = static_cast<int64_t>(c.blocks.size());
      rec->expires_at = c.expires_at;
      if (!rec->groups.empty()) {  // a hybrid pool's: charged per group
        rec->charged_units = UnitsOfLocked(pool_id, AllBlocksOf(*rec));
        rec->charged_blocks = 0;
        for (int64_t u : rec->charged_units) rec->charged_blocks += u;
      }
      const int64_t charge_bytes = ChargedBytesLocked(*rec);
      if (orphan_blocks_bytes_ + charge_bytes > options_.checkpoint_budget_bytes ||
          checkpoint_state_bytes_ + rec->state_bytes > options_.checkpoint_state_bytes ||
          !(rec->groups.empty() ? ledger_.Reserve(pool_id, rec->charged_blocks)
                                : ledger_.ReserveUnits(pool_id, rec->charged_units)).ok()) {
        // This configuration has no room for it: components first, as a release does.
        for (auto g = rec->groups.rbegin(); g != rec->groups.rend(); ++g) {
          if (g->slot != HybridSpine::kNone) UnrefLocked(pool_id, g->slot);
          UnrefTableLocked(pool_id, g->blocks);
        }
        UnrefTableLocked(pool_id, rec->blocks);
        continue;
      }
      ChargeCheckpointStateLocked(*rec, +1);
      orphans_.emplace(std::make_pair(rec->expires_at, rec->serial), rec->id);
      orphan_blocks_bytes_ += charge_bytes;
      checkpoints_.emplace(rec->id, std::move(rec));
    }
    // Components before their nodes (a leaf left unservable takes its components: none may be
    // referenced then), each node's children before it.
    for (auto it = attached.rbegin(); it != attached.rend(); ++it) UnrefLocked(it->first, it->second, /*touch=*/false);
    for (int64_t i = n - 1; i >= 0; --i) UnrefLocked(snap.blocks[i].pool, snap.blocks[i].index, /*touch=*/false);
    // What live requests owned stays out of every new owner's hands (kv_cache_fences.cc).
    for (const CacheSnapshot::Fence& f : snap.fences) {
      if (f.remaining > absl::ZeroDuration()) {
        // Its ledger owner again (Owner{kFence, its attachment, a new serial}): the writer of each
        // block no earlier fence of the snapshot writes.
        const absl::Time until = clock_->Now() + f.remaining;
        const uint64_t serial = next_serial_++;
        AddFenceLocked(cache_state::FenceOwner{f.attachment, f.pid}, f.pool, f.blocks, until, serial);
        ChargeFenceLocked(until, serial);
      }
    }
    for (const CacheSnapshot::Session& in : snap.sessions) {
      if (in.expires_at <= clock_->Now()) continue;
      Session& session = sessions_[in.id];
      session.salt = in.salt;
      session.worker = in.worker;
      session.expires_at = in.expires_at;
      for (int64_t p : in.protected_blocks) {
        CachedBlock* node = nodes[p];
        if (node == nullptr) continue;
        if (static_cast<int64_t>(session.protected_blocks.size()) >= options_.session_max_protected_blocks) break;
        SetProtectionLocked(node->address.pool, node, +1);
        session.protected_blocks.push_back({node->address.pool, node->address.index, node->serial});
      }
      session_expiry_.emplace(std::make_pair(session.expires_at, in.id), true);
    }
    UpdatePressureLocked();
  }
  Deliver();
  return indexed;
}

}  // namespace kvd

namespace kvd {

void KvCache::ExportComponentsLocked(const Pool& pool, const CachedBlock& node, CacheSnapshot::Block* e) const {
  if (pool.spine == nullptr) return;
  const HybridSpine& spine = *pool.spine;
  e->components.assign(pool.geometry.groups.size(), CacheSnapshot::kNoComponent);
  for (int g = 0; g < static_cast<int>(pool.geometry.groups.size()); ++g) {
    if (g == pool.spine_group) continue;
    if (pool.geometry.groups[g].kind == KvGroupKind::kState) {
      e->components[g] = spine.checkpoint(node, g);
      if (e->components[g] != HybridSpine::kNone && spine.checkpoint_is_tail(node, g)) e->tail_checkpoints |= 1u << g;
    } else {
      e->components[g] = spine.block(node, g);
    }
  }
}

absl::Status KvCache::CheckSnapshotComponents(const CacheSnapshot::Block& b, int64_t i,
                                              absl::flat_hash_set<BlockIndex>& taken,
                                              absl::flat_hash_set<BlockIndex>& components) const {
  if (b.components.empty()) return absl::OkStatus();
  const PoolGeometry& geo = pool_geometries_[b.pool];
  const auto bad = [&](auto&&... what) {
    return absl::InvalidArgumentError(absl::StrCat("snapshot block ", i, " of pool '", geo.name, "': ", what...));
  };
  int spine_group = -1;
  for (size_t g = 0; g < geo.groups.size() && spine_group < 0; ++g) {
    if (geo.groups[g].kind == KvGroupKind::kFull) spine_group = static_cast<int>(g);
  }
  if (spine_group < 0) return bad("components, but the pool has no full KV group here");
  if (b.components.size() != geo.groups.size()) {
    return bad(b.components.size(), " components, but the pool has ", geo.groups.size(),
               " KV groups here (groups changed across the handoff)");
  }
  for (int g = 0; g < static_cast<int>(geo.groups.size()); ++g) {
    const BlockIndex c = b.components[g];
    if (c == CacheSnapshot::kNoComponent) continue;
    const KvGroup& k = geo.groups[g];
    if (g == spine_group || c < static_cast<uint64_t>(k.first_block) ||
        c >= static_cast<uint64_t>(k.first_block + k.capacity) || !taken.insert(c).second) {
      return bad("component ", c, " of group '", k.name, "' is outside the group's range [", k.first_block, ", ",
                 k.first_block + k.capacity, ") or used twice");
    }
    components.insert(c);
  }
  return absl::OkStatus();
}

absl::Status KvCache::CheckSnapshotCheckpointGroups(const CacheSnapshot::Checkpoint& c, PoolId pool,
                                                    absl::flat_hash_set<BlockIndex>& taken,
                                                    const absl::flat_hash_set<BlockIndex>& components) const {
  const PoolGeometry& geo = pool_geometries_[pool];
  const auto bad = [&](auto&&... what) {
    return absl::InvalidArgumentError(absl::StrCat("snapshot checkpoint '", c.id.value(), "': ", what...));
  };
  if (c.groups.size() != (geo.hybrid() ? geo.groups.size() : 0)) {
    return bad(c.groups.size(), " KV groups, but pool '", geo.name, "' has ", geo.hybrid() ? geo.groups.size() : 0,
               " here (groups changed across the handoff)");
  }
  for (size_t g = 0; g < c.groups.size(); ++g) {
    const CacheSnapshot::Checkpoint::Group& e = c.groups[g];
    const KvGroup& k = geo.groups[g];
    const auto in_range = [&k](BlockIndex b) {
      return b >= static_cast<uint64_t>(k.first_block) && b < static_cast<uint64_t>(k.first_block + k.capacity);
    };
    if (e.blocks.size() != e.cached.size() || e.first < 0) return bad("group '", k.name, "' is malformed");
    for (size_t i = 0; i < e.blocks.size(); ++i) {
      if (!in_range(e.blocks[i]) || (e.cached[i] ? !components.contains(e.blocks[i]) : !taken.insert(e.blocks[i]).second)) {
        return bad("block ", e.blocks[i], " of group '", k.name, "' is past the group, not its own, or not cached");
      }
    }
    if ((k.kind == KvGroupKind::kState) != (e.slot != CacheSnapshot::kNoComponent) ||
        (e.slot != CacheSnapshot::kNoComponent && (!in_range(e.slot) || !taken.insert(e.slot).second))) {
      return bad("state slot ", e.slot, " of group '", k.name, "' is missing, past the group or not its own");
    }
  }
  return absl::OkStatus();
}

std::vector<std::pair<PoolId, BlockIndex>> KvCache::ImportComponentsLocked(const CacheSnapshot& snap,
                                                                          const std::vector<CachedBlock*>& nodes) {
  std::vector<std::pair<PoolId, BlockIndex>> attached;
  auto cache = [&](Pool& pool, PoolId p, int g, BlockIndex c, CachedBlock* node) {
    BlockState& s = pool.blocks[c];
    s.kind = BlockState::Kind::kCached;
    s.refs = 1;  // let go after every checkpoint is attached (ImportSnapshot)
    s.owner = 0;
    s.node = nullptr;
    ++pool.num_cached;
    ++pool.side[g].cached;
    pool.component_node[c] = node;
    attached.emplace_back(p, c);
  };
  for (int pass = 0; pass < 2; ++pass) {  // window blocks, then the checkpoints that read them
    for (size_t i = 0; i < snap.blocks.size(); ++i) {
      const CacheSnapshot::Block& b = snap.blocks[i];
      Pool& pool = *pools_[b.pool];
      for (int g = 0; g < static_cast<int>(b.components.size()); ++g) {
        const BlockIndex c = b.components[g];
        if (c == CacheSnapshot::kNoComponent) continue;
        const bool state = pool.geometry.groups[g].kind == KvGroupKind::kState;
        if (state != (pass == 1)) continue;
        CachedBlock* node = nodes[i];
        if (node == nullptr || pool.spine == nullptr) {
          pool.allocator.Free(c);  // claimed with the blocks; its node was not indexed
          continue;
        }
        HybridSpine& spine = *pool.spine;
        if (!state) {
          cache(pool, b.pool, g, c, node);
          spine.AttachBlock(*node, g, c);
          continue;
        }
        std::vector<const CachedBlock*> chain;
        for (const CachedBlock* n = node; n != nullptr; n = n->parent) chain.push_back(n);
        std::reverse(chain.begin(), chain.end());
        const int64_t depth = static_cast<int64_t>(chain.size());
        const bool tail = (b.tail_checkpoints >> g) & 1u;
        if (spine.CanAcceptCheckpoint(g, chain, depth, tail) != CheckpointOutcome::kKept) {
          pool.allocator.Free(c);  // its window is not all there (U3): not servable
          continue;
        }
        cache(pool, b.pool, g, c, node);
        spine.AttachCheckpoint(*node, g, c, depth, tail);
      }
    }
  }
  return attached;
}

}  // namespace kvd
