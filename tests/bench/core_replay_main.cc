// kvd_core_replay: replays a Mooncake trace through the cache engine in-process and prints the
// hit rate and throughput figures quoted in docs/performance.md.
//
//   kvd_core_replay --trace=PATH [--capacity-tokens=3000000,50000000] [--block-tokens=16]
//                   [--limit=N] [--hash-sample=2000]
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "proto/vocab/block_key.h"
#include "tests/bench/core_replay.h"
#include "client/tools/trace_bounds.h"

namespace {

using kvd::bench::ReplayOptions;
using kvd::bench::ReplayStats;

// Times XXH3 block hashing against a plain read of the same tokens.
void HashVersusRead(const std::vector<kvd::bench::TraceRequest>& trace, size_t sample, int bt) {
  std::vector<std::vector<kvd::Token>> prompts;
  size_t bytes = 0;
  for (size_t i = 0; i < trace.size() && i < sample; ++i) {
    prompts.push_back(kvd::bench::TraceTokens(trace[i]));
    bytes += prompts.back().size() * sizeof(kvd::Token);
  }
  const kvd::BlockKey root = kvd::NamespaceRootKey(kvd::Namespace{.pool = "trace"});
  using Clock = std::chrono::steady_clock;
  double best_hash = 1e30, best_read = 1e30;
  uint64_t sink = 0;
  for (int rep = 0; rep < 5; ++rep) {
    auto t0 = Clock::now();
    for (const auto& p : prompts) {
      kvd::BlockKey parent{};
      for (size_t b = 0; b + bt <= p.size(); b += bt) {
        parent = kvd::ChainBlockKey(parent, root, absl::MakeConstSpan(p).subspan(b, bt));
      }
      sink += parent.lo;
    }
    auto t1 = Clock::now();
    for (const auto& p : prompts) {
      uint64_t s = 0;
      for (kvd::Token t : p) s += t;
      sink += s;
    }
    auto t2 = Clock::now();
    best_hash = std::min(best_hash, std::chrono::duration<double>(t1 - t0).count());
    best_read = std::min(best_read, std::chrono::duration<double>(t2 - t1).count());
  }
  std::printf("hash vs read (%zu prompts, %.1f MiB of tokens, best of 5): chained XXH3-128 %.2f GB/s, "
              "plain read %.2f GB/s, ratio %.2fx (sink %llu)\n",
              prompts.size(), bytes / 1048576.0, bytes / best_hash / 1e9, bytes / best_read / 1e9,
              best_hash / best_read, static_cast<unsigned long long>(sink % 10));
}

}  // namespace

constexpr char kUsage[] =
    "usage: %s --trace=PATH [options]\n"
    "Replays a Mooncake FAST'25 trace through KvCache in-process (Admit, Acquire, Publish of every\n"
    "full prompt block, Release) and prints hit rate and engine time per block (docs/performance.md).\n"
    "  --trace=PATH              trace in JSON lines (required), e.g.\n"
    "                            ../shared/data/mooncake-fast25/conversation_trace.jsonl\n"
    "  --capacity-tokens=N,...   device capacities to replay, in tokens (default 3000000,50000000)\n"
    "  --block-tokens=N          tokens per block (default 16)\n"
    "  --limit=N                 replay only the first N requests (default: all)\n"
    "  --policy=lru|slru|horizon eviction policy (default: the engine's, slru)\n"
    "  --slru-main=F             SLRU main segment fraction, (0, 1) (default 0.5)\n"
    "  --slru-ghost=F            SLRU ghost keys per pool block, [0, 16] (default 4)\n"
    "  --horizon-probation=F     horizon policy: probation horizon, in pool capacities (default 0.01)\n"
    "  --horizon-main=F          horizon policy: main horizon, in pool capacities (default 4)\n"
    "  --horizon-sample=N        horizon policy: one key in N feeds the shadow caches (default 32;\n"
    "                            0: no shadows, the horizon order always)\n"
    "  --horizon-margin=F        horizon policy: its shadow must hit F times the recency one's (default 1.1)\n"
    "  --bounds=on|off           also compute the unlimited and farthest-next-use bounds (default on)\n"
    "  --holdout=F               also report the trace's last F by time apart (default 0.3333)\n"
    "  --model=L,H,HEADS,KV,FFN  model shape for compute saved (default Llama-3-8B: 32,4096,32,8,14336)\n"
    "  --hash-sample=N           prompts for the hashing-vs-read comparison; 0 skips it (default 2000)\n"
    "  --help                    this text\n";

