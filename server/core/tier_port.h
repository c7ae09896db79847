// TierPort: the engine as the lower tiers (server/store) see it — the few things a tier may ask of
// KvCache, and nothing else. KvCache implements it; the store holds a TierPort*, never the
// engine's header, so the store cannot reach into the engine's state, and the engine reaches the
// store only through EvictionSink (eviction_sink.h). Contracts are KvCache's (kv_cache.h).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "proto/vocab/cache_event.h"
#include "proto/vocab/cache_types.h"
#include "proto/vocab/pool_geometry.h"
#include "server/core/clock.h"
#include "server/core/eviction_sink.h"

namespace kvd {

class TierPort {
 public:
  using EventListener = std::function<void(const CacheEvent&)>;
  virtual ~TierPort() = default;

  virtual const Clock* clock() const = 0;
  virtual const std::vector<PoolGeometry>& pools() const = 0;
  virtual int64_t max_engine_state_bytes() const = 0;

  // Promotion. PinBlocks holds a reference on each of `blocks` of the request's table (owned or
  // cached) so they stay put while a tier writes into them, even if the request is released
  // meanwhile, and makes the pull the writer of its owned ones (block_ledger.h: the request's
  // worker is not, and may not publish them) until UnpinBlocks names the same list: NOT_FOUND
  // (request), INVALID_ARGUMENT (a block not in its table, or an owned one named twice),
  // FAILED_PRECONDITION (an owned block another pull is writing); changes nothing on error. AdoptPromoted: the tier has written the KV of the request's prompt tokens
  // [cached_tokens, new_cached) into its writable blocks — publish them and count them as hit;
  // NOT_FOUND (request gone), FAILED_PRECONDITION (not acquired, resumed, or new_cached not a
  // block boundary in the prompt).
  virtual absl::Status PinBlocks(const RequestId& id, absl::Span<const BlockIndex> blocks) = 0;
  virtual void UnpinBlocks(PoolId pool, absl::Span<const BlockIndex> blocks) = 0;
  virtual absl::Status AdoptPromoted(const RequestId& id, int64_t new_cached_tokens) = 0;

  // Hybrid promotion (docs/hybrid.md §2.9): a tier brings whole units back into G1 *before* a
  // lookup, which then runs §2.6 over G1 as always (so a hit is only as long as every group
  // serves from what came back). SpineMatch: how many spine nodes G1 holds of the prompt's chain
  // (at most (len - 1) / bt; 0 for a pool without a spine); NOT_FOUND for an unknown pool.
  // BeginInstall holds G1's first `first_depth` nodes of the chain (none may be evicted meanwhile)
  // and reserves and allocates, held (owned by nobody, pinned), a block of the spine group and one
  // unit of each part's group for every entry of `units` (unit i is the node at depth
  // first_depth + i + 1): FAILED_PRECONDITION when G1's match is no longer `first_depth` or the
  // pool has no spine, RESOURCE_EXHAUSTED without room; changes nothing on error. The caller then
  // writes each unit's bytes into UnitInstall's blocks (without any lock) and calls FinishInstall
  // exactly once: the first `written` units are indexed as cached, unreferenced units (a node the
  // spine already holds, or a collision, ends the run), each checkpoint only where §2.7 accepts it
  // (its window present); the rest is freed, and U2-U4 drop what no hit could serve. Returns the
  // units indexed.
  struct UnitInstall {
    PoolId pool = 0;
    int64_t first_depth = 0;
    std::vector<BlockIndex> chain;                  // G1's nodes held, root first
    std::vector<BlockIndex> spine;                  // per unit: its spine block
    std::vector<std::vector<UnitComponent>> parts;       // per unit: its parts, index filled in
  };
  virtual absl::StatusOr<int64_t> SpineMatch(const Namespace& ns, absl::Span<const Token> prompt) = 0;
  virtual absl::StatusOr<UnitInstall> BeginInstall(const Namespace& ns, absl::Span<const Token> prompt,
                                                   int64_t first_depth,
                                                   std::vector<std::vector<UnitComponent>> units) = 0;
  virtual int64_t FinishInstall(const Namespace& ns, absl::Span<const Token> prompt, UnitInstall install,
                                int64_t written) = 0;
  // PeekInstalled: the tokens a start of `prompt` would hit once `units` (as for BeginInstall; their
  // indices unused) were installed on G1's first `first_depth` nodes of its chain: §2.6 over G1's
  // components for those nodes and the units' parts past them, each checkpoint counted only where
  // FinishInstall would keep it and each unit only where U2 would (docs/hybrid.md §2.9). Holds
  // nothing, reads no bytes. G1's own hit (as PeekPrefixLen) when G1's match is no longer
  // `first_depth` or the budget could not reserve the units now; NOT_FOUND for an unknown pool.
  virtual absl::StatusOr<int64_t> PeekInstalled(const Namespace& ns, absl::Span<const Token> prompt,
                                                int64_t first_depth,
                                                absl::Span<const std::vector<UnitComponent>> units) const = 0;

