// KvCache: generation checkpoints, preempt and resume on hybrid pools (docs/hybrid.md §2.9). A
// pool without KV groups never reaches this file (kv_cache_publish.cc, kv_cache.cc ResumeLocked).
//
// A checkpoint of a request at p = tokens.size() tokens holds, besides the spine group's table
// [0, ceil(p / bt)) (CheckpointRecord::blocks, as on any pool):
//   window groups   the blocks a computation at position p reads: HeldRange(p, p), i.e.
//                   [floor(max(0, p - (W - 1)) / bt), ceil(p / bt)) (chunked: from p's chunk);
//   state groups    the slot the engine names, holding the state at exactly p. It leaves the
//                   request's table (a live request gets a fresh spare in its place; a preempt
//                   needs none) and is never written again.
// Every unit is referenced by the record, so nothing it holds is evicted or handed out; the
// request's reservation covers them while it lives (a live checkpoint's slot grows the state
// group's reservation to 3: running, spare and the record's), and an orphaned record is charged
// its units per group. A resume takes the units over without a copy, except the state: the slot
// comes back as the state group's checkpoint_slot, which the engine copies into its running slot
// before computing position p (as after a hit), and which stands for the spare until the next
// grow. A resume is exact or refused: a block at or past the position's block that was published
// since, or that a fence or pull may still write, is FAILED_PRECONDITION (the fence lifts; a
// plain start then hits what was published).
//
// A flush writes an orphaned or live record whole (TierStore::FlushCheckpoints: every unit, one
// checksum) and a warm restart brings it back (RestoreCheckpoint): fresh units of the same layout,
// owned by the record and filled by the tier before anyone can resume it.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "proto/vocab/status_macros.h"
#include "server/core/kv_cache.h"

