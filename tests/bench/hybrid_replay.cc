#include "tests/bench/hybrid_replay.h"

#include <algorithm>
#include <chrono>
#include <memory>

#include "absl/strings/str_cat.h"
#include "proto/vocab/status_macros.h"
#include "proto/vocab/step_types.h"
#include "server/core/clock.h"
#include "server/core/kv_cache.h"

namespace kvd::bench {
namespace {

constexpr int32_t kBlockTokens = 16;
constexpr int64_t kBytesPerToken = 2048;  // one attention layer, one shard
constexpr int64_t kGdnStateBytes = 32 * 128 * 128 * 4 + 8192 * 3 * 2;  // 2,146,304
constexpr char kPool[] = "m";

int32_t NumLayers(HybridModel m) { return m == HybridModel::kOss ? 36 : 48; }

absl::StatusOr<PoolGeometry> Geometry(const HybridReplayOptions& o, int64_t budget) {
  PoolGeometry g;
  g.name = kPool;
  g.block_tokens = kBlockTokens;
  g.num_layers = NumLayers(o.model);
  g.bytes_per_token_per_layer = kBytesPerToken;
  g.max_model_len = 131072;
  if (o.all_full) {
    g.capacity_blocks = budget / g.block_bytes();
    return g;
  }
  g.step_tokens = o.step_tokens;
  if (o.model == HybridModel::kOss) {
    g.groups.push_back(KvGroup{.name = "full", .kind = KvGroupKind::kFull});
    g.groups.push_back(KvGroup{.name = "swa", .kind = KvGroupKind::kSlidingWindow, .window = 128});
    for (int32_t l = 0; l < 36; ++l) g.groups[l % 2 == 1 ? 0 : 1].layers.push_back(l);
  } else {
    g.groups.push_back(KvGroup{.name = "attn", .kind = KvGroupKind::kFull});
    g.groups.push_back(KvGroup{.name = "gdn", .kind = KvGroupKind::kState, .bytes_per_state = kGdnStateBytes,
                               .checkpoint_every_blocks = o.k, .checkpoint_at_end = false});
    for (int32_t l = 0; l < 48; ++l) g.groups[l % 4 == 3 ? 0 : 1].layers.push_back(l);
  }
  if (o.side_share > 0) {
    // Explicit capacities: the share of the budget for the second group, the rest for full.
    const int64_t side_unit = o.model == HybridModel::kOss ? int64_t{kBlockTokens} * 18 * kBytesPerToken
                                                           : kGdnStateBytes * 36;
    const int64_t full_unit = int64_t{kBlockTokens} * static_cast<int64_t>(g.groups[0].layers.size()) * kBytesPerToken;
    g.groups[1].capacity = static_cast<int64_t>(o.side_share * static_cast<double>(budget)) / side_unit;
    g.groups[0].capacity = (budget - g.groups[1].capacity * side_unit) / full_unit;
  } else {
    g.capacity_bytes = budget;  // kvd's default split (docs/hybrid.md §2.3)
  }
  KVD_RETURN_IF_ERROR(g.ResolveGroups());
  return g;
}

// One request's state table as the engine keeps it: [running, spare].
struct StateSlots {
  std::vector<BlockIndex> slots;
  void Apply(const GroupTable& t) { slots.insert(slots.end(), t.blocks.begin(), t.blocks.end()); }
  bool has_spare() const { return slots.size() == 2; }
};

absl::Status Internal(absl::string_view call, size_t i, const absl::Status& s) {
  return absl::InternalError(absl::StrCat(call, " of request ", i, ": ", s.ToString()));
}

}  // namespace

int64_t HybridReplayStats::median_reserved_bytes() const {
  if (reserved_bytes.empty()) return 0;
  std::vector<int64_t> v = reserved_bytes;
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

absl::StatusOr<HybridReplayStats> ReplayHybrid(const std::vector<TraceRequest>& trace,
                                               const HybridReplayOptions& options) {
  const int64_t budget = options.budget_tokens * NumLayers(options.model) * kBytesPerToken;
  absl::StatusOr<PoolGeometry> geometry = Geometry(options, budget);
  if (!geometry.ok()) return absl::InvalidArgumentError(geometry.status().message());
  CacheOptions co;
  co.pools = {*geometry};
  co.budget_bytes = 0;  // what the pool holds: the split may leave a remainder of `budget` unused
  KVD_ASSIGN_OR_RETURN(std::unique_ptr<KvCache> cache, KvCache::Create(co, SystemClock::Get()));

  HybridReplayStats stats;
  const PoolGeometry& g = *geometry;
  const int state_group = g.hybrid() && g.groups[1].kind == KvGroupKind::kState ? 1 : -1;
  const int64_t grid = int64_t{options.k} * kBlockTokens;
  const int64_t step = options.step_tokens;
  const WorkerId worker("bench");

  auto grow = [&](const RequestId& id, int64_t computed) {
    StepOp op;
    op.kind = StepOpKind::kGrow;
    op.id = id;
    op.computed_tokens = computed;
    std::vector<StepOp> ops;
    ops.push_back(std::move(op));
    return std::move(cache->Step(worker, worker, std::move(ops), {}, nullptr)[0]);
  };

  const auto t0 = std::chrono::steady_clock::now();
  const size_t n_requests = options.limit_requests > 0
                                ? std::min<size_t>(trace.size(), static_cast<size_t>(options.limit_requests))
                                : trace.size();
  for (size_t i = 0; i < n_requests; ++i) {
    RequestSpec spec;
    spec.id = RequestId(absl::StrCat("r", i));
    spec.ns.pool = kPool;
    spec.prompt = TraceTokens(trace[i]);
    spec.max_new_tokens = trace[i].output_length;
    spec.owner = worker;
    if (spec.prompt.empty()) continue;
    const int64_t n = static_cast<int64_t>(spec.prompt.size());

    absl::StatusOr<AdmitResult> admitted = cache->Admit(spec);
    if (!admitted.ok() && admitted.status().code() == absl::StatusCode::kOutOfRange) {
      ++stats.skipped;
      continue;
    }
    if (!admitted.ok()) return Internal("Admit", i, admitted.status());
    if (admitted->decision != AdmitDecision::kAdmitted) {
      return absl::InternalError(absl::StrCat("Admit of request ", i, " waits: a sequential replay never should"));
    }
    absl::StatusOr<AcquireResult> acq = cache->Acquire(spec.id);
    if (!acq.ok()) return Internal("Acquire", i, acq.status());
    ++stats.requests;
    stats.prompt_tokens += n;
    stats.hit_tokens += acq->cached_tokens;
    stats.full_hit_tokens += g.hybrid() ? acq->full_hit_tokens : acq->cached_tokens;
    if (acq->limited_by >= 0) ++stats.limited;
    stats.reserved_bytes.push_back(admitted->projected_bytes);
    const std::vector<BlockIndex>& full = acq->blocks;
    auto full_prefix = [&](int64_t tokens) {
      return absl::MakeConstSpan(full).subspan(0, static_cast<size_t>(tokens / kBlockTokens));
    };

    if (!g.hybrid()) {
      // Today's pool: the prompt's full blocks published after prefill, as kvd_core_replay does.
      absl::StatusOr<PublishResult> p = cache->Publish(spec.id, spec.prompt, full_prefix(n));
      if (!p.ok()) return Internal("Publish", i, p.status());
    } else {
      StateSlots state;
      if (state_group >= 0) state.Apply(acq->group_tables[state_group]);
      int64_t c = acq->cached_tokens;
      if (state_group >= 0 && c > 0) {
        // The engine copied the hit's checkpoint into its running slot; the grow reporting it
        // hands the spare out (§2.6: the checkpoint stands for it until then).
        StepOpResult r = grow(spec.id, c);
        if (!r.status.ok()) return Internal("grow", i, r.status);
        state.Apply(r.group_tables[state_group]);
      }
      int64_t published = 0;  // full blocks offered so far, in tokens
      auto publish = [&](int64_t upto, int64_t checkpoint_at) -> absl::Status {
        std::vector<StateCheckpoint> ckpt;
        if (checkpoint_at > 0 && state.has_spare()) {
          ckpt.push_back(StateCheckpoint{.group = state_group, .position_tokens = checkpoint_at, .slot = state.slots[1]});
        }
        if (upto / kBlockTokens <= published / kBlockTokens && ckpt.empty()) return absl::OkStatus();
        absl::StatusOr<PublishResult> p = cache->Publish(spec.id, spec.prompt, full_prefix(upto), ckpt);
        if (!p.ok()) return Internal("Publish", i, p.status());
        published = upto;
        if (!ckpt.empty()) {
          ++stats.checkpoints_offered;
          ++stats.checkpoint_outcomes[static_cast<int>(p->checkpoint_outcomes[0])];
          if (p->checkpoint_outcomes[0] == CheckpointOutcome::kKept) {
            ++stats.checkpoints_kept;
            if (p->fresh_slots[0] >= 0) state.slots[1] = static_cast<BlockIndex>(p->fresh_slots[0]);
            else state.slots.pop_back();
          }
        }
        return absl::OkStatus();
      };
      // Where the spine matched further than the hit (the state group cut it), the prefix up to
      // the last grid point of the match is shared with another chain: a step-mode engine ends its
      // first chunk there so that a checkpoint marks the branch (SGLang's mamba_branching_seqlen).
      const int64_t branch = acq->full_hit_tokens / grid * grid;
      while (c < n) {
        int64_t c2 = std::min(n, c + step);
        if (state_group >= 0 && options.mode == CheckpointMode::kStep && c2 < n && c2 / grid * grid > c) {
          c2 = c2 / grid * grid;  // align mode: a chunk that does not finish the prompt ends on the grid
        }
        if (state_group >= 0 && options.mode == CheckpointMode::kStep && branch > c && branch < c2) c2 = branch;
        if (state_group >= 0 && options.mode == CheckpointMode::kGrid) {
          for (int64_t p = (c / grid + 1) * grid; p <= c2; p += grid) KVD_RETURN_IF_ERROR(publish(p, p));
        } else if (state_group >= 0 && c2 % grid == 0) {
          KVD_RETURN_IF_ERROR(publish(c2, c2));
        }
        // This step's blocks go out before the grow that releases the window below it.
        KVD_RETURN_IF_ERROR(publish(c2 / kBlockTokens * kBlockTokens, 0));
        StepOpResult r = grow(spec.id, c2);
        if (!r.status.ok()) return Internal("grow", i, r.status);
        if (state_group >= 0) state.Apply(r.group_tables[state_group]);
        c = c2;
      }
    }
    if (absl::Status s = cache->Release(spec.id, /*completed=*/true); !s.ok()) return Internal("Release", i, s);
    if (options.check_invariants) {
      if (absl::Status s = cache->CheckInvariantsForTesting(); !s.ok()) return Internal("invariants after", i, s);
    }
  }
  stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  const CacheReport report = cache->Report();
  if (g.hybrid()) {
    for (size_t j = 0; j < g.groups.size(); ++j) {
      stats.groups.push_back({g.groups[j].name, g.GroupUnitBytes(static_cast<int>(j)), g.groups[j].capacity,
                              report.pools[0].groups[j].cached});
    }
  } else {
    stats.groups.push_back({"all", g.block_bytes(), g.capacity_blocks, report.pools[0].cached_blocks});
  }
  for (const HybridReplayStats::Group& gs : stats.groups) stats.pool_bytes += gs.unit_bytes * gs.capacity;
  return stats;
}

}  // namespace kvd::bench
