// KvCache: block writers (the ledger's request and pull owners), references, allocation and eviction.
#include <algorithm>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "server/core/kv_cache.h"
#include "proto/vocab/status_macros.h"

namespace kvd {

uint64_t KvCache::NextTickLocked() {
  // Recency ticks are nanoseconds of the injected clock, read once per operation (ExpireLocked),
  // forced strictly increasing so that ties keep the order of events (a released prefix is ticked
  // tail first).
  last_tick_ = std::max(last_tick_ + 1, op_now_ns_);
  return last_tick_;
}

std::vector<BlockIndex> KvCache::HandOverWritesLocked(const Request& req, const Owner& to) {
  const Owner from = WriterOf(req);
  std::vector<BlockIndex> out;
  for (BlockIndex b : AllBlocksOf(req)) {
    const Owner* w = owners_.OwnerOf(req.pool, b);
    if (w == nullptr || !(*w == from)) continue;  // cached, or written by a pull meanwhile
    KVD_CHECK(owners_.Transfer(req.pool, b, from, to).ok());
    out.push_back(b);
  }
  return out;
}

void KvCache::ReleaseWritesLocked(const Request& req) {
  const Owner me = WriterOf(req);
  const absl::flat_hash_set<BlockIndex>& mine = owners_.BlocksOf(req.serial);
  const std::vector<BlockIndex> blocks(mine.begin(), mine.end());
  for (BlockIndex b : blocks) ReturnWriteLocked(req.pool, b, me);  // a resumed block still fenced: to its fence
}

void KvCache::EndPullLocked(absl::flat_hash_map<uint64_t, PullRecord>::iterator it) {
  const PullRecord& pull = it->second;
  const Owner from{OwnerKind::kPull, pull.attachment, it->first};
  const absl::flat_hash_set<BlockIndex>& held = owners_.BlocksOf(it->first);
  const std::vector<BlockIndex> blocks(held.begin(), held.end());  // what it did not publish
  auto req = requests_.find(pull.id);
  const bool live = req != requests_.end() && req->second->serial == pull.request_serial;
  for (BlockIndex b : blocks) {
    if (live) KVD_CHECK(owners_.Transfer(pull.pool, b, from, WriterOf(*req->second)).ok());
    else ReturnWriteLocked(pull.pool, b, from);
  }
  pulls_.erase(it);
}

void KvCache::RefLocked(PoolId pool_id, BlockIndex index, bool touch) {
  Pool& pool = *pools_[pool_id];
  BlockState& s = pool.blocks[index];
  KVD_CHECK(s.kind != BlockState::Kind::kFree);
  if (s.kind == BlockState::Kind::kCached && s.node == nullptr) {  // a hybrid pool's side block
    if (s.refs == 0) {
      cache_state::Pool::SideGroup& sg = pool.side[pool.allocator.GroupOf(index)];
      sg.evictable.Erase(index);
      --pool.num_cached_unreferenced;
    }
  } else if (s.kind == BlockState::Kind::kCached) {
    if (s.refs == 0) {
      pool.queue.Remove(s.node);
      --pool.num_cached_unreferenced;
    }
    if (touch) pool.StampUse(*s.node, NextTickLocked());
  }
  ++s.refs;
}

void KvCache::UnrefLocked(PoolId pool_id, BlockIndex index, bool touch) {
  Pool& pool = *pools_[pool_id];
  BlockState& s = pool.blocks[index];
  KVD_CHECK(s.kind != BlockState::Kind::kFree && s.refs > 0);
  if (--s.refs > 0) return;
  if (s.kind == BlockState::Kind::kOwned) {
    s.kind = BlockState::Kind::kFree;
    s.owner = 0;
    --pool.num_owned;
    pool.allocator.Free(index);
    return;
  }
  ++pool.num_cached_unreferenced;
  if (s.node == nullptr) {  // a hybrid pool's side block: evictable by its group, oldest first
    cache_state::Pool::SideGroup& sg = pool.side[pool.allocator.GroupOf(index)];
    sg.evictable.Push(index);
    if (pool.spine != nullptr) AfterLastUnrefLocked(pool, index);
    return;
  }
  if (touch) pool.StampUse(*s.node, NextTickLocked());
  if (s.node->num_children == 0) pool.queue.Push(s.node);
  if (pool.spine != nullptr) AfterLastUnrefLocked(pool, index);
}

void KvCache::HoldLocked(PoolId pool_id, BlockIndex index) {
  RefLocked(pool_id, index, /*touch=*/false);  // a hold is not a use: recency stays
  ++pools_[pool_id]->pins[index];
}

void KvCache::UnholdLocked(PoolId pool_id, BlockIndex index) {
  Pool& pool = *pools_[pool_id];
  auto pin = pool.pins.find(index);
  KVD_CHECK(pin != pool.pins.end());
  if (--pin->second == 0) pool.pins.erase(pin);
  UnrefLocked(pool_id, index, /*touch=*/false);
}

void KvCache::UnrefTableLocked(PoolId pool, absl::Span<const BlockIndex> table) {
  for (auto it = table.rbegin(); it != table.rend(); ++it) UnrefLocked(pool, *it);
}

std::vector<BlockIndex> KvCache::TakeFreeLocked(Pool& pool, int64_t count, int group, uint64_t owner) {
  absl::StatusOr<std::vector<BlockIndex>> out = pool.allocator.Allocate(count, group);
  KVD_CHECK(out.ok());
  for (BlockIndex b : *out) {
    BlockState& s = pool.blocks[b];
    s.kind = BlockState::Kind::kOwned;
    s.refs = 1;
    s.owner = owner;
  }
  pool.num_owned += static_cast<int64_t>(out->size());
  return *std::move(out);
}

absl::StatusOr<std::vector<BlockIndex>> KvCache::AllocateOwnedLocked(PoolId pool_id, int64_t count,
                                                                    uint64_t owner, const Owner* writer, int group) {
  KVD_CHECK(writer == nullptr || writer->epoch == owner);
  Pool& pool = *pools_[pool_id];
  // A hybrid pool allocates from one group's range; a spine group evicts index nodes as a pool
  // without groups does, any other attention group its own side blocks, a state group nothing.
  if (pool.geometry.hybrid() && group != pool.spine_group) {
    // Units this operation's evictions hold for the sink's copy are taken first, as they are
    // (AllocateOwnedLocked's spine path does the same with its victims): neither free nor
    // evictable, they would otherwise be missing from the count.
    std::vector<BlockIndex> handed = TakeHeldLocked(pool_id, group, count, owner);
    const int64_t need = count - static_cast<int64_t>(handed.size());
    const auto give_back = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      for (BlockIndex b : handed) {
        pool.blocks[b].owner = 0;
        --pool.blocks[b].refs;
      }
    };
    const int64_t reclaimable = pool.allocator.num_free(group) + pool.EvictableIn(group);
    if (need > reclaimable) {
      give_back();
      return absl::ResourceExhaustedError(absl::StrCat("group '", pool.geometry.groups[group].name, "' of pool '",
                                                       pool.geometry.name, "' has ", reclaimable,
                                                       " free or reclaimable units, need ", need));
    }
    side_pressure_ = true;  // units go at once, not held for a copy
    while (pool.allocator.num_free(group) < need) {
      if (!EvictSideLocked(pool, group)) {
        side_pressure_ = false;
        give_back();
        return absl::ResourceExhaustedError(absl::StrCat("group '", pool.geometry.groups[group].name, "' of pool '",
                                                         pool.geometry.name, "' has too few reclaimable units"));
      }
    }
    side_pressure_ = false;
    std::vector<BlockIndex> out = TakeFreeLocked(pool, need, group, owner);
    out.insert(out.end(), handed.begin(), handed.end());
    if (writer != nullptr) {
      for (BlockIndex b : out) KVD_CHECK(owners_.Assign(pool_id, b, *writer).ok());
    }
    return out;
  }
  if (pool.geometry.hybrid()) group = pool.spine_group;
  if (count > pool.allocator.num_free(group) + pool.EvictableIn(group)) {
    return absl::ResourceExhaustedError(
        absl::StrCat("pool '", pool.geometry.name, "' has ",
                     pool.allocator.num_free(group) + pool.EvictableIn(group),
                     " free or reclaimable blocks, need ", count));
  }
  // Victims the sink copies stay held (owned by nobody, pinned) until their copy is done: this
  // request takes them as they are, so they leave no free block another thread could take.
  std::vector<BlockIndex> held;
  std::vector<BlockIndex> handed;  // a hybrid pool's: the units' spine blocks its victims hold, already ours
  while (pool.allocator.num_free(group) + static_cast<int64_t>(held.size() + handed.size()) < count) {
    // Every unreferenced cached block has only unreferenced descendants (a reader of a block
    // holds its whole prefix), so some unreferenced leaf is always queued here.
    CachedBlock* victim = pool.queue.Peek();
    KVD_CHECK(victim != nullptr);
    const BlockIndex index = victim->address.index;
    EvictOneLocked(pool, victim, EvictReason::kCapacity);
    if (pool.spine != nullptr) {  // a unit's cascade may hold several spine blocks for the copy
      const int64_t want = count - pool.allocator.num_free(group) - static_cast<int64_t>(handed.size());
      for (BlockIndex b : TakeHeldLocked(pool_id, group, want, owner)) handed.push_back(b);
    } else if (pool.blocks[index].kind == BlockState::Kind::kOwned) {
      held.push_back(index);
    }
  }
  absl::StatusOr<std::vector<BlockIndex>> out =
      TakeFreeLocked(pool, count - static_cast<int64_t>(held.size() + handed.size()), group, owner);
  out->insert(out->end(), handed.begin(), handed.end());
  if (sink_ != nullptr && pool.allocator.num_free() < pool.reserve_blocks) {
    demote_wanted_.store(true, std::memory_order_relaxed);  // Deliver wakes the mover
  }
  for (BlockIndex b : held) {  // already owned (by nobody) and pinned: now also this owner's
    BlockState& s = pool.blocks[b];
    s.owner = owner;
    ++s.refs;
    out->push_back(b);
  }
  if (writer != nullptr) {
    // Free or held for a demotion: nobody writes either, so each Assign succeeds.
    for (BlockIndex b : *out) KVD_CHECK(owners_.Assign(pool_id, b, *writer).ok());
  }
  return out;
}