namespace kvd {

std::vector<BlockIndex> KvCache::AllBlocksOf(const CheckpointRecord& ckpt) {
  std::vector<BlockIndex> out = ckpt.blocks;
  for (const CheckpointRecord::Group& g : ckpt.groups) {
    out.insert(out.end(), g.blocks.begin(), g.blocks.end());
    if (g.slot != HybridSpine::kNone) out.push_back(g.slot);
  }
  return out;
}

int64_t KvCache::ChargedBytesLocked(const CheckpointRecord& ckpt) const {
  return ckpt.charged_units.empty() ? ledger_.BytesOf(ckpt.pool, ckpt.charged_blocks)
                                    : ledger_.BytesOfUnits(ckpt.pool, ckpt.charged_units);
}

std::vector<int64_t> KvCache::UnitsOfLocked(PoolId pool, absl::Span<const BlockIndex> blocks) const {
  const Pool& p = *pools_[pool];
  std::vector<int64_t> units(p.geometry.groups.size(), 0);
  for (BlockIndex b : blocks) ++units[p.allocator.GroupOf(b)];
  return units;
}

absl::StatusOr<KvCache::GroupCheckpointPlan> KvCache::PlanGroupCheckpointLocked(
    const Request& req, int64_t tokens, absl::Span<const StateCheckpoint> state, bool ending) const {
  const Pool& pool = *pools_[req.pool];
  const PoolGeometry& geo = pool.geometry;
  const int num_groups = static_cast<int>(geo.groups.size());
  GroupCheckpointPlan plan;
  plan.groups.resize(num_groups);
  plan.grow.assign(num_groups, 0);
  std::vector<bool> named(num_groups, false);
  for (const StateCheckpoint& c : state) {
    if (c.group < 0 || c.group >= num_groups || geo.groups[c.group].kind != KvGroupKind::kState) {
      return absl::InvalidArgumentError(absl::StrCat("state_checkpoints: group ", c.group, " of pool '", geo.name,
                                                     "' is not a state group"));
    }
    if (named[c.group]) {
      return absl::InvalidArgumentError(absl::StrCat("state_checkpoints: group '", geo.groups[c.group].name,
                                                     "' is named twice"));
    }
    named[c.group] = true;
    if (c.position_tokens != tokens) {
      return absl::InvalidArgumentError(absl::StrCat(
          "state_checkpoints: position_tokens ", c.position_tokens, " of group '", geo.groups[c.group].name,
          "' is not the checkpoint's position (", tokens, " tokens): the slot must hold the state there"));
    }
    const std::vector<BlockIndex>& mine = req.groups[c.group].blocks;
    if (std::find(mine.begin(), mine.end(), c.slot) == mine.end()) {
      return absl::InvalidArgumentError(absl::StrCat("state_checkpoints: slot ", c.slot, " is not one of request '",
                                                     req.spec.id.value(), "''s slots of group '",
                                                     geo.groups[c.group].name, "'"));
    }
    plan.groups[c.group].slot = c.slot;
  }
  for (int g = 0; g < num_groups; ++g) {
    const KvGroup& k = geo.groups[g];
    if (k.kind == KvGroupKind::kState) {
      if (!named[g]) {
        return absl::InvalidArgumentError(absl::StrCat(
            "state_checkpoints: pool '", geo.name, "' has state group '", k.name, "'; a checkpoint of request '",
            req.spec.id.value(), "' must name the slot holding its state at ", tokens, " tokens"));
      }
      if (!ending) {
        // Running, spare and the record's slot: the request's reservation covers all three.
        plan.grow[g] = std::max<int64_t>(0, 3 - req.reserved_units[g]);
        if (pool.allocator.num_free(g) + pool.EvictableIn(g) < 1) {
          return absl::ResourceExhaustedError(absl::StrCat("group '", k.name, "' of pool '", geo.name,
                                                           "' has no slot for the request's fresh spare"));
        }
      }
      continue;
    }
    if (g == pool.spine_group) continue;  // CheckpointRecord::blocks
    const auto [lo, hi] = HeldRange(geo, g, tokens, tokens);
    const Request::Group& rg = req.groups[g];
    const int64_t end = rg.first + static_cast<int64_t>(rg.blocks.size());
    if (lo < rg.first || hi > end) {
      return absl::FailedPreconditionError(absl::StrCat(
          "request '", req.spec.id.value(), "' holds blocks [", rg.first, ", ", end, ") of group '", k.name,
          "', not the blocks [", lo, ", ", hi, ") a checkpoint at ", tokens,
          " tokens keeps (computed_tokens went past it, or the grow that hands them out has not run)"));
    }
    plan.groups[g].first = lo;
    plan.groups[g].blocks.assign(rg.blocks.begin() + (lo - rg.first), rg.blocks.begin() + (hi - rg.first));
  }
  if (!ending && !ledger_.CanReserveUnits(req.pool, plan.grow)) {
    return absl::ResourceExhaustedError(absl::StrCat("request '", req.spec.id.value(),
                                                     "' cannot reserve the slot its checkpoint keeps"));
  }
  if (!ending) KVD_RETURN_IF_ERROR(CheckWorkerLimitsLocked(req.spec.limit_key(), 0, ledger_.BytesOfUnits(req.pool, plan.grow)));
  return plan;
}

void KvCache::ApplyGroupCheckpointLocked(Request& req, CheckpointRecord& rec, GroupCheckpointPlan plan, bool ending,
                                         std::vector<int64_t>* fresh_slots) {
  const Owner writer = WriterOf(req);
  int64_t grown = 0;
  for (int64_t u : plan.grow) grown += u;
  if (grown > 0) {
    KVD_CHECK(ledger_.ReserveUnits(req.pool, plan.grow).ok());
    workers_.AddUsage(req.spec.limit_key(), 0, ledger_.BytesOfUnits(req.pool, plan.grow));
    for (size_t g = 0; g < plan.grow.size(); ++g) req.reserved_units[g] += plan.grow[g];
    req.reserved_blocks += grown;
  }
  rec.groups = std::move(plan.groups);
  for (size_t g = 0; g < rec.groups.size(); ++g) {
    CheckpointRecord::Group& rg = rec.groups[g];
    for (BlockIndex b : rg.blocks) RefLocked(req.pool, b);
    if (rg.slot == HybridSpine::kNone) continue;
    // The slot passes from the request's table to the record (its reference with it); nobody
    // writes it again. BlockState::owner stays the request's serial, which the record shares.
    std::vector<BlockIndex>& slots = req.groups[g].blocks;
    const auto at = std::find(slots.begin(), slots.end(), rg.slot);
    KVD_CHECK(at != slots.end());
    if (const Owner* w = owners_.OwnerOf(req.pool, rg.slot); w != nullptr && *w == writer) {
      KVD_CHECK(owners_.Release(req.pool, rg.slot, writer).ok());
    }
    const size_t k = static_cast<size_t>(at - slots.begin());
    slots.erase(at);
    int64_t fresh = -1;
    if (!ending) {
      absl::StatusOr<std::vector<BlockIndex>> got =
          AllocateOwnedLocked(req.pool, 1, req.serial, &writer, static_cast<int>(g));
      KVD_CHECK(got.ok());  // checked by the plan
      slots.insert(slots.begin() + static_cast<std::ptrdiff_t>(k), got->front());
      fresh = got->front();
    }
    if (fresh_slots != nullptr) fresh_slots->push_back(fresh);
  }
}

absl::StatusOr<AcquireResult> KvCache::ResumeGroupsLocked(Request& req, CheckpointRecord& ckpt) {
  Pool& pool = *pools_[req.pool];
  const PoolGeometry& geo = pool.geometry;
  if (ckpt.pool != req.pool || ckpt.groups.size() != geo.groups.size()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "checkpoint '", ckpt.id.value(), "' was taken on pool '", pools_[ckpt.pool]->geometry.name,
        "' (another KV grouping than pool '", geo.name, "'s): resume it on its own pool"));
  }
  if (!(ckpt.ns == req.spec.ns)) {
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint '", ckpt.id.value(), "' belongs to another namespace than the request"));
  }
  const std::vector<Token>& prompt = req.spec.prompt;
  const size_t common = std::min(prompt.size(), ckpt.tokens.size());
  if (!std::equal(prompt.begin(), prompt.begin() + common, ckpt.tokens.begin())) {
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint '", ckpt.id.value(), "' does not continue the request's prompt"));
  }
  std::vector<Token> tokens = ckpt.tokens.size() >= prompt.size() ? ckpt.tokens : prompt;
  const int32_t bt = geo.block_tokens;
  const int64_t valid = static_cast<int64_t>(ckpt.tokens.size());
  const int64_t n = static_cast<int64_t>(tokens.size());
  const int64_t tail = valid / bt;  // the block position of the next token to compute
  const int num_groups = static_cast<int>(geo.groups.size());
  // Exact or not at all: a block from the tail on must still be the record's alone (writable by
  // the resumed request, nobody else writing it); below it, a fence's writer writes nothing (it
  // writes past what it computed), so such a block is taken from its fence.
  auto check = [&](int g, int64_t position, BlockIndex b) -> absl::Status {
    mu_.AssertHeld();
    const Owner* w = owners_.OwnerOf(req.pool, b);
    const BlockState& s = pool.blocks[b];
    const bool at_tail = position >= tail;
    if ((at_tail && (s.kind != BlockState::Kind::kOwned || FencedLocked(req.pool, b))) ||
        (w != nullptr && (at_tail || w->kind != OwnerKind::kFence))) {
      return absl::FailedPreconditionError(absl::StrCat(
          "checkpoint '", ckpt.id.value(), "' cannot be resumed exactly now: block ", b, " at position ", position,
          " of group '", geo.groups[g].name, "' ",
          s.kind == BlockState::Kind::kCached ? "was published since (start without resume_from to hit it)"
                                              : "may still be written by a lost worker (its fence lifts in time)"));
    }
    return absl::OkStatus();
  };
  const int spine = pool.spine_group;
  for (size_t i = 0; i < ckpt.blocks.size(); ++i) KVD_RETURN_IF_ERROR(check(spine, static_cast<int64_t>(i), ckpt.blocks[i]));
  std::vector<int64_t> fresh(num_groups, 0), held(num_groups, 0), lo(num_groups, 0);
  for (int g = 0; g < num_groups; ++g) {
    const CheckpointRecord::Group& rg = ckpt.groups[g];
    const auto [l, hi] = HeldRange(geo, g, n, valid);
    lo[g] = l;
    if (geo.groups[g].kind == KvGroupKind::kState) {
      if (rg.slot == HybridSpine::kNone) {
        return absl::FailedPreconditionError(
            absl::StrCat("checkpoint '", ckpt.id.value(), "' holds no state of group '", geo.groups[g].name, "'"));
      }
      fresh[g] = 1;  // the running slot; the record's stands for the spare until the next grow
      held[g] = 2;
      continue;
    }
    if (g == spine) {
      held[g] = geo.BlocksFor(n);
      fresh[g] = held[g] - static_cast<int64_t>(ckpt.blocks.size());
      continue;
    }
    if (rg.first != l) {
      return absl::FailedPreconditionError(absl::StrCat("checkpoint '", ckpt.id.value(), "''s blocks of group '",
                                                        geo.groups[g].name, "' do not start where its window does"));
    }
    for (size_t i = 0; i < rg.blocks.size(); ++i) {
      KVD_RETURN_IF_ERROR(check(g, rg.first + static_cast<int64_t>(i), rg.blocks[i]));
    }
    held[g] = hi - l;
    fresh[g] = held[g] - static_cast<int64_t>(rg.blocks.size());
  }
  std::vector<int64_t> grow(num_groups, 0);
  for (int g = 0; g < num_groups; ++g) {
    if (fresh[g] > pool.allocator.num_free(g) + pool.EvictableIn(g)) {
      return absl::ResourceExhaustedError(absl::StrCat("group '", geo.groups[g].name, "' of pool '", geo.name,
                                                       "' has too few reclaimable units for the resumed request"));
    }
    grow[g] = std::max<int64_t>(0, held[g] - req.reserved_units[g]);
  }
  const int64_t charged_bytes = ChargedBytesLocked(ckpt);
  if (!ckpt.charged_units.empty()) ledger_.UnreserveUnits(ckpt.pool, ckpt.charged_units);
  if (!ledger_.CanReserveUnits(req.pool, grow)) {
    if (!ckpt.charged_units.empty()) KVD_CHECK(ledger_.ReserveUnits(ckpt.pool, ckpt.charged_units).ok());
    return absl::ResourceExhaustedError("KV budget cannot cover the resumed generation's units");
  }
  // Nothing fails from here on.
  KVD_CHECK(ledger_.ReserveUnits(req.pool, grow).ok());
  for (int g = 0; g < num_groups; ++g) {
    req.reserved_units[g] += grow[g];
    req.reserved_blocks += grow[g];
  }
  workers_.AddUsage(req.spec.limit_key(), 0, ledger_.BytesOfUnits(req.pool, grow));
  orphan_blocks_bytes_ -= charged_bytes;

  // The record's references pass to the request; its owned units to the request's writer.
  const Owner writer = WriterOf(req);
  auto take = [&](BlockIndex b) {
    mu_.AssertHeld();
    BlockState& s = pool.blocks[b];
    if (s.kind != BlockState::Kind::kOwned) return;
    s.owner = req.serial;
    if (const Owner* w = owners_.OwnerOf(req.pool, b); w != nullptr) {
      const Owner fence = *w;  // below the tail, as checked above
      KVD_CHECK(owners_.Transfer(req.pool, b, fence, writer).ok());
    } else {
      KVD_CHECK(owners_.Assign(req.pool, b, writer).ok());
    }
  };
  req.groups.assign(num_groups, Request::Group{});
  req.table = ckpt.blocks;
  for (BlockIndex b : req.table) take(b);
  for (int g = 0; g < num_groups; ++g) {
    CheckpointRecord::Group& rg = ckpt.groups[g];
    Request::Group& mine = req.groups[g];
    if (geo.groups[g].kind == KvGroupKind::kState) {
      take(rg.slot);
      mine.checkpoint = rg.slot;
    } else if (g != spine) {
      mine.first = lo[g];
      mine.blocks = rg.blocks;
      for (BlockIndex b : mine.blocks) take(b);
    }
    std::vector<BlockIndex>& units = g == spine ? req.table : mine.blocks;
    absl::StatusOr<std::vector<BlockIndex>> owned = AllocateOwnedLocked(req.pool, fresh[g], req.serial, &writer, g);
    KVD_CHECK(owned.ok());
    units.insert(units.end(), owned->begin(), owned->end());
  }
  req.known_tokens = tokens;
  req.num_tokens = n;
  req.cached_tokens = valid;
  req.computed_tokens = valid;

  AcquireResult out;
  out.pool = req.pool;
  out.blocks = req.table;
  out.num_tokens = n;
  out.cached_tokens = valid;
  out.resumed = true;
  out.resumed_tokens = std::move(tokens);
  out.engine_state = std::move(ckpt.engine_state);
  out.group_tables = GroupTablesLocked(req);
  orphans_.erase({ckpt.expires_at, ckpt.serial});
  ChargeCheckpointStateLocked(ckpt, -1);
  checkpoints_.erase(ckpt.id);  // destroys `ckpt`
  counters_.resumed++;
  return out;
}

