// KvCache as PeerPort (peer_port.h): a hybrid pool's hit travels between daemons as one unit —
// full blocks, the window blocks a hit at its depth reads, the state checkpoint at exactly that
// depth (docs/hybrid.md §2.6, §2.9 "peers"; docs/transfer.md, "Hybrid pools"). The lender pins
// its unit under the engine lock; the borrower pins its own targets, lets the pull write them
// without the lock, and publishes them as one unit under it. No byte is read or written here.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "proto/vocab/block_key.h"
#include "proto/vocab/status_macros.h"
#include "server/core/kv_cache.h"

namespace kvd {
namespace {

int SpineGroupOf(const PoolGeometry& geo) {
  for (size_t g = 0; g < geo.groups.size(); ++g) {
    if (geo.groups[g].kind == KvGroupKind::kFull) return static_cast<int>(g);
  }
  return -1;
}

// Blocks of attention group g a hit at `depth` reads (HybridSpine::WindowNeed's rule).
int64_t NeedOf(const PoolGeometry& geo, int g, int64_t depth) {
  const KvGroup& k = geo.groups[g];
  const int64_t bt = geo.block_tokens;
  switch (k.kind) {
    case KvGroupKind::kFull: return depth;
    case KvGroupKind::kSlidingWindow: return std::min<int64_t>(depth, (k.window - 1 + bt - 1) / bt);
    case KvGroupKind::kChunkedLocal: return depth % (k.chunk / bt);
    case KvGroupKind::kState: return 0;
  }
  return 0;
}

}  // namespace

std::vector<UnitPart> UnitLayout(const PoolGeometry& geo, int64_t skip, int64_t depth) {
  std::vector<UnitPart> out;
  const int spine = SpineGroupOf(geo);
  for (int64_t p = skip; p < depth; ++p) out.push_back({spine, p});
  for (int g = 0; g < static_cast<int>(geo.groups.size()); ++g) {
    if (g == spine || !geo.groups[g].attention()) continue;
    for (int64_t p = std::max(skip, depth - NeedOf(geo, g, depth)); p < depth; ++p) out.push_back({g, p});
  }
  for (int g = 0; g < static_cast<int>(geo.groups.size()); ++g) {
    if (!geo.groups[g].attention()) out.push_back({g, depth - 1});
  }
  return out;
}

int64_t UnitPartBytes(const PoolGeometry& geo, int g) {
  return geo.hybrid() ? geo.GroupUnitBytes(g) * geo.num_shards : geo.block_bytes_all_shards();
}

absl::StatusOr<PeerPort::PinnedUnit> KvCache::PinHybridUnit(const Namespace& ns, absl::Span<const Token> tokens,
                                                            int64_t skip_blocks, int64_t max_blocks) {
  KVD_ASSIGN_OR_RETURN(PoolId id, FindPool(ns.pool));
  const PoolGeometry& geo = pool_geometries_[id];
  const int32_t bt = geo.block_tokens;
  const int64_t len = std::min<int64_t>(static_cast<int64_t>(tokens.size()), geo.max_model_len);
  const std::vector<BlockKey> keys = ChainKeys(ns, tokens.first(static_cast<size_t>(len)), bt, len / bt);
  PinnedUnit out;
  out.pool = id;
  absl::MutexLock lock(&mu_);
  ExpireLocked(nullptr);
  Pool& pool = *pools_[id];
  if (!geo.hybrid() || pool.spine == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat("pool '", geo.name, "' is not a hybrid pool with a full group"));
  }
  int64_t cap = MaxHitBlocks(pool, len);
  if (max_blocks > 0) cap = std::min(cap, std::max<int64_t>(skip_blocks, 0) + max_blocks);
  const std::vector<CachedBlock*> chain =
      index_.Match(index_.FindRoot(ns), tokens.first(static_cast<size_t>(len)), bt, cap, keys);
  HybridHit hit;
  pool.spine->Lookup(absl::Span<const CachedBlock* const>(chain.data(), chain.size()), &hit);
  const int64_t skip = std::max<int64_t>(skip_blocks, 0);
  if (hit.depth <= skip) return out;
  const int64_t d = hit.depth;
  const HybridSpine& spine = *pool.spine;
  for (const UnitPart& part : UnitLayout(geo, skip, d)) {
    const CachedBlock& node = *chain[static_cast<size_t>(part.position)];
    BlockIndex b = HybridSpine::kNone;
    uint64_t serial = 0;
    if (part.group == spine.spine_group()) {
      b = node.address.index;
      serial = node.serial;
    } else if (geo.groups[part.group].attention()) {
      b = spine.block(node, part.group);
    } else {
      b = spine.checkpoint(node, part.group);
    }
    if (b == HybridSpine::kNone) {  // Lookup served d: every component is there (nothing pinned yet)
      return absl::InternalError(absl::StrCat("the hit of depth ", d, " in pool '", geo.name, "' lacks group '",
                                              geo.groups[part.group].name, "''s component at position ",
                                              part.position));
    }
    out.components.push_back(b);
    out.serials.push_back(serial);
  }
  for (BlockIndex b : out.components) {
    RefLocked(id, b);  // a peer's read is a use
    ++pool.pins[b];
  }
  out.depth = d;
  return out;
}