  // Peer transfer (server/transfer): pins the cached blocks of the longest cached prefix of
  // `tokens` in `ns`, from block `skip_blocks` on, at most `max_blocks` (0: all) and never the
  // block holding the last token; pinned blocks stay cached and unmoved until UnpinBlocks.
  // NOT_FOUND for an unknown pool; an empty list when nothing past `skip_blocks` is cached.
  struct PinnedPrefix {
    PoolId pool = 0;
    std::vector<BlockIndex> blocks;
    std::vector<uint64_t> serials;  // each block's insertion serial: unique, never reused
  };
  virtual absl::StatusOr<PinnedPrefix> PinPrefix(const Namespace& ns, absl::Span<const Token> tokens,
                                                 int64_t skip_blocks, int64_t max_blocks) = 0;

  // Flush and upload. SnapshotCached lists every cached block (in slices, the lock taken per
  // slice: a block cached or evicted meanwhile may be missed or stale). VisitCached calls fn(view)
  // for those of `refs` still cached (same key), without the engine's lock, the blocks and their
  // prefixes held so their bytes stay put; recency is left as it was; returns how many.
  // SnapshotCheckpoints: every checkpoint now; with `pin`, each one's blocks are pinned (release
  // them with UnpinBlocks) so their bytes can be copied outside the lock.
  virtual std::vector<CachedBlockRef> SnapshotCached() const = 0;
  // Waits until every block evicted so far towards the sink has been handed over (its OnEvict
  // returned: copied below G1 or dropped); false after `timeout`. A flush calls it before it
  // counts a block that left G1 as lost.
  virtual bool WaitForDemotions(absl::Duration timeout) = 0;
  virtual int64_t VisitCached(absl::Span<const CachedBlockRef> refs,
                              const std::function<void(const CachedBlockView&)>& fn) = 0;
  virtual std::vector<CheckpointSnapshot> SnapshotCheckpoints(bool pin) = 0;
  // Durability of checkpoints, kept by the engine so that a gauge never scans them.
  // SetCheckpointDurable(id, version, true): G3 now holds the checkpoint as it was at `version`
  // (CheckpointSnapshot::version); ignored when the checkpoint is gone or has changed since.
  // (id, any, false): G3 lost its copy. checkpoints_not_durable: checkpoints a flush would write
  // (created or changed since they were last written, restored ones start durable).
  virtual void SetCheckpointDurable(const RequestId& id, uint64_t version, bool durable) = 0;
  virtual int64_t checkpoints_not_durable() const = 0;
  // Blocks in the device index now, every pool (a count kept by the engine).
  virtual int64_t cached_blocks() const = 0;

  // Warm restart. RestoreCheckpoint recreates an interrupted generation's checkpoint with fresh
  // blocks the caller then fills, charged to the checkpoint budget with a full TTL: NOT_FOUND
  // (pool), ALREADY_EXISTS (id), INVALID_ARGUMENT (no tokens, engine state too large, past
  // max_model_len), RESOURCE_EXHAUSTED (checkpoint budget or pool); changes nothing on error.
  // A hybrid pool's (docs/hybrid.md §2.9): `group_units` names, per group, the units the record
  // holds (the spine's table, a window's blocks before the position, 1 per state group), which must
  // be those a checkpoint at `tokens` holds on this pool (else FAILED_PRECONDITION); the blocks come
  // back in CheckpointSnapshot::AllBlocks() order and the state as each state group's slot. Empty
  // for other pools (INVALID_ARGUMENT when the two disagree).
  // EmitExternal records events that happened outside the device index (a reload), in order.
  virtual absl::StatusOr<std::vector<BlockIndex>> RestoreCheckpoint(const RequestId& id, const Namespace& ns,
                                                                    std::vector<Token> tokens,
                                                                    std::string engine_state,
                                                                    absl::Span<const int64_t> group_units) = 0;
  // Drops a checkpoint RestoreCheckpoint recreated whose bytes the caller could not write back, so
  // that no resume reads a unit left unwritten. Nothing happens for an id not restored or resumed.
  virtual void DropRestoredCheckpoint(const RequestId& id) = 0;
  virtual void EmitExternal(const std::vector<CacheEvent>& events) = 0;

  // The index's events (write-through uploads). RemoveListenerAndWait removes a listener, then
  // waits for a delivery in progress, so it never runs after this returns (for owners that free
  // what it points to); never call it from a listener.
  virtual int AddEventListener(EventListener fn) = 0;
  virtual void RemoveListenerAndWait(int handle) = 0;
};

}  // namespace kvd
