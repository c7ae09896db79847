// Replays a request trace through an in-process KvCache on a hybrid pool (docs/hybrid.md), driving
// it as an engine would: Admit, Acquire (§2.6's lookup), then the prompt computed in steps of at
// most step_tokens, each step's blocks published (with state checkpoints on the pool's k-grid,
// §2.7) before the grow that reports computed_tokens and releases the window, then Release. The
// same trace replays on the same model accounted as all full attention, at the same byte budget,
// for the baseline. docs/performance.md, "Hybrid pools".
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/tools/trace.h"

namespace kvd::bench {

// The two geometries of the figures (docs/hybrid.md §1, §3), both 16-token blocks, 2,048 bytes
// per token per attention layer, max_model_len 131,072:
//   kOss:  gpt-oss-like, 36 layers, 18 full (odd) + 18 sliding window W = 128 (even).
//   kQwen: Qwen3-Next-like, 48 layers, 12 full (3, 7, ..., 47) + 36 state (GDN, 2,146,304 bytes
//          per layer: a float32 32 x 128 x 128 state and a bf16 8,192 x 3 conv state).
enum class HybridModel { kOss, kQwen };

// Where the engine writes state checkpoints:
//   kGrid: at every multiple of k x block_tokens the prefill passes (an engine whose kernel emits
//          the intermediate states, or whose prefill chunks are k blocks: SGLang's extra buffer);
//   kStep: at step ends that land on the grid only (vLLM's `align` mode: prefill chunks of
//          step_tokens rounded down to the grid, the state kept at each chunk's end); the first
//          chunk ends at the last grid point of the spine's match when the hit was cut short
//          there (full_hit_tokens), so the branch point gets a checkpoint.
enum class CheckpointMode { kGrid, kStep };

struct HybridReplayOptions {
  HybridModel model = HybridModel::kOss;
  bool all_full = false;            // the baseline: the same layers, one full-attention group
  int64_t budget_tokens = 3'000'000;  // the budget, in tokens of the all-full-attention model
  int32_t k = 16;                   // kQwen: checkpoint_every_blocks
  CheckpointMode mode = CheckpointMode::kGrid;
  // The fraction of the budget the second group (swa, or the state group) gets, the rest going to
  // the full group; 0: kvd's default split (docs/hybrid.md §2.3), which may refuse a small budget.
  double side_share = 0;
  int32_t step_tokens = 2048;
  int64_t limit_requests = 0;       // 0: the whole trace
  bool check_invariants = false;    // run the engine's invariant checker after every request
};

struct HybridReplayStats {
  int64_t requests = 0;
  int64_t skipped = 0;              // OUT_OF_RANGE: larger than the pool or a group by itself
  int64_t prompt_tokens = 0;
  int64_t hit_tokens = 0;           // cached_tokens summed
  int64_t full_hit_tokens = 0;      // the spine's match summed (hybrid; = hit_tokens for all-full)
  int64_t limited = 0;              // hits a group shortened below the spine's match
  int64_t checkpoints_offered = 0;
  int64_t checkpoints_kept = 0;
  int64_t checkpoint_outcomes[5] = {};  // by CheckpointOutcome: kept, already_cached, no_chain, no_window, not_aligned
  std::vector<int64_t> reserved_bytes;  // per request, what Admit reserved
  double seconds = 0;               // wall time of the replay
  // The pool as resolved: per group name, unit bytes and capacity in units; cached units at the end.
  struct Group {
    std::string name;
    int64_t unit_bytes = 0;
    int64_t capacity = 0;
    int64_t cached_at_end = 0;
  };
  std::vector<Group> groups;
  int64_t pool_bytes = 0;           // what the groups hold together: at most the budget
  double hit_rate() const { return prompt_tokens == 0 ? 0 : double(hit_tokens) / prompt_tokens; }
  int64_t median_reserved_bytes() const;
};

// INVALID_ARGUMENT when the pool cannot be configured (e.g. the default split refuses the
// budget, naming the field); INTERNAL when the engine answers what an engine in this loop never
// should (with the call and status), or when check_invariants finds a broken invariant.
absl::StatusOr<HybridReplayStats> ReplayHybrid(const std::vector<TraceRequest>& trace,
                                               const HybridReplayOptions& options);

}  // namespace kvd::bench
