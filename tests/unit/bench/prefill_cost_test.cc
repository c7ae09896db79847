// The compute-saved cost model and the trace bounds that report it.
#include <catch2/catch.hpp>

#include "client/tools/prefill_cost.h"
#include "client/tools/trace_bounds.h"

namespace kvd::bench {
namespace {

TEST_CASE("Prefill cost: linear work per token plus attention growing with position", "[bench][cost]") {
  const ModelShape shape{.layers = 2, .hidden = 8, .heads = 2, .kv_heads = 1, .ffn = 16};
  const PrefillCost cost(shape);
  // Per layer: Q and O 8x8 each, K and V 8x4 each, MLP three 8x16: 2 FLOPs per weight.
  REQUIRE(cost.LinearFlopsPerToken() == 2 * 2.0 * (2 * 64 + 2 * 32 + 3 * 128));
  REQUIRE(cost.AttentionFlopsPerPair() == 2 * 4.0 * 8);
  // Flops(b, e) is the sum over positions of linear + attention × (p + 1), position by position.
  for (int64_t b : {0, 1, 7}) {
    for (int64_t e : {7, 8, 100}) {
      double sum = 0;
      for (int64_t p = b; p < e; ++p) sum += cost.LinearFlopsPerToken() + cost.AttentionFlopsPerPair() * (p + 1);
      REQUIRE(cost.Flops(b, e) == Approx(sum));
    }
  }
  REQUIRE(cost.Flops(5, 5) == 0);
  // Llama-3-8B (the default): ~14 GFLOPs of linear work per token, about twice its 7B weights
  // outside the embedding and LM head.
  REQUIRE(PrefillCost().LinearFlopsPerToken() == 13'958'643'712.0);
}

TEST_CASE("A prefix saves less than its share of a prompt's compute", "[bench][cost]") {
  const PrefillCost cost;
  ReuseTally t;
  t.Add(cost, 12'000, 6'000);  // half the tokens, the cheap half
  REQUIRE(t.hit_rate() == Approx(0.5));
  REQUIRE(t.saved_fraction() < 0.5);
  REQUIRE(t.saved_fraction() > 0.3);
  ReuseTally none, all;
  none.Add(cost, 100, 0);
  all.Add(cost, 100, 100);
  REQUIRE(none.saved_fraction() == 0);
  REQUIRE(all.saved_fraction() == Approx(1));
}

TraceRequest Request(int64_t ts, int64_t tokens, std::vector<uint64_t> ids) {
  return TraceRequest{.timestamp_ms = ts, .input_length = tokens, .output_length = 1, .hash_ids = std::move(ids)};
}

TEST_CASE("Farthest-next-use on a small trace, worked by hand", "[bench][bounds]") {
  // Capacity 2 blocks of 512 tokens; each prompt is its blocks plus one token, so every block can
  // hit. r2 brings block 3 into a full cache: block 3 is never used again, 1 is next used by r3
  // and 2 by r4, so farthest-next-use drops 3 and both later requests hit one block. (LRU would
  // drop 1 for 3, then 2 for 1, and hit nothing.)
  // (The one extra token is a second, partial block: ids 100+ are never full blocks.)
  const std::vector<TraceRequest> trace = {Request(0, 513, {1, 100}), Request(1, 513, {2, 101}),
                                           Request(2, 513, {3, 102}), Request(3, 513, {1, 103}),
                                           Request(4, 513, {2, 104})};
  const PrefillCost cost;
  const size_t holdout = HoldoutStart(trace, 0.4);  // timestamps >= 0 + 0.6 × 4 = 2.4
  REQUIRE(holdout == 3);
  const TraceTally bound = FarthestNextUseBound(trace, 512, 2, cost, holdout);
  REQUIRE(bound.all.requests == 5);
  REQUIRE(bound.all.prompt_tokens == 5 * 513);
  REQUIRE(bound.all.hit_tokens == 1024);
  REQUIRE(bound.all.saved_flops == Approx(2 * cost.Flops(0, 512)));
  REQUIRE(bound.all.prompt_flops == Approx(5 * cost.Flops(0, 513)));
  REQUIRE(bound.holdout.requests == 2);
  REQUIRE(bound.holdout.hit_tokens == 1024);
  // With one block of room, block 1 (next used by r3) outlives 2 and 3 (used later or never): r3
  // hits, r4 does not.
  REQUIRE(FarthestNextUseBound(trace, 512, 1, cost, holdout).all.hit_tokens == 512);
  const TraceTally unlimited = UnlimitedBound(trace, 512, cost, holdout);
  REQUIRE(unlimited.all.hit_tokens == 1024);
  // At 16-token blocks the same trace hits the same tokens (32 blocks per hash id).
  REQUIRE(FarthestNextUseBound(trace, 16, 64, cost, holdout).all.hit_tokens == 1024);
  REQUIRE(HoldoutStart(trace, 0) == trace.size());
}

}  // namespace
}  // namespace kvd::bench
