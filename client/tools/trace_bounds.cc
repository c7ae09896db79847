#include "client/tools/trace_bounds.h"

#include <algorithm>
#include <limits>
#include <set>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"

namespace kvd::bench {
namespace {

// Block j of a request is identified by its 512-token hash id (which stands for everything
// before it) and its index inside that 512-token chunk.
uint64_t BlockId(const TraceRequest& r, int64_t j, int32_t bt) {
  const int64_t per_chunk = kTraceBlockTokens / bt;
  return r.hash_ids[j / per_chunk] * per_chunk + j % per_chunk;
}

int64_t FullBlocks(const TraceRequest& r, int32_t bt) { return r.input_length / bt; }
int64_t MaxHit(const TraceRequest& r, int32_t bt) {
  return r.input_length <= 0 ? 0 : (r.input_length - 1) / bt;
}

}  // namespace

size_t HoldoutStart(const std::vector<TraceRequest>& trace, double fraction) {
  if (trace.empty() || fraction <= 0) return trace.size();
  const double first = static_cast<double>(trace.front().timestamp_ms);
  const double span = static_cast<double>(trace.back().timestamp_ms) - first;
  const double from = first + (1 - fraction) * span;
  for (size_t i = 0; i < trace.size(); ++i) {
    if (static_cast<double>(trace[i].timestamp_ms) >= from) return i;
  }
  return trace.size();
}

TraceTally UnlimitedBound(const std::vector<TraceRequest>& trace, int32_t bt, const PrefillCost& cost,
                          size_t holdout_from) {
  absl::flat_hash_set<uint64_t> seen;
  TraceTally tally;
  for (size_t i = 0; i < trace.size(); ++i) {
    const TraceRequest& r = trace[i];
    const int64_t full = FullBlocks(r, bt), cap = MaxHit(r, bt);
    int64_t h = 0;
    while (h < cap && seen.contains(BlockId(r, h, bt))) ++h;
    tally.Add(cost, i, holdout_from, r.input_length, h * bt);
    for (int64_t j = 0; j < full; ++j) seen.insert(BlockId(r, j, bt));
  }
  return tally;
}

TraceTally FarthestNextUseBound(const std::vector<TraceRequest>& trace, int32_t bt, int64_t capacity_blocks,
                                const PrefillCost& cost, size_t holdout_from) {
  // Next use of each reference, by request index.
  constexpr int64_t kNever = std::numeric_limits<int64_t>::max();
  absl::flat_hash_map<uint64_t, int64_t> last_seen;
  std::vector<std::vector<int64_t>> next(trace.size());
  for (int64_t i = static_cast<int64_t>(trace.size()) - 1; i >= 0; --i) {
    const int64_t full = FullBlocks(trace[i], bt);
    next[i].resize(full);
    for (int64_t j = 0; j < full; ++j) {
      const uint64_t id = BlockId(trace[i], j, bt);
      auto it = last_seen.find(id);
      next[i][j] = it == last_seen.end() ? kNever : it->second;
    }
    for (int64_t j = 0; j < full; ++j) last_seen[BlockId(trace[i], j, bt)] = i;
  }
  absl::flat_hash_map<uint64_t, int64_t> cached;  // id -> its next use
  std::set<std::pair<int64_t, uint64_t>> by_next;
  TraceTally tally;
  for (size_t i = 0; i < trace.size(); ++i) {
    const TraceRequest& r = trace[i];
    const int64_t full = FullBlocks(r, bt), cap = MaxHit(r, bt);
    int64_t h = 0;
    while (h < cap && cached.contains(BlockId(r, h, bt))) ++h;
    tally.Add(cost, i, holdout_from, r.input_length, h * bt);
    for (int64_t j = 0; j < full; ++j) {
      const uint64_t id = BlockId(r, j, bt);
      auto it = cached.find(id);
      if (it != cached.end()) {
        by_next.erase({it->second, id});
        it->second = next[i][j];
      } else {
        cached.emplace(id, next[i][j]);
      }
      by_next.insert({next[i][j], id});
    }
    while (static_cast<int64_t>(cached.size()) > capacity_blocks) {
      auto victim = std::prev(by_next.end());
      cached.erase(victim->second);
      by_next.erase(victim);
    }
  }
  return tally;
}

}  // namespace kvd::bench