absl::StatusOr<int64_t> KvCache::PullHorizon(const RequestId& id) {
  absl::MutexLock lock(&mu_);
  KVD_ASSIGN_OR_RETURN(Request * req, FindRequestLocked(id));
  const Pool& pool = *pools_[req->pool];
  if (pool.spine == nullptr || !req->acquired || !req->spec.resume_from.empty() || req->groups.empty()) return 0;
  return std::max<int64_t>(0, (static_cast<int64_t>(req->spec.prompt.size()) - 1) / pool.geometry.block_tokens);
}

absl::StatusOr<std::vector<BlockIndex>> KvCache::UnitTargetsLocked(const Request& req, int64_t depth) const {
  const Pool& pool = *pools_[req.pool];
  const PoolGeometry& geo = pool.geometry;
  const int32_t bt = geo.block_tokens;
  const auto refuse = [&](auto&&... parts) {
    return absl::FailedPreconditionError(absl::StrCat("a pull of request '", req.spec.id.value(), "' to block ",
                                                      depth, ": ", parts...));
  };
  if (pool.spine == nullptr || !req.acquired || !req.spec.resume_from.empty() || req.groups.empty()) {
    return refuse("not a fresh acquire of a hybrid pool with a full group");
  }
  const int64_t skip = req.cached_tokens / bt;
  if (req.computed_tokens != req.cached_tokens || depth <= skip ||
      depth > (static_cast<int64_t>(req.spec.prompt.size()) - 1) / bt) {
    return refuse("its hit is ", skip, " blocks of a ", req.spec.prompt.size(), "-token prompt");
  }
  // Every position past the hit must be new to the spine: the pull publishes them all.
  KVD_ASSIGN_OR_RETURN(PublishResult plan,
                       PlanPublishLocked(req, absl::MakeConstSpan(req.spec.prompt).first(depth * bt),
                                         absl::MakeConstSpan(req.table).first(std::min<size_t>(depth, req.table.size())),
                                         /*by_pull=*/true));
  for (int64_t p = skip; p < depth; ++p) {
    if (p >= static_cast<int64_t>(plan.outcomes.size()) || plan.outcomes[p] != PublishOutcome::kKept) {
      return refuse("this kvd caches block ", p, " of the prompt already (its hit is limited by another group)");
    }
  }
  std::vector<BlockIndex> out;
  for (const UnitPart& part : UnitLayout(geo, skip, depth)) {
    BlockIndex b = HybridSpine::kNone;
    if (part.group == pool.spine_group) {
      b = req.table[static_cast<size_t>(part.position)];
    } else if (geo.groups[part.group].attention()) {
      const cache_state::Request::Group& rg = req.groups[part.group];
      const int64_t i = part.position - rg.first;
      if (i >= 0 && i < static_cast<int64_t>(rg.blocks.size())) b = rg.blocks[static_cast<size_t>(i)];
    } else {
      if (req.groups[part.group].blocks.empty()) return refuse("group '", geo.groups[part.group].name, "' has no slot");
      b = req.groups[part.group].blocks.back();
    }
    if (b != HybridSpine::kNone) {
      const BlockState& s = pool.blocks[b];
      if (s.kind != BlockState::Kind::kOwned || s.owner != req.serial) {
        return refuse("block ", b, " of group '", geo.groups[part.group].name, "' is not the request's to write");
      }
    }
    out.push_back(b);
  }
  return out;
}

