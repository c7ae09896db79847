// A smoke of kvd_hybrid_replay's loop (tests/bench/hybrid_replay.h) on a four-request trace whose
// reuse is known exactly, with the engine's invariant checker after every request: the figures in
// docs/performance.md come from this loop, so its hits must be the ones each geometry can serve.
#include "tests/bench/hybrid_replay.h"

#include <catch2/catch.hpp>

namespace kvd::bench {
namespace {

// A: 3 trace blocks + 100 tokens; B shares A's 3 blocks (1,536 tokens); C shares 2 (1,024); D none.
std::vector<TraceRequest> Trace() {
  return {TraceRequest{.input_length = 1636, .output_length = 8, .hash_ids = {0, 1, 2, 3}},
          TraceRequest{.input_length = 2098, .output_length = 8, .hash_ids = {0, 1, 2, 4, 5}},
          TraceRequest{.input_length = 1100, .output_length = 8, .hash_ids = {0, 1, 6}},
          TraceRequest{.input_length = 300, .output_length = 8, .hash_ids = {7}}};
}

HybridReplayStats Run(HybridReplayOptions o) {
  o.budget_tokens = 1'000'000;
  o.check_invariants = true;
  const absl::StatusOr<HybridReplayStats> s = ReplayHybrid(Trace(), o);
  INFO(s.status().ToString());
  REQUIRE(s.ok());
  CHECK(s->requests == 4);
  CHECK(s->skipped == 0);
  CHECK(s->prompt_tokens == 1636 + 2098 + 1100 + 300);
  return *s;
}

TEST_CASE("the hybrid replay hits what every group can serve, and reserves less than all-full", "[bench][hybrid]") {
  const HybridReplayStats full = Run({.model = HybridModel::kOss, .all_full = true});
  CHECK(full.hit_tokens == 1536 + 1024);
  const HybridReplayStats oss = Run({.model = HybridModel::kOss});
  CHECK(oss.hit_tokens == 1536 + 1024);  // a roomy pool keeps the window blocks of every position
  CHECK(oss.groups.size() == 2);
  // At the default step slack (2,048) the window's reservation covers a request this short whole:
  // the same bytes as all-full. Steps of 256 tokens: 18 layers for every position plus 25 window
  // blocks, against 36 layers for every position.
  CHECK(oss.median_reserved_bytes() == full.median_reserved_bytes());
  const HybridReplayStats short_steps = Run({.model = HybridModel::kOss, .step_tokens = 256});
  CHECK(short_steps.hit_tokens == 1536 + 1024);
  CHECK(short_steps.median_reserved_bytes() < full.median_reserved_bytes() * 3 / 4);
  // An explicit split: a quarter of the budget to the window group.
  const HybridReplayStats split = Run({.model = HybridModel::kOss, .side_share = 0.25});
  CHECK(split.hit_tokens == 1536 + 1024);
  REQUIRE(split.groups.size() == 2);
  CHECK(split.groups[1].capacity * split.groups[1].unit_bytes <= split.pool_bytes / 4);
  CHECK(split.groups[1].capacity * split.groups[1].unit_bytes > split.pool_bytes / 5);

  // Every grid point of 256 tokens the prefill passes holds a checkpoint: hits at 1,536 and 1,024.
  const HybridReplayStats grid = Run({.model = HybridModel::kQwen, .k = 16});
  CHECK(grid.hit_tokens == 1536 + 1024);
  CHECK(grid.full_hit_tokens >= grid.hit_tokens);
  CHECK(grid.checkpoints_kept > 0);
  // Steps of 768 tokens, checkpoints at step ends only: A leaves states at 768 and 1,536, so C's
  // 1,024 shared tokens hit at 768 — the hit the state group limits.
  const HybridReplayStats step =
      Run({.model = HybridModel::kQwen, .k = 16, .mode = CheckpointMode::kStep, .step_tokens = 768});
  CHECK(step.hit_tokens == 1536 + 768);
  CHECK(step.limited == 1);
}

TEST_CASE("the hybrid replay names a budget kvd's default split refuses", "[bench][hybrid]") {
  // k = 1 at a small budget: the state checkpoints of one design request leave the full group
  // less than one max_model_len request.
  const absl::StatusOr<HybridReplayStats> s =
      ReplayHybrid(Trace(), {.model = HybridModel::kQwen, .budget_tokens = 100'000, .k = 1});
  REQUIRE(absl::IsInvalidArgument(s.status()));
  CHECK_THAT(std::string(s.status().message()), Catch::Contains("capacity"));
}

}  // namespace
}  // namespace kvd::bench