std::vector<int64_t> KvCache::CheckpointUnitsLocked(PoolId pool_id, int64_t tokens) const {
  const Pool& pool = *pools_[pool_id];
  const PoolGeometry& geo = pool.geometry;
  std::vector<int64_t> units(geo.groups.size(), 0);
  for (int g = 0; g < static_cast<int>(geo.groups.size()); ++g) {
    if (g == pool.spine_group) {
      units[g] = geo.BlocksFor(tokens);
    } else if (geo.groups[g].kind == KvGroupKind::kState) {
      units[g] = 1;
    } else {
      const auto [lo, hi] = HeldRange(geo, g, tokens, tokens);  // as PlanGroupCheckpointLocked keeps
      units[g] = hi - lo;
    }
  }
  return units;
}

absl::Status KvCache::AllocateCheckpointUnitsLocked(PoolId pool_id, int64_t tokens, uint64_t serial,
                                                    CheckpointRecord& rec) {
  Pool& pool = *pools_[pool_id];
  const PoolGeometry& geo = pool.geometry;
  const std::vector<int64_t> units = CheckpointUnitsLocked(pool_id, tokens);
  std::vector<std::vector<BlockIndex>> got(geo.groups.size());
  for (int g = 0; g < static_cast<int>(geo.groups.size()); ++g) {
    absl::StatusOr<std::vector<BlockIndex>> owned = AllocateOwnedLocked(pool_id, units[g], serial, nullptr, g);
    if (!owned.ok()) {
      for (auto it = got.rbegin(); it != got.rend(); ++it) UnrefTableLocked(pool_id, *it);
      return owned.status();
    }
    got[g] = *std::move(owned);
  }
  rec.groups.assign(geo.groups.size(), CheckpointRecord::Group{});
  for (int g = 0; g < static_cast<int>(geo.groups.size()); ++g) {
    CheckpointRecord::Group& rg = rec.groups[g];
    if (g == pool.spine_group) {
      rec.blocks = std::move(got[g]);
    } else if (geo.groups[g].kind == KvGroupKind::kState) {
      rg.slot = got[g].front();
    } else {
      rg.first = HeldRange(geo, g, tokens, tokens).first;
      rg.blocks = std::move(got[g]);
    }
  }
  return absl::OkStatus();
}

}  // namespace kvd