int main(int argc, char** argv) {
  // Debian's Abseil is built with mutex deadlock detection on, which costs microseconds per lock;
  // production binaries (kvd) turn it off the same way. Tests keep it on.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  std::string trace_path;
  std::vector<int64_t> capacities = {3'000'000, 50'000'000};
  ReplayOptions base;
  size_t hash_sample = 2000;
  bool bounds = true;
  double holdout = 1.0 / 3;
  for (int i = 1; i < argc; ++i) {
    std::vector<std::string> kv = absl::StrSplit(argv[i], absl::MaxSplits('=', 1));
    const std::string& key = kv[0];
    const std::string value = kv.size() > 1 ? kv[1] : "";
    bool ok = true;
    if (key == "--help" || key == "-h") {
      std::printf(kUsage, argv[0]);
      return 0;
    } else if (key == "--trace") {
      trace_path = value;
    } else if (key == "--capacity-tokens") {
      capacities.clear();
      for (absl::string_view c : absl::StrSplit(value, ',')) {
        int64_t v = 0;
        ok = ok && absl::SimpleAtoi(c, &v) && v > 0;
        capacities.push_back(v);
      }
    } else if (key == "--block-tokens") {
      ok = absl::SimpleAtoi(value, &base.block_tokens) && base.block_tokens > 0;
    } else if (key == "--limit") {
      ok = absl::SimpleAtoi(value, &base.limit_requests);
    } else if (key == "--policy") {
      ok = kvd::ParseEvictionPolicy(value, &base.policy);
    } else if (key == "--horizon-probation") {
      ok = absl::SimpleAtod(value, &base.horizon_probation);
    } else if (key == "--horizon-margin") {
      ok = absl::SimpleAtod(value, &base.horizon_margin);
    } else if (key == "--horizon-sample") {
      ok = absl::SimpleAtoi(value, &base.horizon_sample_every);
    } else if (key == "--horizon-main") {
      ok = absl::SimpleAtod(value, &base.horizon_main);
    } else if (key == "--holdout") {
      ok = absl::SimpleAtod(value, &holdout) && holdout >= 0 && holdout < 1;
    } else if (key == "--model") {
      std::vector<std::string> v = absl::StrSplit(value, ',');
      ok = v.size() == 5 && absl::SimpleAtoi(v[0], &base.model.layers) && absl::SimpleAtoi(v[1], &base.model.hidden) &&
           absl::SimpleAtoi(v[2], &base.model.heads) && absl::SimpleAtoi(v[3], &base.model.kv_heads) &&
           absl::SimpleAtoi(v[4], &base.model.ffn) && base.model.heads > 0;
    } else if (key == "--slru-main") {
      ok = absl::SimpleAtod(value, &base.slru_main_fraction);
    } else if (key == "--slru-ghost") {
      ok = absl::SimpleAtod(value, &base.slru_ghost_fraction);
    } else if (key == "--bounds") {
      bounds = value != "off";
    } else if (key == "--hash-sample") {
      ok = absl::SimpleAtoi(value, &hash_sample);
    } else {
      ok = false;
    }
    if (!ok) {
      std::fprintf(stderr, "bad argument '%s'\n", argv[i]);
      std::fprintf(stderr, kUsage, argv[0]);
      return 2;
    }
  }
  if (trace_path.empty()) {
    std::fprintf(stderr, "--trace=PATH is required\n");
    std::fprintf(stderr, kUsage, argv[0]);
    return 2;
  }
  auto trace = kvd::bench::LoadTrace(trace_path);
  if (!trace.ok()) {
    std::fprintf(stderr, "%s\n", trace.status().ToString().c_str());
    return 1;
  }
  base.holdout_from = kvd::bench::HoldoutStart(*trace, holdout);
  const kvd::bench::PrefillCost cost(base.model);
  const kvd::bench::TraceTally unlimited = kvd::bench::UnlimitedBound(*trace, base.block_tokens, cost, base.holdout_from);
  std::printf("trace %s: %zu requests (held out: the last %zu, from t=%.0f s); policy %s; "
              "infinite-cache hit rate at 512-token blocks: %.1f%%\n",
              trace_path.c_str(), trace->size(), trace->size() - base.holdout_from,
              base.holdout_from < trace->size() ? (*trace)[base.holdout_from].timestamp_ms / 1e3 : 0.0,
              std::string(kvd::EvictionPolicyName(base.policy)).c_str(),
              100 * kvd::bench::InfiniteCacheHitRate(*trace));
  std::printf("unlimited cache at %d-token blocks: %.2f%% hit, %.2f%% compute saved; held out %.2f%%, %.2f%%\n",
              base.block_tokens, 100 * unlimited.all.hit_rate(), 100 * unlimited.all.saved_fraction(),
              100 * unlimited.holdout.hit_rate(), 100 * unlimited.holdout.saved_fraction());
  std::printf("| capacity (tokens) | requests | hit rate | compute saved | bound hit | bound saved | "
              "held-out hit | held-out saved | held-out bound hit | held-out bound saved | lookups/s | tokens/s | "
              "ns/block | indexed blocks | evicted | RSS growth/indexed block |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (int64_t cap : capacities) {
    ReplayOptions o = base;
    o.capacity_tokens = cap;
    auto s = kvd::bench::ReplayThroughCache(*trace, o);
    if (!s.ok()) {
      std::fprintf(stderr, "%s\n", s.status().ToString().c_str());
      return 1;
    }
    kvd::bench::TraceTally bound;
    if (bounds) {
      bound = kvd::bench::FarthestNextUseBound(*trace, base.block_tokens, cap / base.block_tokens, cost,
                                               base.holdout_from);
    }
    std::printf("| %lld | %lld | %.2f%% | %.2f%% | %.2f%% | %.2f%% | %.2f%% | %.2f%% | %.2f%% | %.2f%% | %.0f | %.3g "
                "| %.0f | %lld | %lld | %.0f B |\n",
                static_cast<long long>(cap), static_cast<long long>(s->requests), 100 * s->hit_rate(),
                100 * s->reuse.all.saved_fraction(), 100 * bound.all.hit_rate(), 100 * bound.all.saved_fraction(),
                100 * s->reuse.holdout.hit_rate(), 100 * s->reuse.holdout.saved_fraction(),
                100 * bound.holdout.hit_rate(), 100 * bound.holdout.saved_fraction(), s->requests / s->cache_seconds,
                s->prompt_tokens / s->cache_seconds, 1e9 * s->cache_seconds / s->prompt_blocks,
                static_cast<long long>(s->indexed_blocks), static_cast<long long>(s->evicted_blocks),
                s->indexed_blocks ? double(s->rss_growth_bytes) / s->indexed_blocks : 0.0);
  }
  if (hash_sample > 0) HashVersusRead(*trace, hash_sample, base.block_tokens);
  return 0;
}