absl::StatusOr<PeerPort::UnitTargets> KvCache::PinUnitTargets(const RequestId& id, int64_t depth) {
  absl::MutexLock lock(&mu_);
  KVD_ASSIGN_OR_RETURN(Request * req, FindRequestLocked(id));
  KVD_ASSIGN_OR_RETURN(std::vector<BlockIndex> blocks, UnitTargetsLocked(*req, depth));
  Pool& pool = *pools_[req->pool];
  const PoolGeometry& geo = pool.geometry;
  const Owner writer = WriterOf(*req);
  // As PinBlocks: the pull becomes the writer of each (every one is the request's own, written
  // by the request and by no other pull).
  for (BlockIndex b : blocks) {
    if (b == HybridSpine::kNone) continue;
    const Owner* w = owners_.OwnerOf(req->pool, b);
    if (w == nullptr || !(*w == writer)) {
      return absl::FailedPreconditionError(absl::StrCat("block ", b, " of request '", id.value(),
                                                        "' is not written by the request: a pull cannot take it"));
    }
  }
  // Window positions past a group's table (its step horizon) land in fresh units of the group,
  // outside the table until the unit is adopted.
  const std::vector<UnitPart> layout = UnitLayout(geo, req->cached_tokens / geo.block_tokens, depth);
  std::vector<int64_t> loose(geo.groups.size(), 0);
  for (size_t i = 0; i < blocks.size(); ++i) loose[layout[i].group] += blocks[i] == HybridSpine::kNone ? 1 : 0;
  for (size_t g = 0; g < loose.size(); ++g) {
    if (loose[g] > pool.allocator.num_free(static_cast<int>(g)) + pool.EvictableIn(static_cast<int>(g))) {
      return absl::ResourceExhaustedError(absl::StrCat("group '", geo.groups[g].name, "' of pool '", geo.name,
                                                       "' has no room for the ", loose[g], " blocks a pull to block ",
                                                       depth, " lands past the request's table"));
    }
  }
  UnitTargets out;
  for (size_t g = 0; g < loose.size(); ++g) {
    if (loose[g] == 0) continue;
    absl::StatusOr<std::vector<BlockIndex>> fresh =
        AllocateOwnedLocked(req->pool, loose[g], req->serial, &writer, static_cast<int>(g));
    if (!fresh.ok()) {  // what was taken goes back
      for (BlockIndex b : out.loose) {
        KVD_CHECK(owners_.Release(req->pool, b, writer).ok());
        UnrefLocked(req->pool, b);
      }
      return fresh.status();
    }
    size_t next = 0;
    for (size_t i = 0; i < blocks.size(); ++i) {
      if (layout[i].group == static_cast<int>(g) && blocks[i] == HybridSpine::kNone) blocks[i] = (*fresh)[next++];
    }
    out.loose.insert(out.loose.end(), fresh->begin(), fresh->end());
  }
  const uint64_t epoch = next_serial_++;
  const Owner pull{OwnerKind::kPull, req->spec.owner, epoch};
  for (BlockIndex b : blocks) {
    RefLocked(req->pool, b);
    ++pool.pins[b];
    KVD_CHECK(owners_.Transfer(req->pool, b, writer, pull).ok());
  }
  pulls_.emplace(epoch, PullRecord{id, req->serial, req->spec.owner, req->pool, blocks});
  out.blocks = std::move(blocks);
  return out;
}

void KvCache::UnpinLocked(PoolId pool_id, absl::Span<const BlockIndex> blocks) {
  Pool& pool = *pools_[pool_id];
  for (auto it = pulls_.begin(); it != pulls_.end(); ++it) {
    if (it->second.pool == pool_id && absl::MakeConstSpan(it->second.blocks) == blocks) {
      EndPullLocked(it);
      break;
    }
  }
  for (BlockIndex b : blocks) {
    auto it = pool.pins.find(b);
    KVD_CHECK(it != pool.pins.end());
    if (--it->second == 0) pool.pins.erase(it);
    UnrefLocked(pool_id, b);
  }
}