void KvCache::EvictOneLocked(Pool& pool, CachedBlock* victim, EvictReason reason) {
  if (pool.spine == nullptr) {
    EvictNodeLocked(pool, victim, reason);
    return;
  }
  // A spine leaf goes as a unit, with the cascade its going causes (docs/hybrid.md §2.8).
  pool.spine->EvictLeaf(victim, cache_state::PoolRefs(pool), &pool.plan);
  CarryOutPlanLocked(pool, reason);
}

void KvCache::EvictNodeLocked(Pool& pool, CachedBlock* victim, EvictReason reason,
                              const std::vector<UnitComponent>* parts) {
  KVD_CHECK(victim->num_children == 0);
  const BlockIndex index = victim->address.index;
  BlockState& s = pool.blocks[index];
  KVD_CHECK(s.kind == BlockState::Kind::kCached && s.refs == 0 && s.node == victim);
  // A probation block evicted for room is remembered as a ghost: one stored again soon after was
  // worth keeping (SLRU; pools without ghosts ignore it).
  const bool as_ghost = reason == EvictReason::kCapacity && victim->queue_tier == EvictionQueue::kProbation;
  pool.queue.Remove(victim);
  CachedBlock* parent = victim->parent;
  if (reason != EvictReason::kClear) {
    CacheEvent& e = scratch_event_;
    e.kind = CacheEventKind::kRemoved;
    e.pool = pool.geometry.name;
    e.adapter = victim->root->ns.adapter;
    e.key = victim->key;
    e.has_parent = false;
    e.parent_key = BlockKey{};
    e.block = index;
    e.block_tokens = pool.geometry.block_tokens;
    e.tokens.clear();
    e.media_keys.clear();
    e.method.clear();
    e.cache_salt.clear();
    e.medium.clear();
    EmitLocked();
  }
  // A hybrid pool's node goes down only as a unit (CarryOutPlanLocked decides and passes parts).
  const bool demote = sink_ != nullptr && reason != EvictReason::kClear && (!pool.geometry.hybrid() || parts != nullptr);
  if (demote) {
    cache_state::PendingDemotion d{this, HeldBlock(ViewOf(index_, *victim))};
    d.block.reason = reason;
    if (parts != nullptr) d.block.parts = *parts;
    cache_state::ThreadDemotions().push_back(std::move(d));
    ++demotions_pending_;
  }
  index_.Erase(victim, as_ghost);
  s.node = nullptr;
  --pool.num_cached;
  --pool.num_cached_unreferenced;
  if (demote) {
    // Held for the sink's copy, which runs after mu_ is released (RunDemotions): owned by
    // nobody, pinned, not free.
    s.kind = BlockState::Kind::kOwned;
    s.owner = 0;
    s.refs = 1;
    ++pool.pins[index];
    ++pool.num_owned;
  } else {
    s.kind = BlockState::Kind::kFree;
    pool.allocator.Free(index);
  }
  ++counters_.evictions[static_cast<int>(reason)];
  if (parent != nullptr && parent->num_children == 0 &&
      pool.blocks[parent->address.index].refs == 0) {
    pool.queue.Push(parent);
  }
}

