// KvCache: hybrid pools' per-group admission, tables and window release (docs/hybrid.md §2.4,
// §2.5). A pool without KV groups never reaches this file.
//
// What a request holds in each group, given its n tokens, its engine's last report of c computed
// tokens, S = the pool's step_tokens and bt = block_tokens (block positions, half open):
//   full            [0, ceil(n / bt))
//   sliding_window  [floor(max(0, c - (W - 1)) / bt), ceil(min(n, c + S) / bt))
//   chunked_local   [floor(c / C) * C / bt,            ceil(min(n, c + S) / bt))
//   state           2 slots (running, spare), from Acquire to the end
// so a window group never holds more than §2.5's reservation, ceil((W - 1 + S) / bt) + 1 blocks
// (chunked: ceil((C - 1 + S) / bt)), and only the full groups grow with n. The window of the
// positions up to c + S is what the engine may compute before its next report: positions past it
// get their window blocks from the grow that reports c.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "proto/vocab/status_macros.h"
#include "server/core/kv_cache.h"

namespace kvd {
namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

std::pair<int64_t, int64_t> KvCache::HeldRange(const PoolGeometry& geo, int g, int64_t n, int64_t c) {
  const KvGroup& k = geo.groups[g];
  const int64_t bt = geo.block_tokens;
  const int64_t horizon = CeilDiv(std::min(n, c + geo.step_tokens_or_default()), bt);
  switch (k.kind) {
    case KvGroupKind::kFull: return {0, CeilDiv(n, bt)};
    case KvGroupKind::kSlidingWindow: {
      const int64_t lo = std::max<int64_t>(0, c - (k.window - 1)) / bt;
      return {std::min(lo, horizon), horizon};
    }
    case KvGroupKind::kChunkedLocal: {
      const int64_t lo = (c / k.chunk) * k.chunk / bt;
      return {std::min(lo, horizon), horizon};
    }
    case KvGroupKind::kState: return {0, 2};
  }
  return {0, 0};
}

std::vector<int64_t> KvCache::UnitsFor(const PoolGeometry& geo, int64_t tokens) {
  std::vector<int64_t> units;
  for (size_t g = 0; g < geo.groups.size(); ++g) units.push_back(geo.GroupUnitsFor(static_cast<int>(g), tokens));
  return units;
}

absl::Status KvCache::CheckGroupsFitLocked(PoolId pool, const RequestSpec& spec) const {
  const PoolGeometry& geo = pool_geometries_[pool];
  const std::vector<int64_t> units = UnitsFor(geo, static_cast<int64_t>(spec.prompt.size()) + spec.max_new_tokens);
  for (size_t g = 0; g < units.size(); ++g) {
    if (units[g] > geo.groups[g].capacity) {
      return absl::OutOfRangeError(absl::StrCat("request needs ", units[g], " ",
                                                geo.groups[g].attention() ? "blocks" : "slots", " of group '",
                                                geo.groups[g].name, "' of pool '", geo.name, "', which holds ",
                                                geo.groups[g].capacity));
    }
  }
  if (ledger_.BytesOfUnits(pool, units) > ledger_.budget_bytes()) {
    return absl::OutOfRangeError(absl::StrCat("request needs ", ledger_.BytesOfUnits(pool, units),
                                              " bytes: larger than the whole budget"));
  }
  return absl::OkStatus();
}

int64_t KvCache::ReservedBytesLocked(const Request& req) const {
  return req.reserved_units.empty() ? ledger_.BytesOf(req.pool, req.reserved_blocks)
                                    : ledger_.BytesOfUnits(req.pool, req.reserved_units);
}

std::vector<BlockIndex> KvCache::AllBlocksOf(const Request& req) {
  std::vector<BlockIndex> out = req.table;
  for (const Request::OwnCopy& c : req.own_copies) out.push_back(c.block);  // kv_cache_publish.cc
  for (const Request::Group& g : req.groups) {
    out.insert(out.end(), g.blocks.begin(), g.blocks.end());
    if (g.checkpoint != HybridSpine::kNone) out.push_back(g.checkpoint);
  }
  return out;
}

std::vector<GroupTable> KvCache::GroupTablesLocked(const Request& req) const {
  const Pool& pool = *pools_[req.pool];
  std::vector<GroupTable> out;
  for (size_t g = 0; g < req.groups.size(); ++g) {
    GroupTable t;
    t.group = static_cast<int>(g);
    t.name = pool.geometry.groups[g].name;
    t.first_block_position = req.groups[g].first;
    t.blocks = static_cast<int>(g) == pool.spine_group ? req.table : req.groups[g].blocks;
    if (req.groups[g].checkpoint != HybridSpine::kNone) t.checkpoint_slot = req.groups[g].checkpoint;
    out.push_back(std::move(t));
  }
  return out;
}

absl::StatusOr<AcquireResult> KvCache::AcquireGroupsLocked(Request& req) {
  Pool& pool = *pools_[req.pool];
  const PoolGeometry& geo = pool.geometry;
  const int32_t bt = geo.block_tokens;
  const int64_t n = static_cast<int64_t>(req.spec.prompt.size());
  const int num_groups = static_cast<int>(geo.groups.size());
  // The hit every group serves (§2.6): depth d, c = d * bt tokens computed. A pool without a
  // spine (no full group) serves none.
  std::vector<CachedBlock*> chain;
  HybridHit hit;
  if (pool.spine != nullptr) LookupHybridLocked(pool, req.spec.ns, req.spec.prompt, req.keys, &chain, &hit);
  int64_t d = hit.depth;
  int64_t c = d * bt;
  // Per group: the hit's units (referenced, read-only) and the fresh ones; hit units evictable now
  // stop being so once referenced, so room for the fresh ones is checked without them first.
  std::vector<int64_t> need(num_groups), pinning(num_groups, 0), lo(num_groups);
  auto hit_units = [&](int g) -> std::vector<BlockIndex> {
    std::vector<BlockIndex> units;
    if (d == 0) return units;
    if (g == pool.spine_group) {
      for (int64_t i = 0; i < d; ++i) units.push_back(chain[i]->address.index);
    } else if (geo.groups[g].attention()) {
      units = hit.groups[g].blocks;
    } else if (hit.groups[g].checkpoint != HybridSpine::kNone) {
      units.push_back(hit.groups[g].checkpoint);
    }
    return units;
  };
  // A hit's checkpoint is a state unit beyond the request's 2 reserved slots: where its group has
  // no room for it, the request starts without the hit rather than not at all.
  for (bool retry = true; retry;) {
    retry = false;
    for (int g = 0; g < num_groups; ++g) {
      const auto [l, hi] = HeldRange(geo, g, n, c);
      lo[g] = l;
      // A state group: the running slot, and the spare, or on a hit the checkpoint in its stead
      // until the next grow (so a request holds no more than its 2 reserved units).
      need[g] = geo.groups[g].kind != KvGroupKind::kState ? hi - std::max(l, d) : hi - l - (d > 0 ? 1 : 0);
      if (geo.groups[g].attention() && g != pool.spine_group) KVD_CHECK(hit.groups[g].first_position == l || d == 0);
      pinning[g] = 0;
      for (BlockIndex b : hit_units(g)) pinning[g] += pool.blocks[b].refs == 0 ? 1 : 0;
      if (need[g] + pinning[g] <= pool.allocator.num_free(g) + pool.EvictableIn(g)) continue;
      if (d > 0) {
        hit.limited_by = g;
        d = 0;
        c = 0;
        retry = true;
        break;
      }
      return absl::ResourceExhaustedError(absl::StrCat("group '", geo.groups[g].name, "' of pool '", geo.name,
                                                       "' has ", pool.allocator.num_free(g) + pool.EvictableIn(g),
                                                       " reclaimable units, need ", need[g] + pinning[g]));
    }
  }
  const Owner writer = WriterOf(req);
  req.groups.assign(num_groups, Request::Group{});
  for (int g = 0; g < num_groups; ++g) {
    std::vector<BlockIndex> units = hit_units(g);
    for (BlockIndex b : units) RefLocked(req.pool, b);
    if (geo.groups[g].kind == KvGroupKind::kState) {
      if (!units.empty()) req.groups[g].checkpoint = units.front();
      units.clear();
    }
    if (g == pool.spine_group) {
      for (int64_t i = 0; i < d; ++i) {
        if (options_.eviction_policy != EvictionPolicy::kLru) chain[i]->reused = true;  // referenced: not queued
        pool.NoteUse(*chain[i], /*reused=*/true);
      }
      req.table = std::move(units);
    } else {
      req.groups[g].blocks = std::move(units);
      req.groups[g].first = geo.groups[g].attention() ? lo[g] : 0;
    }
  }
  for (int g = 0; g < num_groups; ++g) {
    absl::StatusOr<std::vector<BlockIndex>> owned = AllocateOwnedLocked(req.pool, need[g], req.serial, &writer, g);
    KVD_CHECK(owned.ok());
    std::vector<BlockIndex>& held = g == pool.spine_group ? req.table : req.groups[g].blocks;
    held.insert(held.end(), owned->begin(), owned->end());
  }
  req.num_tokens = n;
  req.cached_tokens = c;
  req.computed_tokens = c;
  counters_.lookups++;
  counters_.hit_tokens += c;
  counters_.miss_tokens += n - c;
  AcquireResult out;
  out.pool = req.pool;
  out.blocks = req.table;
  out.num_tokens = n;
  out.cached_tokens = c;
  out.full_hit_tokens = hit.full_depth * bt;
  out.limited_by = hit.limited_by;
  if (hit.limited_by >= 0) {
    Pool::Limits& l = pool.limits[hit.limited_by];
    ++l.hits;
    l.tokens += static_cast<uint64_t>(std::max<int64_t>(0, out.full_hit_tokens - c));
  }
  if (d > 0) {
    std::vector<CachedBlock*> hit_nodes(chain.begin(), chain.begin() + d);
    out.publishers = PublishersLocked(hit_nodes);
  }
  out.group_tables = GroupTablesLocked(req);
  return out;
}

absl::StatusOr<std::vector<GroupTable>> KvCache::GrowGroupsLocked(Request& req, int64_t additional_tokens,
                                                                  int64_t computed_tokens,
                                                                  absl::Span<const BlockIndex> credit,
                                                                  absl::Span<const int> credit_groups) {
  Pool& pool = *pools_[req.pool];
  const PoolGeometry& geo = pool.geometry;
  // Credit per (pool, group) (kv_cache_step.cc): each entry names its group, is of that group's
  // range, and is the worker's credit, named once. Checked before anything changes.
  std::vector<int64_t> given(geo.groups.size(), 0);
  const cache_state::PoolCredit* pc = credit.empty() ? nullptr : FindCreditLocked(req.spec.owner, req.pool);
  if (credit_groups.size() != credit.size()) {
    return absl::InvalidArgumentError(absl::StrCat("credit_blocks: pool '", geo.name,
                                                   "' has KV groups; a grow names {group, block} credit entries"));
  }
  for (size_t i = 0; i < credit.size(); ++i) {
    const int g = credit_groups[i];
    const BlockIndex b = credit[i];
    if (g < 0 || g >= static_cast<int>(geo.groups.size())) {
      return absl::InvalidArgumentError(absl::StrCat("credit entry ", i, " names group ", g, "; pool '", geo.name,
                                                     "' has ", geo.groups.size()));
    }
    if (b >= pool.blocks.size() || pool.allocator.GroupOf(b) != g) {
      return absl::InvalidArgumentError(absl::StrCat(
          "credit block ", b, " is not of group '", geo.groups[g].name, "' of pool '", geo.name, "'",
          b < pool.blocks.size() ? absl::StrCat(" (it is group '", geo.groups[pool.allocator.GroupOf(b)].name, "''s)")
                                 : std::string()));
    }
    if (pc == nullptr || !owners_.BlocksOf(pc->serial).contains(b) ||
        std::find(credit.begin(), credit.begin() + i, b) != credit.begin() + i) {
      return absl::InvalidArgumentError(absl::StrCat("block ", b, " is not in this worker's credit of group '",
                                                     geo.groups[g].name, "' in pool '", geo.name,
                                                     "' (used twice, or never granted)"));
    }
    ++given[g];
  }
  const int64_t n = req.num_tokens + additional_tokens;
  const int64_t c = computed_tokens == 0 ? req.computed_tokens : computed_tokens;
  if (c < req.computed_tokens || c > n) {
    return absl::InvalidArgumentError(absl::StrCat("computed_tokens ", computed_tokens, " of request '",
                                                   req.spec.id.value(), "' must be between its last report (",
                                                   req.computed_tokens, ") and its tokens (", n, ")"));
  }
  const int num_groups = static_cast<int>(geo.groups.size());
  struct Plan {
    int64_t lo = 0, hi = 0;        // the new held range
    int64_t drop = 0;              // leading blocks released
    int64_t add = 0;               // blocks appended
    int64_t freed = 0;             // released blocks that go back to the free list
    int64_t cached = 0;            // released blocks that stay cached (published)
  };
  std::vector<Plan> plan(num_groups);
  std::vector<int64_t> grow(num_groups, 0), from_credit(num_groups, 0), extra(num_groups, 0);
  bool grows = false;
  for (int g = 0; g < num_groups; ++g) {
    Plan& p = plan[g];
    const std::vector<BlockIndex>& held = g == pool.spine_group ? req.table : req.groups[g].blocks;
    const int64_t first = req.groups[g].first;
    const int64_t end = first + static_cast<int64_t>(held.size());
    std::tie(p.lo, p.hi) = HeldRange(geo, g, n, c);
    // A state group keeps its slots; one short of two (a hit's checkpoint stood for the spare, or
    // a kept checkpoint found no fresh one) gets its spare now and lets the checkpoint go.
    if (geo.groups[g].kind == KvGroupKind::kState) p.lo = first, p.hi = std::max(end, first + 2);
    p.lo = std::max(p.lo, first);  // never moves back
    p.drop = std::min(p.lo, end) - first;
    p.add = std::max<int64_t>(0, p.hi - std::max(end, p.lo));
    if (const BlockIndex cp = req.groups[g].checkpoint; cp != HybridSpine::kNone && pool.blocks[cp].refs == 1) {
      ++p.cached;
    }
    for (int64_t i = 0; i < p.drop; ++i) {
      const BlockState& s = pool.blocks[held[i]];
      if (s.refs != 1) continue;  // someone else holds it too
      ++(s.kind == BlockState::Kind::kCached ? p.cached : p.freed);
    }
    // Credit placed past what the group appends (a window group's past computed + step_tokens)
    // is refused: the engine's table and kvd's would differ.
    if (given[g] > p.add) {
      return absl::InvalidArgumentError(absl::StrCat(
          "growing request '", req.spec.id.value(), "' to ", n, " positions (computed ", c, ") appends ", p.add,
          " blocks to group '", geo.groups[g].name, "', not the ", given[g], " credit blocks named",
          geo.groups[g].attention() && geo.groups[g].kind != KvGroupKind::kFull
              ? " (a window group holds blocks up to computed_tokens + step_tokens)" : ""));
    }
    // The spine group's reservation also covers the request's own copies of duplicates
    // (kv_cache_publish.cc: hybrid chains continue past them too).
    const int64_t copies = g == pool.spine_group ? static_cast<int64_t>(req.own_copies.size()) : 0;
    const int64_t after = static_cast<int64_t>(held.size()) - p.drop + p.add + copies;
    grow[g] = std::max<int64_t>(0, after - req.reserved_units[g]);
    // Each credit block is charged already and pays for one unit of the growth.
    from_credit[g] = std::min(grow[g], given[g]);
    extra[g] = grow[g] - from_credit[g];
    grows |= extra[g] > 0;
    // What this grow releases to the free list, or leaves evictable, may serve what it appends.
    if (p.add - given[g] > pool.allocator.num_free(g) + pool.EvictableIn(g) + p.freed + p.cached) {
      return absl::ResourceExhaustedError(absl::StrCat("group '", geo.groups[g].name, "' of pool '", geo.name,
                                                       "' has too few reclaimable units for ", p.add, " more"));
    }
  }
  // Credit is charged to the worker's principal; moved to the request's key when they differ.
  const WorkerId principal = pc != nullptr ? credit_[req.spec.owner].principal : req.spec.limit_key();
  std::vector<int64_t> charged = extra;
  if (principal != req.spec.limit_key()) {
    for (int g = 0; g < num_groups; ++g) charged[g] += from_credit[g];
  }
  if (grows || principal != req.spec.limit_key()) {
    if (!ledger_.CanReserveUnits(req.pool, extra)) {
      return absl::ResourceExhaustedError(absl::StrCat("request '", req.spec.id.value(),
                                                       "' grows past its reservation; the budget or a group is full"));
    }
    KVD_RETURN_IF_ERROR(CheckWorkerLimitsLocked(req.spec.limit_key(), 0, ledger_.BytesOfUnits(req.pool, charged)));
  }
  // Nothing fails from here on.
  const Owner writer = WriterOf(req);
  std::vector<GroupTable> out(num_groups);
  for (int g = 0; g < num_groups; ++g) {
    const Plan& p = plan[g];
    std::vector<BlockIndex>& held = g == pool.spine_group ? req.table : req.groups[g].blocks;
    for (int64_t i = 0; i < p.drop; ++i) {
      if (const Owner* w = owners_.OwnerOf(req.pool, held[i]); w != nullptr && *w == writer) {
        KVD_CHECK(owners_.Release(req.pool, held[i], writer).ok());
      }
      UnrefLocked(req.pool, held[i]);  // unpublished: freed; published: cached, evictable
      // A block the window left before the window of a hit at the computed blocks' end is interior
      // to the chain the request goes on to publish, unless the request's hit read it or a hit at
      // an anchor would: its group evicts it first, before the blocks a hit at a chain's end reads
      // (docs/hybrid.md §2.8). The others wait for the release's verdict.
      const int64_t pos = req.groups[g].first + i;
      if (pool.spine != nullptr &&
          (geo.groups[g].kind == KvGroupKind::kSlidingWindow || geo.groups[g].kind == KvGroupKind::kChunkedLocal) &&
          pos >= req.cached_tokens / geo.block_tokens && !pool.spine->WindowAnchor(g, pos) &&
          pos < c / geo.block_tokens - pool.spine->WindowNeed(g, c / geo.block_tokens)) {
        pool.side[g].evictable.MakeInterior(held[i]);
      }
    }
    held.erase(held.begin(), held.begin() + p.drop);
    req.groups[g].first = p.lo;
    if (req.groups[g].checkpoint != HybridSpine::kNone) {  // the engine copied it before this step
      // A resumed checkpoint's slot is the request's own (kv_cache_group_checkpoints.cc): freed.
      if (const Owner* w = owners_.OwnerOf(req.pool, req.groups[g].checkpoint); w != nullptr && *w == writer) {
        KVD_CHECK(owners_.Release(req.pool, req.groups[g].checkpoint, writer).ok());
      }
      UnrefLocked(req.pool, req.groups[g].checkpoint);
      req.groups[g].checkpoint = HybridSpine::kNone;
    }
    // The worker named them: its credit gives them to its request, in the order named (one
    // reference, from the credit to the table; one writer, now under the request's epoch).
    std::vector<BlockIndex> appended;
    for (size_t i = 0; i < credit.size(); ++i) {
      if (credit_groups[i] != g) continue;
      KVD_CHECK(owners_.Transfer(req.pool, credit[i], Owner{OwnerKind::kCredit, req.spec.owner, pc->serial}, writer)
                    .ok());
      pool.blocks[credit[i]].owner = req.serial;
      appended.push_back(credit[i]);
    }
    absl::StatusOr<std::vector<BlockIndex>> owned =
        AllocateOwnedLocked(req.pool, p.add - given[g], req.serial, &writer, g);
    KVD_CHECK(owned.ok());
    appended.insert(appended.end(), owned->begin(), owned->end());
    held.insert(held.end(), appended.begin(), appended.end());
    out[g].group = g;
    out[g].name = geo.groups[g].name;
    out[g].first_block_position = p.lo;
    out[g].blocks = std::move(appended);
  }
  if (pc != nullptr && owners_.BlocksOf(pc->serial).empty()) {
    cache_state::WorkerCredit& wc = credit_[req.spec.owner];
    wc.pools.erase(req.pool);
    if (wc.pools.empty()) credit_.erase(req.spec.owner);
  }
  if (!credit.empty()) {
    std::vector<int64_t> unplaced(num_groups, 0);
    for (int g = 0; g < num_groups; ++g) unplaced[g] = given[g] - from_credit[g];
    ledger_.UnreserveUnits(req.pool, unplaced);  // credit within the reservation: its charge goes
    workers_.AddUsage(principal, 0, -ledger_.BytesOfUnits(req.pool, given));
  }
  if (grows) KVD_CHECK(ledger_.ReserveUnits(req.pool, extra).ok());
  workers_.AddUsage(req.spec.limit_key(), 0, ledger_.BytesOfUnits(req.pool, grow));
  for (int g = 0; g < num_groups; ++g) req.reserved_units[g] += grow[g];
  for (int64_t u : grow) req.reserved_blocks += u;
  req.num_tokens = n;
  req.computed_tokens = c;
  UpdatePressureLocked();
  return out;
}

absl::Status KvCache::CheckGroupsLocked() const {
  auto fail = [](auto&&... parts) { return absl::InternalError(absl::StrCat(parts...)); };
  // Reserved bytes recomputed: requests (units or blocks), credit, orphaned checkpoints, fences.
  int64_t charged = orphan_blocks_bytes_;
  for (const auto& [key, f] : fences_) {
    charged += f.charged_units.empty() ? ledger_.BytesOf(f.pool, f.charged_blocks)
                                       : ledger_.BytesOfUnits(f.pool, f.charged_units);
  }
  std::vector<std::vector<int64_t>> reserved(pools_.size());
  for (PoolId p = 0; p < pools_.size(); ++p) reserved[p].assign(pools_[p]->geometry.groups.size(), 0);
  for (const auto& [w, credit] : credit_) {
    for (const auto& [p, pc] : credit.pools) {
      const absl::flat_hash_set<BlockIndex>& mine = owners_.BlocksOf(pc.serial);
      if (!pools_[p]->geometry.hybrid()) {
        charged += ledger_.BytesOf(p, static_cast<int64_t>(mine.size()));
        continue;
      }
      // A hybrid pool's credit: each block its group's unit (kv_cache_step.cc).
      const std::vector<int64_t> units = UnitsOfLocked(p, std::vector<BlockIndex>(mine.begin(), mine.end()));
      charged += ledger_.BytesOfUnits(p, units);
      for (size_t g = 0; g < units.size(); ++g) reserved[p][g] += units[g];
    }
  }
  // Orphaned checkpoints and fences of hybrid pools are charged per group too.
  auto add_units = [&](PoolId p, const std::vector<int64_t>& units, int64_t sum) -> bool {
    mu_.AssertHeld();
    if (!pools_[p]->geometry.hybrid()) return true;
    if (units.empty()) return sum == 0;
    int64_t total = 0;
    for (size_t g = 0; g < units.size(); ++g) {
      reserved[p][g] += units[g];
      total += units[g];
    }
    return total == sum;
  };
  for (const auto& [id, ckpt] : checkpoints_) {
    if (ckpt->orphaned && !add_units(ckpt->pool, ckpt->charged_units, ckpt->charged_blocks)) {
      return fail("orphaned checkpoint ", id.value(), "'s charged units do not sum to its charged blocks");
    }
  }
  for (const auto& [key, f] : fences_) {
    if (!add_units(f.pool, f.charged_units, f.charged_blocks)) {
      return fail("a fence of pool ", pools_[f.pool]->geometry.name, " is charged units that do not sum to its blocks");
    }
  }
  for (const auto& [id, req] : requests_) {
    charged += ReservedBytesLocked(*req);
    const Pool& pool = *pools_[req->pool];
    if (!pool.geometry.hybrid()) continue;
    const size_t n = pool.geometry.groups.size();
    if (req->reserved_units.size() != n || (req->acquired && req->groups.size() != n)) {
      return fail("request ", id.value(), " of hybrid pool ", pool.geometry.name, " has no per-group state");
    }
    int64_t sum = 0;
    for (size_t g = 0; g < n; ++g) {
      reserved[req->pool][g] += req->reserved_units[g];
      sum += req->reserved_units[g];
      if (g >= req->groups.size()) continue;
      const std::vector<BlockIndex>& held = static_cast<int>(g) == pool.spine_group ? req->table : req->groups[g].blocks;
      const size_t copies = static_cast<int>(g) == pool.spine_group ? req->own_copies.size() : 0;
      if (static_cast<int64_t>(held.size() + copies) > req->reserved_units[g]) {
        return fail("request ", id.value(), " holds ", held.size(), " units of group ", pool.geometry.groups[g].name,
                    ", reserved ", req->reserved_units[g]);
      }
      for (BlockIndex b : held) {
        if (pool.allocator.GroupOf(b) != static_cast<int>(g)) {
          return fail("block ", b, " in request ", id.value(), "'s table of group ", pool.geometry.groups[g].name,
                      " lies outside the group's range [", pool.allocator.first_block(static_cast<int>(g)), ", ",
                      pool.allocator.first_block(static_cast<int>(g)) + pool.allocator.group_capacity(static_cast<int>(g)), ")");
        }
      }
    }
    if (!req->groups.empty() && pool.spine_group < 0 && !req->table.empty()) {
      return fail("request ", id.value(), " holds a flat table in a pool without a full group");
    }
    if (sum != req->reserved_blocks) return fail("request ", id.value(), "'s reserved units do not sum to its blocks");
  }
  if (charged != ledger_.reserved_bytes()) {
    return fail("the budget charges ", ledger_.reserved_bytes(), " bytes; the sum of the groups' is ", charged);
  }
  for (PoolId p = 0; p < pools_.size(); ++p) {
    const Pool& pool = *pools_[p];
    if (!pool.geometry.hybrid()) continue;
    const int n = static_cast<int>(pool.geometry.groups.size());
    std::vector<int64_t> free(n, 0), owned(n, 0), cached(n, 0), evictable(n, 0);
    for (BlockIndex b = 0; b < pool.blocks.size(); ++b) {
      const BlockState& s = pool.blocks[b];
      const int g = pool.allocator.GroupOf(b);
      switch (s.kind) {
        case BlockState::Kind::kFree: ++free[g]; break;
        case BlockState::Kind::kOwned: ++owned[g]; break;
        case BlockState::Kind::kCached:
          ++cached[g];
          if (s.refs == 0) ++evictable[g];
          if ((s.node == nullptr) != (g != pool.spine_group)) {
            return fail("cached block ", b, " of group ", pool.geometry.groups[g].name,
                        g == pool.spine_group ? " has no index node" : " has an index node outside the spine group");
          }
          if (s.node == nullptr && pool.side[g].evictable.contains(b) != (s.refs == 0)) {
            return fail("side block ", b, " of group ", pool.geometry.groups[g].name, ": evictable list membership wrong");
          }
          if (s.node == nullptr && pool.side[g].evictable.interior(b) &&
              pool.geometry.groups[g].kind != KvGroupKind::kSlidingWindow &&
              pool.geometry.groups[g].kind != KvGroupKind::kChunkedLocal) {
            return fail("side block ", b, " of group ", pool.geometry.groups[g].name, " is interior but no window block");
          }
          if (s.node == nullptr && pool.spine != nullptr) {  // U1: a component of the node that holds it
            const CachedBlock* node = pool.component_node[b];
            const bool state = pool.geometry.groups[g].kind == KvGroupKind::kState;
            if (node == nullptr || pool.blocks[node->address.index].node != node ||
                (state ? pool.spine->checkpoint(*node, g) : pool.spine->block(*node, g)) != b) {
              return fail("cached block ", b, " of group ", pool.geometry.groups[g].name,
                          " is no component of the spine node it names");
            }
          }
          break;
      }
    }
    for (int g = 0; g < n; ++g) {
      const std::string& name = pool.geometry.groups[g].name;
      if (free[g] + owned[g] + cached[g] != pool.allocator.group_capacity(g) ||
          pool.allocator.group_capacity(g) != pool.geometry.groups[g].capacity) {
        return fail("group ", name, " of pool ", pool.geometry.name, ": free ", free[g], " + owned ", owned[g],
                    " + cached ", cached[g], " != capacity ", pool.geometry.groups[g].capacity);
      }
      if (free[g] != pool.allocator.num_free(g)) return fail("group ", name, " free count drifted");
      if (cached[g] != pool.CachedIn(g)) return fail("group ", name, " cached count drifted");
      if (evictable[g] != pool.EvictableIn(g)) return fail("group ", name, " evictable count drifted");
      if (g != pool.spine_group && pool.side[g].evictable.size() != evictable[g]) {
        return fail("group ", name, " evictable list drifted");
      }
      if (reserved[p][g] != ledger_.reserved_units(p, g)) {
        return fail("group ", name, " reservation ", ledger_.reserved_units(p, g), ", expected ", reserved[p][g]);
      }
      if (reserved[p][g] > pool.geometry.groups[g].capacity) return fail("group ", name, " over-reserved");
    }
    if (pool.spine != nullptr) {
      for (BlockIndex b = 0; b < pool.blocks.size(); ++b) {
        if (pool.component_node[b] != nullptr && pool.blocks[b].kind != BlockState::Kind::kCached) {
          return fail("block ", b, " of pool ", pool.geometry.name, " is ", pool.blocks[b].kind == BlockState::Kind::kFree ? "free" : "owned",
                      " but still names a spine node");
        }
      }
      // U2-U4 and the side arrays' U1/U6 parts, recomputed from the nodes (HybridSpine).
      KVD_RETURN_IF_ERROR(pool.spine->CheckInvariants(index_, cache_state::PoolRefs(pool)));
    }
  }
  return absl::OkStatus();
}

}  // namespace kvd