absl::Status KvCache::FinishUnitPull(const RequestId& id, PoolId pool_id, int64_t depth, const UnitTargets& targets,
                                     bool written) {
  absl::Status status = absl::CancelledError("the pull wrote nothing");
  {
    absl::MutexLock lock(&mu_);
    ExpireLocked(nullptr);
    // The pull is done writing: the request writes its blocks again (or, gone, they go).
    UnpinLocked(pool_id, targets.blocks);
    if (written) status = AdoptUnitLocked(id, pool_id, depth, targets);
    if (!status.ok()) {  // the loose units were never the request's tables': they go back
      for (BlockIndex b : targets.loose) {
        if (const Owner* w = owners_.OwnerOf(pool_id, b); w != nullptr) {
          const Owner writer = *w;
          KVD_CHECK(owners_.Release(pool_id, b, writer).ok());
        }
        KVD_CHECK(pools_[pool_id]->blocks[b].kind == BlockState::Kind::kOwned && pools_[pool_id]->blocks[b].refs == 1);
        UnrefLocked(pool_id, b);
      }
    }
    UpdatePressureLocked();
  }
  Deliver();
  return status;
}

absl::Status KvCache::AdoptUnitLocked(const RequestId& id, PoolId pool_id, int64_t depth, const UnitTargets& targets) {
  KVD_ASSIGN_OR_RETURN(Request * req, FindRequestLocked(id));
  if (req->pool != pool_id) return absl::FailedPreconditionError("the pull's pool is not the request's");
  Pool& pool = *pools_[req->pool];
  const PoolGeometry& geo = pool.geometry;
  const int32_t bt = geo.block_tokens;
  // What was pinned is still what a pull to `depth` writes, and still publishable.
  KVD_ASSIGN_OR_RETURN(std::vector<BlockIndex> expected, UnitTargetsLocked(*req, depth));
  size_t loose_seen = 0;
  bool same = expected.size() == targets.blocks.size();
  for (size_t i = 0; same && i < expected.size(); ++i) {
    if (expected[i] != HybridSpine::kNone) {
      same = expected[i] == targets.blocks[i];
    } else {
      same = loose_seen < targets.loose.size() && targets.loose[loose_seen++] == targets.blocks[i];
    }
  }
  if (!same || loose_seen != targets.loose.size()) {
    return absl::FailedPreconditionError(absl::StrCat("request '", id.value(), "''s tables changed during its pull"));
  }
  const int64_t skip = req->cached_tokens / bt;
  const int64_t n = req->num_tokens;
  // Each state group's slot, noted before the grow appends a spare.
  std::vector<StateCheckpoint> checkpoints;
  bool off_grid = false;
  for (size_t g = 0; g < geo.groups.size(); ++g) {
    if (geo.groups[g].attention()) continue;
    checkpoints.push_back({static_cast<int>(g), depth * bt, req->groups[g].blocks.back()});
    const bool off = depth % geo.groups[g].checkpoint_every_blocks != 0;
    off_grid |= off;
    if (off && !geo.groups[g].checkpoint_at_end) {
      return absl::FailedPreconditionError(absl::StrCat("group '", geo.groups[g].name, "' takes no checkpoint at block ",
                                                        depth, " (off its grid, checkpoint_at_end false)"));
    }
  }
  // Room for what the tables of a hit at `depth` add (GrowGroupsLocked's appends), checked before
  // anything changes.
  const int64_t horizon = (std::min(n, depth * bt + geo.step_tokens_or_default()) + bt - 1) / bt;
  for (size_t g = 0; g < geo.groups.size(); ++g) {
    if (static_cast<int>(g) == pool.spine_group || geo.groups[g].kind == KvGroupKind::kFull) continue;
    const Request::Group& rg = req->groups[g];
    int64_t add = 0, released = 0;
    if (geo.groups[g].attention()) {
      const int64_t lo = depth - NeedOf(geo, static_cast<int>(g), depth);
      const int64_t end = std::max(rg.first + static_cast<int64_t>(rg.blocks.size()), depth);
      add = std::max<int64_t>(0, horizon - std::max(end, lo));
    } else {
      add = std::max<int64_t>(0, 2 - static_cast<int64_t>(rg.blocks.size()));
      released = rg.checkpoint != HybridSpine::kNone && pool.blocks[rg.checkpoint].refs == 1 ? 1 : 0;
    }
    if (add > pool.allocator.num_free(static_cast<int>(g)) + pool.EvictableIn(static_cast<int>(g)) + released) {
      return absl::ResourceExhaustedError(absl::StrCat("group '", geo.groups[g].name, "' has no room for the ", add,
                                                       " units a hit at block ", depth, " holds"));
    }
  }
  // Nothing fails from here on. The loose units join their tables: appended where they continue
  // them, else in place of the table (wholly below the new hit's first needed block).
  const Owner writer = WriterOf(*req);
  {
    const std::vector<UnitPart> layout = UnitLayout(geo, skip, depth);
    for (size_t g = 0; g < geo.groups.size(); ++g) {
      std::vector<BlockIndex> mine;
      int64_t first_position = -1;
      for (size_t i = 0; i < layout.size(); ++i) {
        if (layout[i].group != static_cast<int>(g) || expected[i] != HybridSpine::kNone) continue;
        if (first_position < 0) first_position = layout[i].position;
        mine.push_back(targets.blocks[i]);
      }
      if (mine.empty()) continue;
      Request::Group& rg = req->groups[g];
      if (first_position > rg.first + static_cast<int64_t>(rg.blocks.size())) {
        for (BlockIndex b : rg.blocks) {
          if (const Owner* w = owners_.OwnerOf(req->pool, b); w != nullptr && *w == writer) {
            KVD_CHECK(owners_.Release(req->pool, b, writer).ok());
          }
          UnrefLocked(req->pool, b);  // unpublished: freed; a hit's: cached, evictable
        }
        rg.blocks.clear();
        rg.first = first_position;
      }
      rg.blocks.insert(rg.blocks.end(), mine.begin(), mine.end());
    }
  }
  // The tables as a hit at `depth` holds them: each window group from its first needed block to
  // the step horizon (blocks below, never written by the pull, go back unpublished), the old
  // hit's checkpoint let go and a spare in its stead.
  const absl::StatusOr<std::vector<GroupTable>> grown = GrowGroupsLocked(*req, 0, depth * bt);
  KVD_CHECK(grown.ok());
  // The blocks and the checkpoints are published as one unit (an off-grid checkpoint as the
  // unit's tail, as the lender kept it).
  const uint64_t published_before = counters_.published_blocks;
  absl::StatusOr<PublishResult> published =
      PublishLocked(id, absl::MakeConstSpan(req->spec.prompt).first(depth * bt),
                    absl::MakeConstSpan(req->table).first(depth), /*by_pull=*/false, checkpoints, off_grid);
  KVD_CHECK(published.ok());
  counters_.published_blocks = published_before;  // a pull is not a new publish
  for (size_t i = 0; i < checkpoints.size(); ++i) {
    const StateCheckpoint& c = checkpoints[i];
    KVD_CHECK(published->checkpoint_outcomes[i] == CheckpointOutcome::kKept);
    // The request reads it as a hit's checkpoint, standing for its spare until its next grow.
    Request::Group& rg = req->groups[c.group];
    RefLocked(req->pool, c.slot);
    rg.checkpoint = c.slot;
    if (const int64_t fresh = published->fresh_slots[i]; fresh >= 0) {
      const BlockIndex b = static_cast<BlockIndex>(fresh);
      rg.blocks.erase(std::find(rg.blocks.begin(), rg.blocks.end(), b));
      KVD_CHECK(owners_.Release(req->pool, b, writer).ok());
      UnrefLocked(req->pool, b);
    }
  }
  const int64_t delta = (depth - skip) * bt;
  req->cached_tokens = depth * bt;
  counters_.hit_tokens += delta;
  counters_.miss_tokens -= delta;
  return absl::OkStatus();
}

absl::StatusOr<std::vector<GroupTable>> KvCache::GroupTablesOf(const RequestId& id) const {
  absl::MutexLock lock(&mu_);
  KVD_ASSIGN_OR_RETURN(Request * req, FindRequestLocked(id));
  if (req->groups.empty()) return std::vector<GroupTable>{};
  return GroupTablesLocked(*req);
}

}  // namespace kvd
