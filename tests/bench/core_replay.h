// Replays a request trace through an in-process KvCache: for each request, admit, acquire (prefix
// lookup), publish every full prompt block (as a worker would after prefill), release.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "server/core/cache_options.h"
#include "client/tools/prefill_cost.h"
#include "client/tools/trace.h"
#include "client/tools/trace_bounds.h"

namespace kvd::bench {

struct ReplayOptions {
  int64_t capacity_tokens = 3'000'000;  // pool capacity, in tokens
  int32_t block_tokens = 16;
  int64_t limit_requests = 0;            // 0: the whole trace
  EvictionPolicy policy = EvictionPolicy::kSlru;
  double slru_main_fraction = 0.5;
  double slru_ghost_fraction = 4.0;
  double horizon_probation = 0.01;
  double horizon_main = 4.0;
  int64_t horizon_sample_every = 32;
  double horizon_margin = 1.1;
  size_t holdout_from = SIZE_MAX;        // requests from this index on are also tallied apart
  ModelShape model;                      // for the compute-saved figures
};

struct ReplayStats {
  int64_t requests = 0;          // replayed
  int64_t skipped = 0;           // larger than the whole pool by themselves
  int64_t prompt_tokens = 0;
  int64_t hit_tokens = 0;
  TraceTally reuse;              // hit tokens and prefill compute saved, all and held out
  int64_t prompt_blocks = 0;     // full and partial blocks handled
  double cache_seconds = 0;      // time inside KvCache calls only
  int64_t indexed_blocks = 0;    // at the end
  int64_t evicted_blocks = 0;
  int64_t rss_growth_bytes = 0;  // resident memory growth of the process over the replay
  double hit_rate() const { return prompt_tokens == 0 ? 0 : double(hit_tokens) / prompt_tokens; }
};

absl::StatusOr<ReplayStats> ReplayThroughCache(const std::vector<TraceRequest>& trace,
                                               const ReplayOptions& options);

// Token-weighted hit rate of an unbounded cache at the trace's own 512-token granularity.
double InfiniteCacheHitRate(const std::vector<TraceRequest>& trace);

// Resident set size of this process, in bytes (from /proc/self/statm).
int64_t ResidentBytes();

}  // namespace kvd::bench
