#include "client/tools/trace.h"

#include <cstdio>
#include <fstream>

#include <catch2/catch.hpp>

#include "tests/bench/core_replay.h"

namespace kvd::bench {
namespace {

TEST_CASE("Trace lines parse and bad lines are named", "[bench][trace]") {
  auto r = ParseTraceLine(R"({"timestamp": 27, "input_length": 1000, "output_length": 5, "hash_ids": [3, 4]})");
  REQUIRE(r.ok());
  REQUIRE(r->timestamp_ms == 27);
  REQUIRE(r->input_length == 1000);
  REQUIRE(r->hash_ids == std::vector<uint64_t>{3, 4});
  REQUIRE_FALSE(ParseTraceLine(R"({"timestamp": 0, "output_length": 5, "hash_ids": [1]})").ok());
  REQUIRE_FALSE(ParseTraceLine(R"({"timestamp": 0, "input_length": 2000, "output_length": 5, "hash_ids": [1]})").ok());
  REQUIRE_FALSE(ParseTraceLine(R"({"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [x]})").ok());
}

TEST_CASE("Shared hash_ids prefixes become shared token prefixes", "[bench][trace]") {
  TraceRequest a{.input_length = 1024 + 100, .hash_ids = {1, 2, 3}};
  TraceRequest b{.input_length = 1024 + 200, .hash_ids = {1, 2, 9}};
  TraceRequest c{.input_length = 600, .hash_ids = {7, 2}};
  auto ta = TraceTokens(a), tb = TraceTokens(b), tc = TraceTokens(c);
  REQUIRE(ta.size() == 1124);
  REQUIRE(std::equal(ta.begin(), ta.begin() + 1024, tb.begin()));
  REQUIRE_FALSE(std::equal(ta.begin() + 1024, ta.begin() + 1124, tb.begin() + 1024));
  REQUIRE_FALSE(std::equal(ta.begin(), ta.begin() + 512, tc.begin()));
}

TEST_CASE("Replaying a generated trace reuses exactly the shared prefixes", "[bench][replay]") {
  const std::string path = "kvd_trace_test.jsonl";
  {
    std::ofstream out(path);
    out << R"({"timestamp": 0, "input_length": 1024, "output_length": 10, "hash_ids": [0, 1]})" << "\n";
    out << R"({"timestamp": 1, "input_length": 1536, "output_length": 10, "hash_ids": [0, 1, 2]})" << "\n";
    out << "\n";
    out << R"({"timestamp": 2, "input_length": 512, "output_length": 10, "hash_ids": [5]})" << "\n";
  }
  auto trace = LoadTrace(path);
  std::remove(path.c_str());
  REQUIRE(trace.ok());
  REQUIRE(trace->size() == 3);
  REQUIRE(InfiniteCacheHitRate(*trace) == Approx(1024.0 / 3072));
  auto stats = ReplayThroughCache(*trace, ReplayOptions{.capacity_tokens = 100'000, .block_tokens = 16});
  REQUIRE(stats.ok());
  REQUIRE(stats->requests == 3);
  REQUIRE(stats->hit_tokens == 1024);  // the second request reuses the first one's two blocks
  REQUIRE(stats->indexed_blocks == (1024 + 512 + 512) / 16);
  REQUIRE(LoadTrace("/nonexistent/trace.jsonl").status().code() == absl::StatusCode::kNotFound);
}

TEST_CASE("Replays are deterministic and within the offline bound under every policy", "[bench][replay]") {
  // Conversations: each turn extends the previous turn's prompt by two hash ids; 40 conversations
  // interleaved so that reuse comes back after many other requests.
  std::vector<TraceRequest> trace;
  uint64_t next_id = 1;
  std::vector<std::vector<uint64_t>> convs(40);
  for (int turn = 0; turn < 4; ++turn) {
    for (size_t c = 0; c < convs.size(); ++c) {
      convs[c].push_back(next_id++);
      convs[c].push_back(next_id++);
      trace.push_back(TraceRequest{.timestamp_ms = static_cast<int64_t>(trace.size()),
                                   .input_length = static_cast<int64_t>(convs[c].size()) * 512,
                                   .output_length = 4, .hash_ids = convs[c]});
    }
  }
  const int64_t capacity_tokens = 64 * 512;
  const PrefillCost cost;
  const TraceTally bound = FarthestNextUseBound(trace, 512, capacity_tokens / 512, cost, trace.size());
  for (EvictionPolicy policy : {EvictionPolicy::kLru, EvictionPolicy::kSlru, EvictionPolicy::kHorizon}) {
    INFO("policy " << EvictionPolicyName(policy));
    ReplayOptions o{.capacity_tokens = capacity_tokens, .block_tokens = 512, .policy = policy};
    o.horizon_sample_every = 1;
    o.holdout_from = trace.size() / 2;
    auto first = ReplayThroughCache(trace, o);
    auto second = ReplayThroughCache(trace, o);
    REQUIRE(first.ok());
    REQUIRE(second.ok());
    REQUIRE(first->hit_tokens == second->hit_tokens);
    REQUIRE(first->evicted_blocks == second->evicted_blocks);
    REQUIRE(first->reuse.all.hit_tokens == first->hit_tokens);
    REQUIRE(first->reuse.all.saved_flops == second->reuse.all.saved_flops);
    REQUIRE(first->reuse.holdout.requests == static_cast<int64_t>(trace.size() - trace.size() / 2));
    REQUIRE(first->hit_tokens <= bound.all.hit_tokens);
    REQUIRE(first->reuse.all.saved_fraction() <= first->reuse.all.hit_rate());
  }
}

}  // namespace
}  // namespace kvd::bench
