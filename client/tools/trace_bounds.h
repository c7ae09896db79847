// Reference hit rates computed from a trace alone, at a cache's block granularity: what an
// unlimited cache would hit, and what an offline farthest-next-use (Belady) policy would hit at a
// given capacity. Both count hits as kvd does: the longest cached prefix of full blocks, capped so
// that at least one prompt token is computed.
#pragma once

#include <cstdint>
#include <vector>

#include "client/tools/trace.h"

namespace kvd::bench {

// REQUIRES: 512 % block_tokens == 0.
double UnlimitedHitRate(const std::vector<TraceRequest>& trace, int32_t block_tokens);
double FarthestNextUseHitRate(const std::vector<TraceRequest>& trace, int32_t block_tokens,
                              int64_t capacity_blocks);

}  // namespace kvd::bench
