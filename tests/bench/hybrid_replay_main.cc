// kvd_hybrid_replay: the Mooncake trace through KvCache on hybrid pools against the same model
// accounted as all full attention at the same byte budget: hit rate, bytes reserved per request,
// and, for the state-group geometry, what the checkpoint interval k costs. docs/performance.md,
// "Hybrid pools".
//
//   kvd_hybrid_replay --trace=PATH [--model=oss,qwen] [--budget-tokens=3000000] [--k=1,2,4,8,16]
//                     [--mode=grid|step] [--side-share=F] [--step-tokens=2048] [--limit=N] [--check]
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "tests/bench/hybrid_replay.h"

namespace {

using kvd::bench::HybridModel;
using kvd::bench::HybridReplayOptions;
using kvd::bench::HybridReplayStats;

constexpr char kUsage[] =
    "usage: %s --trace=PATH [options]\n"
    "Replays a Mooncake FAST'25 trace through KvCache on hybrid pools (Admit, Acquire with the\n"
    "hybrid lookup, the prompt computed in steps, each step's blocks and state checkpoints\n"
    "published before the grow that reports computed_tokens, Release), and the same model as all\n"
    "full attention at the same byte budget.\n"
    "  --trace=PATH          trace in JSON lines (required)\n"
    "  --model=LIST          oss (gpt-oss-like: 18 full + 18 SWA W=128) and/or qwen (Qwen3-Next-like:\n"
    "                        12 full + 36 GDN state layers) (default oss,qwen)\n"
    "  --budget-tokens=LIST  byte budgets, in tokens of the all-full-attention model (default 3000000)\n"
    "  --k=LIST              qwen: checkpoint_every_blocks values (default 1,2,4,8,16)\n"
    "  --mode=grid|step      qwen: a checkpoint at every grid point the prefill passes (grid), or at\n"
    "                        grid-aligned step ends only, vLLM's align mode (step) (default grid)\n"
    "  --side-share=F        fraction of the budget for the second group (oss: swa, qwen: the state\n"
    "                        group), the rest for full; 0: kvd's default split (default 0)\n"
    "  --step-tokens=N       tokens computed per step, the pool's step_tokens (default 2048)\n"
    "  --limit=N             replay only the first N requests (default: all)\n"
    "  --check               run the engine's invariant checker after every request (slow)\n";

bool ParseList(const std::string& value, std::vector<int64_t>* out) {
  out->clear();
  for (absl::string_view s : absl::StrSplit(value, ',')) {
    int64_t v = 0;
    if (!absl::SimpleAtoi(s, &v) || v <= 0) return false;
    out->push_back(v);
  }
  return !out->empty();
}

void PrintRow(const char* model, const std::string& pool, const HybridReplayStats& s, const HybridReplayStats& base) {
  std::vector<std::string> caps, cached;
  for (const auto& g : s.groups) {
    caps.push_back(absl::StrCat(g.name, " ", g.capacity));
    cached.push_back(absl::StrFormat("%s %.1f", g.name, g.cached_at_end * static_cast<double>(g.unit_bytes) / (1 << 30)));
  }
  const double reserved = s.median_reserved_bytes() / 1048576.0;
  const double base_reserved = base.median_reserved_bytes() / 1048576.0;
  std::printf("| %s | %s | %.1f | %lld | %.2f%% | %.3f | %.2f%% | %lld | %lld/%lld | %.1f | %.3f | %s | %s | %lld | %.0f |\n",
              model, pool.c_str(), s.pool_bytes / double(1 << 30), static_cast<long long>(s.requests), 100 * s.hit_rate(),
              base.hit_rate() > 0 ? s.hit_rate() / base.hit_rate() : 0.0,
              s.prompt_tokens ? 100.0 * s.full_hit_tokens / s.prompt_tokens : 0.0, static_cast<long long>(s.limited),
              static_cast<long long>(s.checkpoints_kept), static_cast<long long>(s.checkpoints_offered), reserved,
              base_reserved > 0 ? reserved / base_reserved : 0.0, absl::StrJoin(caps, ", ").c_str(),
              absl::StrJoin(cached, ", ").c_str(), static_cast<long long>(s.skipped), s.seconds);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);  // as kvd_core_replay
  std::string trace_path;
  std::vector<std::string> models = {"oss", "qwen"};
  std::vector<int64_t> budgets = {3'000'000};
  std::vector<int64_t> ks = {1, 2, 4, 8, 16};
  HybridReplayOptions base;
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
    } else if (key == "--model") {
      models = absl::StrSplit(value, ',');
      for (const std::string& m : models) ok = ok && (m == "oss" || m == "qwen");
    } else if (key == "--budget-tokens") {
      ok = ParseList(value, &budgets);
    } else if (key == "--k") {
      ok = ParseList(value, &ks);
    } else if (key == "--mode") {
      ok = value == "grid" || value == "step";
      base.mode = value == "step" ? kvd::bench::CheckpointMode::kStep : kvd::bench::CheckpointMode::kGrid;
    } else if (key == "--side-share") {
      ok = absl::SimpleAtod(value, &base.side_share) && base.side_share >= 0 && base.side_share < 1;
    } else if (key == "--step-tokens") {
      ok = absl::SimpleAtoi(value, &base.step_tokens) && base.step_tokens >= 16;
    } else if (key == "--limit") {
      ok = absl::SimpleAtoi(value, &base.limit_requests) && base.limit_requests >= 0;
    } else if (key == "--check") {
      base.check_invariants = true;
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
  std::printf("trace %s: %zu requests (replayed: %s); step_tokens %d; qwen checkpoints: %s; split: %s\n",
              trace_path.c_str(), trace->size(),
              base.limit_requests > 0 ? absl::StrCat("the first ", base.limit_requests).c_str() : "all",
              base.step_tokens, base.mode == kvd::bench::CheckpointMode::kGrid ? "every grid point" : "grid-aligned step ends",
              base.side_share > 0 ? absl::StrCat(base.side_share, " of the budget to swa / the state group").c_str()
                                  : "kvd's default");
  std::printf("| model | pool | pool GiB | requests | hit rate | vs all-full | spine match | hits limited | checkpoints kept/offered "
              "| median reserved MiB/request | vs all-full | capacity (units) | cached at end (GiB) | skipped | s |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  std::vector<std::string> notes;
  for (int64_t budget : budgets) {
    for (const std::string& m : models) {
      HybridReplayOptions o = base;
      o.budget_tokens = budget;
      o.model = m == "oss" ? HybridModel::kOss : HybridModel::kQwen;
      o.all_full = true;
      auto full = kvd::bench::ReplayHybrid(*trace, o);
      if (!full.ok()) {
        std::fprintf(stderr, "%s all-full: %s\n", m.c_str(), full.status().ToString().c_str());
        return 1;
      }
      PrintRow(m.c_str(), absl::StrCat("all full, ", budget, " tokens"), *full, *full);
      o.all_full = false;
      const std::vector<int64_t> sweep = o.model == HybridModel::kOss ? std::vector<int64_t>{0} : ks;
      for (int64_t k : sweep) {
        if (k > 0) o.k = static_cast<int32_t>(k);
        const std::string pool = k > 0 ? absl::StrCat("hybrid, k ", k) : "hybrid";
        auto h = kvd::bench::ReplayHybrid(*trace, o);
        if (absl::IsInvalidArgument(h.status())) {
          std::printf("| %s | %s | refused: %s |\n", m.c_str(), pool.c_str(), std::string(h.status().message()).c_str());
          continue;
        }
        if (!h.ok()) {
          std::fprintf(stderr, "%s %s: %s\n", m.c_str(), pool.c_str(), h.status().ToString().c_str());
          return 1;
        }
        PrintRow(m.c_str(), pool, *h, *full);
        if (h->checkpoints_offered != h->checkpoints_kept) {
          const int64_t* c = h->checkpoint_outcomes;
          notes.push_back(absl::StrFormat(
              "%s %s: checkpoints offered and not kept: already_cached %d, no_chain %d, no_window %d, not_aligned %d",
              m, pool, c[1], c[2], c[3], c[4]));
        }
      }
    }
  }
  for (const std::string& n : notes) std::printf("%s\n", n.c_str());
  return 0;
}
