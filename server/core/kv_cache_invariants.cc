// KvCache::CheckInvariantsForTesting: recomputes every derived count from first principles; and
// the test hooks that read the ownership ledger or go around it.
#include <algorithm>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "proto/vocab/status_macros.h"
#include "server/core/kv_cache.h"

namespace kvd {

absl::Status KvCache::CheckInvariantsForTesting() const {
  absl::MutexLock lock(&mu_);
  auto fail = [](auto&&... parts) { return absl::InternalError(absl::StrCat(parts...)); };

  // Expected references and owners from request tables and checkpoints.
  std::vector<std::vector<int32_t>> refs(pools_.size());
  for (PoolId p = 0; p < pools_.size(); ++p) refs[p].assign(pools_[p]->blocks.size(), 0);
  absl::flat_hash_map<uint64_t, PoolId> live_serials;
  std::vector<int64_t> reserved(pools_.size(), 0);
  std::vector<absl::flat_hash_set<BlockIndex>> owned_by_request(pools_.size());
  absl::flat_hash_map<uint64_t, const Request*> by_serial;
  for (const auto& [id, req] : requests_) {
    live_serials[req->serial] = req->pool;
    by_serial[req->serial] = req.get();
    reserved[req->pool] += req->reserved_blocks;
    if (static_cast<int64_t>(req->table.size() + req->own_copies.size()) > req->reserved_blocks) {
      return fail("request ", id.value(), " holds more blocks than it reserved");
    }
    // Chains continue past duplicates: at each own copy's position the table holds a cached block
    // with the copy's tokens; the copy is owned and written by the request (checked below with
    // its table, AllBlocksOf).
    for (size_t c = 0; c < req->own_copies.size(); ++c) {
      const Request::OwnCopy& copy = req->own_copies[c];
      const Pool& pool = *pools_[req->pool];
      if (copy.position < 0 || copy.position >= static_cast<int64_t>(req->table.size()) ||
          (c > 0 && req->own_copies[c - 1].position >= copy.position)) {
        return fail("request ", id.value(), " has an own copy at a bad position ", copy.position);
      }
      const BlockState& at = pool.blocks[req->table[copy.position]];
      const BlockState& own = pool.blocks[copy.block];
      if (at.kind != BlockState::Kind::kCached || own.kind != BlockState::Kind::kOwned ||
          own.owner != req->serial) {
        return fail("request ", id.value(), "'s own copy ", copy.block, " at position ", copy.position,
                    " is not a private copy of a cached block in its table");
      }
    }
    for (BlockIndex b : AllBlocksOf(*req)) {
      ++refs[req->pool][b];
      const BlockState& s = pools_[req->pool]->blocks[b];
      if (s.kind == BlockState::Kind::kOwned) {
        if (s.owner != req->serial) return fail("block ", b, " in ", id.value(), "'s table is owned by another");
        if (!owned_by_request[req->pool].insert(b).second) return fail("block ", b, " writable twice");
        // Its writer is the request, or a pull for it (between PinBlocks and UnpinBlocks).
        const Owner* w = owners_.OwnerOf(req->pool, b);
        const bool mine = w != nullptr && *w == WriterOf(*req);
        auto pull = w != nullptr && w->kind == OwnerKind::kPull ? pulls_.find(w->epoch) : pulls_.end();
        if (!mine && (pull == pulls_.end() || pull->second.request_serial != req->serial)) {
          return fail("block ", b, " of pool ", req->pool, " is writable by request ", id.value(),
                      " but the ledger names ",
                      w == nullptr ? std::string("no writer")
                                   : absl::StrCat(OwnerKindName(w->kind), " of '", w->attachment.value(),
                                                  "' (epoch ", w->epoch, ")"));
        }
      }
    }
  }
  absl::flat_hash_map<WorkerId, WorkerTable::Usage> usage;
  for (const auto& [id, req] : requests_) {
    ++usage[req->spec.limit_key()].requests;
    usage[req->spec.limit_key()].reserved_bytes += ReservedBytesLocked(*req);
  }
  // The ownership ledger (block_ledger.h): every owner it records is live and of its kind, every
  // block it records is owned under that owner's serial (a pull's: its request's), a request owner
  // writes only blocks of its own table, and a credit owner is its worker's.
  // Live fences by serial, with the blocks each holds.
  absl::flat_hash_map<uint64_t, std::pair<const FenceRecord*, absl::flat_hash_set<BlockIndex>>> fence_blocks;
  for (const auto& [key, f] : fences_) {
    auto& entry = fence_blocks[f.serial];
    entry.first = &f;
    entry.second.insert(f.blocks.begin(), f.blocks.end());
  }
  int64_t credit_owners = 0;
  absl::Status ledger_ok;
  owners_.ForEachOwner([&](const Owner& o, PoolId p, const absl::flat_hash_set<BlockIndex>& blocks) {
    mu_.AssertHeld();  // called back within this function, under mu_
    if (!ledger_ok.ok()) return;
    uint64_t serial = o.epoch;  // the BlockState::owner of its blocks
    if (o.kind == OwnerKind::kRequest) {
      auto r = by_serial.find(o.epoch);
      if (r == by_serial.end() || r->second->spec.owner != o.attachment || r->second->pool != p) {
        ledger_ok = fail("the ledger names request epoch ", o.epoch, " of '", o.attachment.value(), "' in pool ", p,
                         ", which is not a live request of that worker");
        return;
      }
      for (BlockIndex b : blocks) {
        if (!owned_by_request[p].contains(b)) {
          ledger_ok = fail("the ledger says request ", r->second->spec.id.value(), " writes block ", b,
                           " of pool ", p, ", which is not in its table");
          return;
        }
      }
    } else if (o.kind == OwnerKind::kPull) {
      auto pull = pulls_.find(o.epoch);
      if (pull == pulls_.end() || pull->second.attachment != o.attachment || pull->second.pool != p) {
        ledger_ok = fail("the ledger names pull epoch ", o.epoch, " in pool ", p, ", which is not in progress");
        return;
      }
      serial = pull->second.request_serial;
      for (BlockIndex b : blocks) {
        if (!pools_[p]->pins.contains(b)) {
          ledger_ok = fail("pull epoch ", o.epoch, " writes block ", b, " of pool ", p, ", which it has not pinned");
          return;
        }
      }
    } else if (o.kind == OwnerKind::kFence) {
      // A live fence (a lifted one owns nothing) writing only blocks it holds. Their
      // BlockState::owner is the fence's (taken free), the ended request's or a checkpoint's.
      auto f = fence_blocks.find(o.epoch);
      if (f == fence_blocks.end() || f->second.first->attachment != o.attachment || f->second.first->pool != p) {
        ledger_ok = fail("the ledger names fence epoch ", o.epoch, " of '", o.attachment.value(), "' in pool ", p,
                         ", which is not a live fence");
        return;
      }
      for (BlockIndex b : blocks) {
        const BlockState& s = pools_[p]->blocks[b];
        if (!f->second.second.contains(b) || s.kind != BlockState::Kind::kOwned || s.refs == 0) {
          ledger_ok = fail("the ledger says a fence of '", o.attachment.value(), "' writes block ", b, " of pool ", p,
                           ", which that fence does not hold");
          return;
        }
        const Owner* slot = owners_.OwnerOf(p, b);
        if (slot == nullptr || !(*slot == o)) {
          ledger_ok = fail("block ", b, " of pool ", p, " has two owners in the ledger");
          return;
        }
      }
      return;
    } else if (o.kind != OwnerKind::kCredit) {
      ledger_ok = fail("the ledger names a ", OwnerKindName(o.kind), " as a writer; nobody writes for one");
      return;
    }
    if (o.kind == OwnerKind::kCredit) {
      ++credit_owners;
      const cache_state::PoolCredit* pc = FindCreditLocked(o.attachment, p);
      if (pc == nullptr || pc->serial != o.epoch) {
        ledger_ok = fail("the ledger names credit epoch ", o.epoch, " of '", o.attachment.value(),
                         "' in pool ", p, ", which that worker does not hold");
        return;
      }
    }
    for (BlockIndex b : blocks) {
      const BlockState& s = pools_[p]->blocks[b];
      if (s.kind != BlockState::Kind::kOwned || s.owner != serial || s.refs == 0) {
        ledger_ok = fail("the ledger says ", OwnerKindName(o.kind), " of '", o.attachment.value(),
                         "' writes block ", b, " of pool ", p, ", which it does not own");
        return;
      }
      const Owner* slot = owners_.OwnerOf(p, b);
      if (slot == nullptr || !(*slot == o)) {
        ledger_ok = fail("block ", b, " of pool ", p, " has two owners in the ledger");
        return;
      }
    }
  });
  if (!ledger_ok.ok()) return ledger_ok;
  int64_t ledger_blocks = 0;
  owners_.ForEach([&](PoolId p, BlockIndex b, const Owner&) {
    mu_.AssertHeld();
    ++ledger_blocks;
    if (pools_[p]->blocks[b].kind == BlockState::Kind::kFree && ledger_ok.ok()) {
      ledger_ok = fail("block ", b, " of pool ", p, " is on the free list and has an owner");
    }
    if (pools_[p]->blocks[b].kind == BlockState::Kind::kCached && ledger_ok.ok()) {
      ledger_ok = fail("block ", b, " of pool ", p, " is cached and has a writer");
    }
  });
  if (!ledger_ok.ok()) return ledger_ok;
  if (ledger_blocks != owners_.num_owned()) return fail("the ledger's owned count drifted");
  // Every fenced block that is not cached has a writer: a fence that holds it (checked above),
  // or a live request that resumed it from a checkpoint below its tail (kv_cache_fences.cc: it
  // sits below the request's cached_tokens), or that request's pull. Nobody else, and never none.
  for (const auto& [key, count] : fenced_) {
    const PoolId p = static_cast<PoolId>(key >> 40);
    const BlockIndex b = key & ((uint64_t{1} << 40) - 1);
    if (p >= pools_.size() || b >= pools_[p]->blocks.size()) return fail("a fenced block is out of range");
    if (pools_[p]->blocks[b].kind != BlockState::Kind::kOwned) continue;
    const Owner* w = owners_.OwnerOf(p, b);
    if (w != nullptr && w->kind == OwnerKind::kFence) continue;
    const Request* req = nullptr;
    if (w != nullptr && w->kind == OwnerKind::kRequest) {
      auto r = by_serial.find(w->epoch);
      if (r != by_serial.end()) req = r->second;
    } else if (w != nullptr && w->kind == OwnerKind::kPull) {
      auto pull = pulls_.find(w->epoch);
      auto r = pull != pulls_.end() ? by_serial.find(pull->second.request_serial) : by_serial.end();
      if (r != by_serial.end()) req = r->second;
    }
    const int64_t bt = pools_[p]->geometry.block_tokens;
    int64_t pos = -1;  // its position in the request's table, or of the request's own copy
    if (req != nullptr) {
      auto it = std::find(req->table.begin(), req->table.end(), b);
      if (it != req->table.end()) pos = it - req->table.begin();
      for (const Request::OwnCopy& c : req->own_copies) {
        if (c.block == b) pos = c.position;
      }
    }
    if (req == nullptr || pos < 0 || (pos + 1) * bt > req->cached_tokens) {
      return fail("fenced block ", b, " of pool ", p, " is writable by ",
                  w == nullptr ? std::string("nobody")
                               : absl::StrCat(OwnerKindName(w->kind), " of '", w->attachment.value(), "' (epoch ",
                                              w->epoch, ")"),
                  ", not by a fence that holds it or a request that resumed it below its tail");
    }
  }
  int64_t credit_pools = 0;
  for (const auto& [worker, credit] : credit_) credit_pools += static_cast<int64_t>(credit.pools.size());
  if (credit_pools != credit_owners) return fail("credit entries and the ledger's credit owners differ");

  for (const auto& [worker, credit] : credit_) {
    for (const auto& [p, pc] : credit.pools) {
      const absl::flat_hash_set<BlockIndex>& blocks = owners_.BlocksOf(pc.serial);
      if (blocks.empty()) return fail("worker ", worker.value(), " keeps an empty credit entry");
      live_serials[pc.serial] = p;
      reserved[p] += static_cast<int64_t>(blocks.size());
      usage[credit.principal].reserved_bytes +=
          pools_[p]->geometry.hybrid()  // a hybrid pool's credit: each block its group's unit
              ? ledger_.BytesOfUnits(p, UnitsOfLocked(p, std::vector<BlockIndex>(blocks.begin(), blocks.end())))
              : ledger_.BytesOf(p, static_cast<int64_t>(blocks.size()));
      for (BlockIndex b : blocks) {
        ++refs[p][b];
        const BlockState& s = pools_[p]->blocks[b];
        if (s.kind != BlockState::Kind::kOwned || s.owner != pc.serial) {
          return fail("credit block ", b, " of ", worker.value(), " is not owned by its credit");
        }
        if (!owned_by_request[p].insert(b).second) return fail("block ", b, " writable twice");
      }
    }
  }
  if (usage.size() != workers_.all_usage().size()) return fail("per-worker usage has stale entries");
  for (const auto& [w, u] : usage) {
    auto it = workers_.all_usage().find(w);
    if (it == workers_.all_usage().end() || it->second.requests != u.requests ||
        it->second.reserved_bytes != u.reserved_bytes) {
      return fail("per-worker usage of ", w.value(), " drifted");
    }
  }
  int64_t orphan_bytes = 0;
  for (const auto& [id, ckpt] : checkpoints_) {
    if (ckpt->orphaned) {
      live_serials[ckpt->serial] = ckpt->pool;
      reserved[ckpt->pool] += ckpt->charged_blocks;
      orphan_bytes += ChargedBytesLocked(*ckpt);
    }
    if (ckpt->groups.size() != (pools_[ckpt->pool]->geometry.hybrid() ? pools_[ckpt->pool]->geometry.groups.size() : 0)) {
      return fail("checkpoint ", id.value(), " has no per-group state for its pool");
    }
    for (BlockIndex b : AllBlocksOf(*ckpt)) {
      ++refs[ckpt->pool][b];
      const BlockState& s = pools_[ckpt->pool]->blocks[b];
      // An orphaned checkpoint's own units are written by no request or credit (a fence, or a
      // pull its request started, may still write past it until it lifts or unpins).
      const Owner* w = owners_.OwnerOf(ckpt->pool, b);
      if (s.kind == BlockState::Kind::kOwned && s.owner == ckpt->serial && ckpt->orphaned && w != nullptr &&
          w->kind != OwnerKind::kFence && w->kind != OwnerKind::kPull) {
        return fail("block ", b, " of orphaned checkpoint ", id.value(), " is written by a ", OwnerKindName(w->kind));
      }
    }
    for (size_t g = 0; g < ckpt->groups.size(); ++g) {
      const BlockIndex slot = ckpt->groups[g].slot;
      if (slot != HybridSpine::kNone && (pools_[ckpt->pool]->allocator.GroupOf(slot) != static_cast<int>(g) ||
                                         pools_[ckpt->pool]->blocks[slot].kind != BlockState::Kind::kOwned)) {
        return fail("checkpoint ", id.value(), "'s state slot ", slot, " is not an owned slot of its group");
      }
    }
  }
  if (orphan_bytes != orphan_blocks_bytes_) return fail("orphaned checkpoint bytes drifted");
  absl::flat_hash_map<uint64_t, int32_t> fenced;
  for (const auto& [key, f] : fences_) {
    live_serials[f.serial] = f.pool;
    reserved[f.pool] += f.charged_blocks;
    for (BlockIndex b : f.blocks) {
      ++refs[f.pool][b];
      ++fenced[cache_state::FencedBlockKey(f.pool, b)];
    }
  }
  if (fenced != fenced_) return fail("fenced block counts drifted");
  int64_t state_bytes = 0, not_durable = 0;
  absl::flat_hash_map<WorkerId, int64_t> state_by_worker;
  for (const auto& [id, ckpt] : checkpoints_) {
    not_durable += ckpt->durable ? 0 : 1;
    if (ckpt->state_bytes != static_cast<int64_t>(ckpt->engine_state.size() + ckpt->tokens.size() * sizeof(Token))) {
      return fail("checkpoint ", id.value(), "'s state bytes are wrong");
    }
    state_bytes += ckpt->state_bytes;
    if (!ckpt->owner.empty()) state_by_worker[ckpt->owner] += ckpt->state_bytes;
  }
  if (state_bytes != checkpoint_state_bytes_ || state_by_worker != checkpoint_state_by_worker_) {
    return fail("checkpoint state bytes drifted");
  }
  if (not_durable != checkpoints_not_durable_) return fail("not-durable checkpoint count drifted");
  if (state_bytes > options_.checkpoint_state_bytes) return fail("checkpoint state budget exceeded");
  if (orphan_bytes > options_.checkpoint_budget_bytes) return fail("checkpoint budget exceeded");

  // Protection counts from sessions.
  absl::flat_hash_map<const CachedBlock*, int32_t> protects;
  for (const auto& [id, session] : sessions_) {
    for (const ProtectedRef& ref : session.protected_blocks) {
      const BlockState& s = pools_[ref.pool]->blocks[ref.index];
      if (s.kind == BlockState::Kind::kCached && s.node->serial == ref.node_serial) ++protects[s.node];
    }
  }

  absl::flat_hash_map<const CachedBlock*, int32_t> children;
  index_.ForEach([&](const CachedBlock* b) {
    if (b->parent != nullptr) ++children[b->parent];
  });

  for (PoolId p = 0; p < pools_.size(); ++p) {
    for (const auto& [b, n] : pools_[p]->pins) refs[p][b] += n;
  }

  int64_t total_cached = 0;
  for (PoolId p = 0; p < pools_.size(); ++p) {
    const Pool& pool = *pools_[p];
    int64_t free = 0, owned = 0, cached = 0, unreferenced = 0, queued = 0, side_cached = 0;
    for (BlockIndex b = 0; b < pool.blocks.size(); ++b) {
      const BlockState& s = pool.blocks[b];
      if (s.refs != refs[p][b]) {
        return fail("pool ", pool.geometry.name, " block ", b, ": refs ", s.refs, ", expected ", refs[p][b]);
      }
      switch (s.kind) {
        case BlockState::Kind::kFree:
          ++free;
          if (s.refs != 0) return fail("free block ", b, " is referenced");
          break;
        case BlockState::Kind::kOwned: {
          ++owned;
          auto it = live_serials.find(s.owner);
          // A pin outlives its request; a fence, the request or checkpoint it was taken from.
          const bool pinned = pool.pins.contains(b) || fenced_.contains(cache_state::FencedBlockKey(p, b));
          if (s.refs == 0 || (!pinned && (it == live_serials.end() || it->second != p))) {
            return fail("owned block ", b, " has no live owner");
          }
          break;
        }
        case BlockState::Kind::kCached: {
          ++cached;
          if (s.node == nullptr && pool.geometry.hybrid()) {  // a side block: CheckGroupsLocked
            ++side_cached;
            if (s.refs == 0) ++unreferenced;
            break;
          }
          const CachedBlock* n = s.node;
          if (n == nullptr || n->address.pool != p || n->address.index != b) {
            return fail("cached block ", b, " has a wrong node");
          }
          if (s.refs == 0) ++unreferenced;
          const bool leaf = children[n] == 0;
          if (n->num_children != children[n]) return fail("block ", b, " child count drifted");
          if (n->queued != (s.refs == 0 && leaf)) return fail("block ", b, " queue membership wrong");
          if (n->queued) ++queued;
          if (n->protect_count != protects[n]) return fail("block ", b, " protection count drifted");
          if (s.refs > 0 && n->parent != nullptr &&
              pool.blocks[n->parent->address.index].refs == 0) {
            return fail("block ", b, " is referenced but its parent is not");
          }
          break;
        }
      }
    }
    if (free != pool.allocator.num_free()) return fail("pool ", pool.geometry.name, " free count drifted");
    if (owned != pool.num_owned) return fail("pool ", pool.geometry.name, " owned count drifted");
    if (cached != pool.num_cached) return fail("pool ", pool.geometry.name, " cached count drifted");
    if (unreferenced != pool.num_cached_unreferenced) return fail("unreferenced count drifted");
    if (queued != pool.queue.size()) return fail("pool ", pool.geometry.name, " queue size drifted");
    if (reserved[p] != ledger_.reserved_blocks(p)) {
      return fail("pool ", pool.geometry.name, " reservation ", ledger_.reserved_blocks(p),
                  ", expected ", reserved[p]);
    }
    if (reserved[p] > pool.geometry.capacity_blocks) return fail("pool over-reserved");
    total_cached += cached - side_cached;
  }
  if (total_cached != index_.num_blocks()) return fail("index size drifted");
  if (ledger_.reserved_bytes() > ledger_.budget_bytes()) return fail("budget exceeded");
  KVD_RETURN_IF_ERROR(CheckInflightLocked());  // every in-flight block: a live request's writable prompt block
  return CheckGroupsLocked();
}

std::optional<Owner> KvCache::WriterForTesting(PoolId pool, BlockIndex block) const {
  absl::MutexLock lock(&mu_);
  if (pool >= pools_.size() || block >= pools_[pool]->blocks.size()) return std::nullopt;
  const Owner* w = owners_.OwnerOf(pool, block);
  return w == nullptr ? std::nullopt : std::optional<Owner>(*w);
}

absl::Status KvCache::HandBlockBypassingLedgerForTesting(const RequestId& from, const RequestId& to) {
  absl::MutexLock lock(&mu_);
  KVD_ASSIGN_OR_RETURN(Request * a, FindRequestLocked(from));
  KVD_ASSIGN_OR_RETURN(Request * b, FindRequestLocked(to));
  if (a->pool != b->pool || a->table.empty() || static_cast<int64_t>(b->table.size()) >= b->reserved_blocks) {
    return absl::FailedPreconditionError("no block to move, or no room for it");
  }
  const BlockIndex block = a->table.back();
  BlockState& s = pools_[a->pool]->blocks[block];
  if (s.kind != BlockState::Kind::kOwned || s.owner != a->serial) {
    return absl::FailedPreconditionError("the last block is not writable");
  }
  a->table.pop_back();
  b->table.push_back(block);
  s.owner = b->serial;
  return absl::OkStatus();
}

absl::Status KvCache::HandFencedBlockForTesting(const RequestId& to) {
  absl::MutexLock lock(&mu_);
  KVD_ASSIGN_OR_RETURN(Request * req, FindRequestLocked(to));
  if (static_cast<int64_t>(req->table.size()) >= req->reserved_blocks) {
    return absl::FailedPreconditionError("no room for another block");
  }
  for (const auto& [key, f] : fences_) {
    if (f.pool != req->pool) continue;
    for (BlockIndex b : f.blocks) {
      const Owner* w = owners_.OwnerOf(f.pool, b);
      if (w == nullptr || !(*w == FenceWriter(f))) continue;
      KVD_RETURN_IF_ERROR(owners_.Transfer(f.pool, b, FenceWriter(f), WriterOf(*req)));
      BlockState& s = pools_[f.pool]->blocks[b];
      s.owner = req->serial;
      ++s.refs;
      req->table.push_back(b);
      return absl::OkStatus();
    }
  }
  return absl::FailedPreconditionError("no block a fence writes in the request's pool");
}

}  // namespace kvd
