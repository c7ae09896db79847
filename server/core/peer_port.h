// PeerPort: what peer transfer (server/transfer) asks of the engine for a hybrid pool, whose hit is
// a unit of components rather than a run of blocks (docs/hybrid.md §2.6, §2.9 "peers";
// docs/transfer.md, "Hybrid pools"). KvCache implements it; pools without groups go through
// TierPort's PinPrefix / PinBlocks / AdoptPromoted as before.
//
// Both nodes order a unit's components the same way (UnitLayout), computed from their own
// geometry: the offering node (the lender) pins its components in that order, the pulling node
// (the borrower) writes the n-th component it receives into the n-th of its own targets. The
// lender's answers supply bytes only.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "proto/vocab/cache_types.h"
#include "proto/vocab/pool_geometry.h"

namespace kvd {

// One component of a hybrid unit: group g's unit at block position `position` (attention), or
// its checkpoint at the unit's depth (state: position = depth - 1, the node that holds it).
struct UnitPart {
  int group = 0;
  int64_t position = 0;
};

// The components a pull of a hybrid pool's prefix from depth `skip` (the borrower's own hit) to
// `depth` carries, in travel order: the first full group's positions [skip, depth); each other
// attention group, in declaration order, its positions [max(skip, depth - need), depth), need
// being the blocks a hit at `depth` reads of it (sliding_window min(d, ceil((W - 1) / bt)),
// chunked_local (d * bt mod C) / bt, full d); each state group's checkpoint at exactly `depth`.
// REQUIRES: geo.hybrid() with a full group, 0 <= skip < depth.
std::vector<UnitPart> UnitLayout(const PoolGeometry& geo, int64_t skip, int64_t depth);
// Bytes of one component of group g across all shards (its contiguous form).
int64_t UnitPartBytes(const PoolGeometry& geo, int g);

class PeerPort {
 public:
  virtual ~PeerPort() = default;

  // Lender. Runs §2.6's lookup of `tokens` in `ns`, capped at skip_blocks + max_blocks blocks
  // (max_blocks 0: no cap); when the hit's depth d is past skip_blocks, pins (TierPort::UnpinBlocks
  // releases) UnitLayout(skip_blocks, d)'s components and answers them with d; else depth 0 and
  // nothing pinned. NOT_FOUND (pool), FAILED_PRECONDITION (not a hybrid pool with a full group).
  struct PinnedUnit {
    PoolId pool = 0;
    int64_t depth = 0;
    std::vector<BlockIndex> components;
    std::vector<uint64_t> serials;  // a full block's insertion serial; 0 for other components
  };
  virtual absl::StatusOr<PinnedUnit> PinHybridUnit(const Namespace& ns, absl::Span<const Token> tokens,
                                                   int64_t skip_blocks, int64_t max_blocks) = 0;

  // Borrower. The deepest unit the request could take: its prompt less one token. 0 when the
  // request is not a fresh acquire of a hybrid pool with a full group. NOT_FOUND (request).
  virtual absl::StatusOr<int64_t> PullHorizon(const RequestId& id) = 0;
  // Borrower. The units a pull from the request's hit to `depth` writes, in UnitLayout order:
  // the request's own full blocks; each window group's block at each position, from the
  // request's table where it holds the position, else a fresh unit (`loose`: past its step
  // horizon, outside its table until the unit is adopted); each state group's last own slot. All
  // pinned and written by the pull, as TierPort::PinBlocks does. FAILED_PRECONDITION when the
  // hit is not fresh or the spine already holds any of the prompt's blocks in [hit, depth) (the
  // pull would publish duplicates); RESOURCE_EXHAUSTED when a group has no room for the loose
  // units. Changes nothing on error.
  struct UnitTargets {
    std::vector<BlockIndex> blocks;
    std::vector<BlockIndex> loose;  // those of `blocks` outside the request's tables
  };
  virtual absl::StatusOr<UnitTargets> PinUnitTargets(const RequestId& id, int64_t depth) = 0;
  // Borrower. Ends the pull of `targets` (always: unpins them, frees the loose ones unless
  // adopted). When `written` (every target holds its verified component), publishes them as one
  // unit — the full and window blocks on the spine, each state group's slot as its checkpoint at
  // `depth` — and moves the request's hit to `depth` as Acquire would have served it (window
  // tables from their first needed block to the step horizon, the checkpoint as checkpoint_slot).
  // On any error the request stays at its hit and nothing is published.
  virtual absl::Status FinishUnitPull(const RequestId& id, PoolId pool, int64_t depth, const UnitTargets& targets,
                                      bool written) = 0;
};

}  // namespace kvd
