#include "tests/bench/core_replay.h"

#include <unistd.h>

#include <chrono>
#include <fstream>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "server/core/clock.h"
#include "server/core/kv_cache.h"
#include "proto/vocab/status_macros.h"

namespace kvd::bench {

int64_t ResidentBytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t size = 0, resident = 0;
  statm >> size >> resident;
  return resident * sysconf(_SC_PAGESIZE);
}

double InfiniteCacheHitRate(const std::vector<TraceRequest>& trace) {
  absl::flat_hash_set<uint64_t> seen;
  int64_t total = 0, hit = 0;
  for (const TraceRequest& r : trace) {
    total += r.input_length;
    bool prefix = true;
    for (size_t i = 0; i < r.hash_ids.size(); ++i) {
      const int64_t tokens = std::min<int64_t>(kTraceBlockTokens, r.input_length - i * kTraceBlockTokens);
      const bool known = !seen.insert(r.hash_ids[i]).second;
      prefix = prefix && known;
      if (prefix) hit += tokens;
    }
  }
  return total == 0 ? 0 : double(hit) / total;
}

absl::StatusOr<ReplayStats> ReplayThroughCache(const std::vector<TraceRequest>& trace,
                                               const ReplayOptions& options) {
  CacheOptions o;
  PoolGeometry g;
  g.name = "trace";
  g.block_tokens = options.block_tokens;
  g.num_layers = 1;
  g.bytes_per_token_per_layer = 1;  // the core only counts bytes; geometry does not change the work
  g.capacity_blocks = options.capacity_tokens / options.block_tokens;
  g.max_model_len = 1 << 22;
  o.pools.push_back(g);
  o.eviction_policy = options.policy;
  o.slru_main_fraction = options.slru_main_fraction;
  o.slru_ghost_fraction = options.slru_ghost_fraction;
  o.horizon_probation = options.horizon_probation;
  o.horizon_main = options.horizon_main;
  o.horizon_sample_every = options.horizon_sample_every;
  o.horizon_margin = options.horizon_margin;
  const int64_t rss_before = ResidentBytes();
  KVD_ASSIGN_OR_RETURN(std::unique_ptr<KvCache> cache, KvCache::Create(o, SystemClock::Get()));

  ReplayStats stats;
  const PrefillCost cost(options.model);
  using Clock = std::chrono::steady_clock;
  Clock::duration inside{};
  const size_t n = options.limit_requests > 0
                       ? std::min<size_t>(trace.size(), options.limit_requests)
                       : trace.size();
  for (size_t i = 0; i < n; ++i) {
    RequestSpec spec;
    spec.id = RequestId(absl::StrCat("r", i));
    spec.ns.pool = "trace";
    spec.prompt = TraceTokens(trace[i]);
    spec.max_new_tokens = trace[i].output_length;
    if (spec.prompt.empty()) continue;
    const int64_t full = static_cast<int64_t>(spec.prompt.size()) / options.block_tokens;

    const auto start = Clock::now();
    absl::StatusOr<AdmitResult> admitted = cache->Admit(spec);
    if (!admitted.ok() && admitted.status().code() == absl::StatusCode::kOutOfRange) {
      ++stats.skipped;
      continue;
    }
    KVD_RETURN_IF_ERROR(admitted.status());
    if (admitted->decision != AdmitDecision::kAdmitted) {
      return absl::InternalError("a sequential replay never waits");
    }
    KVD_ASSIGN_OR_RETURN(AcquireResult acquired, cache->Acquire(spec.id));
    std::vector<BlockIndex> blocks(acquired.blocks.begin(), acquired.blocks.begin() + full);
    KVD_RETURN_IF_ERROR(cache->Publish(spec.id, spec.prompt, blocks).status());
    KVD_RETURN_IF_ERROR(cache->Release(spec.id, /*completed=*/true));
    inside += Clock::now() - start;

    ++stats.requests;
    stats.prompt_tokens += static_cast<int64_t>(spec.prompt.size());
    stats.hit_tokens += acquired.cached_tokens;
    stats.reuse.Add(cost, i, options.holdout_from, static_cast<int64_t>(spec.prompt.size()),
                    acquired.cached_tokens);
    stats.prompt_blocks += static_cast<int64_t>(acquired.blocks.size());
  }
  stats.cache_seconds = std::chrono::duration<double>(inside).count();
  CacheReport report = cache->Report();
  stats.indexed_blocks = report.indexed_blocks;
  stats.evicted_blocks = static_cast<int64_t>(report.evictions[0]);
  stats.rss_growth_bytes = ResidentBytes() - rss_before;
  return stats;
}

}  // namespace kvd::bench
