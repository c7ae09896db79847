// Reference outcomes computed from a trace alone, at a cache's block granularity: what an
// unlimited cache would hit, and what an offline farthest-next-use (Belady) policy would hit at a
// given capacity. Both count hits as kvd does: the longest cached prefix of full blocks, capped so
// that at least one prompt token is computed. Each is reported as a ReuseTally (hit tokens and
// prefill compute saved, prefill_cost.h) over the whole trace and over its held-out tail.
//
// Farthest-next-use maximizes block hits in a cache without the prefix constraint; it is the
// bound for the hit rate, and the compute it saves is reported beside it (a policy that weighs
// deep blocks more could save somewhat more compute at the same capacity).
#pragma once

#include <cstdint>
#include <vector>

#include "client/tools/prefill_cost.h"
#include "client/tools/trace.h"

namespace kvd::bench {

// Outcome over the whole trace and over the requests from `holdout_from` on.
struct TraceTally {
  ReuseTally all;
  ReuseTally holdout;
  // Counts one request (its index decides whether it is held out).
  void Add(const PrefillCost& cost, size_t index, size_t holdout_from, int64_t prompt, int64_t hit) {
    all.Add(cost, prompt, hit);
    if (index >= holdout_from) holdout.Add(cost, prompt, hit);
  }
};

// Index of the first request of the trace's last `fraction` by time: the first whose timestamp is
// at or after first + (1 - fraction) × span. trace.size() when fraction <= 0. Requests are in
// timestamp order in a trace.
size_t HoldoutStart(const std::vector<TraceRequest>& trace, double fraction);

// REQUIRES: 512 % block_tokens == 0.
TraceTally UnlimitedBound(const std::vector<TraceRequest>& trace, int32_t block_tokens,
                          const PrefillCost& cost, size_t holdout_from);
TraceTally FarthestNextUseBound(const std::vector<TraceRequest>& trace, int32_t block_tokens,
                                int64_t capacity_blocks, const PrefillCost& cost, size_t holdout_from);

}  // namespace kvd::bench