CachedBlock* KvCache::CacheBlockLocked(PoolId pool_id, NamespaceRoot* root, CachedBlock* parent,
                                       BlockIndex index, absl::Span<const Token> tokens, const BlockKey* key) {
  Pool& pool = *pools_[pool_id];
  BlockState& s = pool.blocks[index];
  KVD_CHECK(s.kind == BlockState::Kind::kOwned && s.refs > 0);
  bool was_ghost = false;
  CachedBlock* node = index_.Insert(root, parent, tokens, BlockAddress{pool_id, index}, key, &was_ghost);
  if (node == nullptr) return nullptr;
  // Published bytes are never rewritten: whoever wrote the block (its request, or a pull for
  // it) is its writer no more.
  if (const Owner* w = owners_.OwnerOf(pool_id, index); w != nullptr) {
    const Owner writer = *w;
    KVD_CHECK(owners_.Release(pool_id, index, writer).ok());
  }
  s.kind = BlockState::Kind::kCached;
  s.owner = 0;
  s.node = node;
  --pool.num_owned;
  ++pool.num_cached;
  pool.queue.TickClock();
  pool.StampUse(*node, NextTickLocked());
  if (was_ghost) node->reused = true;
  pool.NoteUse(*node, was_ghost);
  CacheEvent& e = scratch_event_;
  e.kind = CacheEventKind::kStored;
  e.pool = pool.geometry.name;
  e.adapter = root->ns.adapter;
  e.key = node->key;
  e.has_parent = parent != nullptr;
  e.parent_key = parent != nullptr ? parent->key : BlockKey{};
  e.block = index;
  e.block_tokens = pool.geometry.block_tokens;
  const absl::Span<const Token> stored = index_.TokensOf(*node);
  e.tokens.assign(stored.begin(), stored.end());
  e.media_keys = root->ns.media_keys;
  e.method = root->ns.method;
  e.cache_salt = root->ns.cache_salt;
  e.medium.clear();
  EmitLocked();
  return node;
}

void KvCache::SetProtectionLocked(PoolId pool_id, CachedBlock* node, int delta) {
  Pool& pool = *pools_[pool_id];
  const bool was_queued = node->queued;
  if (was_queued) pool.queue.Remove(node);
  node->protect_count += delta;
  KVD_CHECK(node->protect_count >= 0);
  if (was_queued) pool.queue.Push(node);
}

}  // namespace kvd
