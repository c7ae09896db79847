// CacheOptions configures a KvCache: its pools, the global KV byte budget and the policies around
// sessions, checkpoints, trimming and pressure. Validated once by KvCache::Create().
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "proto/vocab/pool_geometry.h"
#include "server/core/pressure_monitor.h"

namespace kvd {

// Which cached blocks are evicted first (see docs/architecture.md, "Eviction").
enum class EvictionPolicy {
  kLru,   // least recently used leaf first (SGLang's radix cache, vLLM's free queue)
  kSlru,  // segmented: blocks never reused go first; reuse, or a re-store soon after eviction
          // (a ghost list of evicted keys), promotes a block to the main segment
  kHorizon,  // SLRU's segments, but the pool follows whichever of SLRU's order and a reuse-horizon
             // order (blocks past a horizon first, else the newest probation block) a pair of
             // sampled shadow caches finds hitting more (eviction_queue.h, policy_duel.h)
};

// "lru", "slru", "horizon": the config's and the benchmarks' names.
absl::string_view EvictionPolicyName(EvictionPolicy policy);
// False (and *policy unchanged) for an unknown name.
bool ParseEvictionPolicy(absl::string_view name, EvictionPolicy* policy);

struct CacheOptions {
  // Pools served; at least one, names unique.
  std::vector<PoolGeometry> pools;
  // Global KV byte budget for admitted requests and orphaned checkpoints, across pools.
  // 0 (default): the sum of every pool's capacity.
  int64_t budget_bytes = 0;

  // How long a session's latest prefix stays softly protected after its last request. Default 10m.
  absl::Duration session_ttl = absl::Minutes(10);
  // At most this many leading blocks of a session's prefix are protected. Default 4096.
  int64_t session_max_protected_blocks = 4096;

  // KV bytes that checkpoints of interrupted generations may pin, awaiting resume; the oldest are
  // dropped past it. 0 (default): a quarter of the budget.
  int64_t checkpoint_budget_bytes = 0;
  // An interrupted generation's checkpoint is dropped if not resumed within this. Default 30m.
  absl::Duration checkpoint_ttl = absl::Minutes(30);
  // Largest opaque engine state one checkpoint may carry. Default 1 MiB.
  int64_t max_engine_state_bytes = int64_t{1} << 20;
  // Daemon memory that checkpoints may hold (engine state + tokens), in total and per worker, so
  // that clients cannot grow the daemon past its KV budget. Past the total, the oldest orphaned
  // checkpoints are dropped first; then Checkpoint answers RESOURCE_EXHAUSTED. Defaults 256 MiB
  // and 0 (a quarter of the total).
  int64_t checkpoint_state_bytes = int64_t{256} << 20;
  int64_t max_checkpoint_state_bytes_per_worker = 0;

  // Boundary(): when a pool's used fraction is above `high`, trim unreferenced blocks down to `low`.
  double boundary_high_watermark = 0.90;
  double boundary_low_watermark = 0.80;
  // With lower tiers (an eviction sink): the fraction of each pool the data mover keeps free by
  // demoting the next victims ahead of need (KvCache::DemoteAhead, DemotionMover), so the copies
  // run on its thread instead of on the request that needs room. 0 (default): off, every demotion
  // runs on the evicting request's thread. At most 0.5.
  double demote_reserve = 0.0;

  // Eviction order. Default kSlru (beats kLru on the Mooncake traces at every size measured,
  // docs/performance.md); kLru for comparison.
  EvictionPolicy eviction_policy = EvictionPolicy::kSlru;
  // kSlru: the main segment's share of the evictable blocks (and of the pool) before its own
  // oldest block is evicted ahead of probation. Default 0.5.
  double slru_main_fraction = 0.5;
  // kSlru: keys of evicted never-reused blocks remembered, as a multiple of a pool's blocks.
  // Default 4.
  double slru_ghost_fraction = 4.0;
  // kHorizon: a probation / main block unused while this many times the pool's blocks were stored
  // is overdue (evicted first); one pool key in `horizon_sample_every` feeds the shadow caches (0:
  // no shadows, the horizon order always); the horizon order is followed while its shadow hits
  // more than `horizon_margin` times the recency shadow. Defaults 0.01, 4, 32 and 1.1. kHorizon also
  // uses slru_main_fraction (as a share of the evictable blocks only) and slru_ghost_fraction.
  double horizon_probation = 0.01;
  double horizon_main = 4.0;
  int64_t horizon_sample_every = 32;
  double horizon_margin = 1.1;

  // Per worker (attachment) limits, so that one worker cannot take the node; 0 disables.
  // Live requests one worker may hold. Default 65536.
  int64_t max_requests_per_worker = 65536;
  // KV bytes one worker's requests may reserve. Default 0 (unlimited).
  int64_t max_bytes_per_worker = 0;
  // Free blocks per pool one worker may hold as step credit (proto/vocab/step_types.h), so that
  // decode grows without a round trip; charged to the worker. 0 disables credit. Default 1024 (a
  // batch of 256 whose requests cross a block in the same step takes 256 at once).
  int64_t step_credit_blocks = 1024;

  PressureOptions pressure;
  // Index events kept for watchers that reconnect. Default 65536.
  int64_t event_buffer = 65536;

  absl::Status Validate() const;
  // Bytes every pool's blocks hold together, across shards: the budget when budget_bytes is 0.
  int64_t CapacityBytes() const;
};

}  // namespace kvd
