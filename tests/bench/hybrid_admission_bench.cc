// kvd_hybrid_admission_bench: bytes kvd's admission reserves for one 32k-token request of a
// gpt-oss-like geometry (36 layers, 18 full + 18 sliding window W = 128, 2 KiB per token per layer,
// 16-token blocks) with KV groups, against the same model accounted as all full attention, and
// how many such requests a 64 GiB budget admits both ways. The figures come from KvCache's own
// admission (Fits, then Admit until it answers kWait), not from the formulas. docs/performance.md.
#include <cstdio>
#include <memory>

#include "server/core/clock.h"
#include "server/core/kv_cache.h"

namespace kvd {
namespace {

constexpr int64_t kBudget = int64_t{64} << 30;
constexpr int64_t kTokens = 32768;

CacheOptions Options(bool hybrid, int32_t step_tokens) {
  PoolGeometry g;
  g.name = "oss";
  g.block_tokens = 16;
  g.num_layers = 36;
  g.bytes_per_token_per_layer = 2048;
  g.max_model_len = 131072;
  if (hybrid) {
    g.step_tokens = step_tokens;
    const int64_t cap = kBudget / (16 * 18 * 2048) + 1;  // either group could take the whole budget
    g.groups.push_back(KvGroup{.name = "full", .kind = KvGroupKind::kFull, .layers = {}, .capacity = cap});
    g.groups.push_back(KvGroup{.name = "swa", .kind = KvGroupKind::kSlidingWindow, .layers = {}, .window = 128,
                               .capacity = cap});
    // Odd layers full, even layers a 128-token window.
    for (int l = 0; l < 36; ++l) g.groups[l % 2 == 1 ? 0 : 1].layers.push_back(l);
    if (absl::Status s = g.ResolveGroups(); !s.ok()) {
      std::fprintf(stderr, "%s\n", s.ToString().c_str());
      std::exit(1);
    }
  } else {
    g.capacity_blocks = (kBudget + g.block_bytes() - 1) / g.block_bytes();
  }
  CacheOptions o;
  o.pools = {g};
  o.budget_bytes = kBudget;
  return o;
}

struct Figures {
  int64_t bytes = 0;
  int64_t fit = 0;
};

Figures Run(bool hybrid, int32_t step_tokens) {
  const SystemClock clock;
  auto cache = KvCache::Create(Options(hybrid, step_tokens), &clock);
  if (!cache.ok()) {
    std::fprintf(stderr, "%s\n", cache.status().ToString().c_str());
    std::exit(1);
  }
  Figures f;
  for (;; ++f.fit) {
    RequestSpec spec;
    spec.id = RequestId("r" + std::to_string(f.fit));
    spec.ns.pool = "oss";
    spec.prompt.assign(kTokens - 1024, 7);
    spec.max_new_tokens = 1024;
    spec.owner = WorkerId("bench");
    absl::StatusOr<AdmitResult> r = (*cache)->Admit(spec);
    if (!r.ok() || r->decision != AdmitDecision::kAdmitted) break;
    if (f.fit == 0) f.bytes = r->projected_bytes;
  }
  return f;
}

}  // namespace
}  // namespace kvd

int main() {
  const kvd::Figures full = kvd::Run(false, 0);
  std::printf("gpt-oss-like: 36 layers (18 full, 18 SWA W=128), 2048 B/token/layer, bt 16, one 32,768-token request, 64 GiB budget\n");
  std::printf("%-28s %16s %10s %8s %14s\n", "accounting", "bytes admitted", "MiB", "vs full", "requests fit");
  std::printf("%-28s %16lld %10.2f %7.1f%% %14lld\n", "all full attention", static_cast<long long>(full.bytes),
              full.bytes / 1048576.0, 100.0, static_cast<long long>(full.fit));
  for (int32_t s : {16, 2048, 3072, 8192}) {
    const kvd::Figures h = kvd::Run(true, s);
    char label[64];
    std::snprintf(label, sizeof(label), "hybrid, step_tokens %d", s);
    std::printf("%-28s %16lld %10.2f %7.1f%% %14lld\n", label, static_cast<long long>(h.bytes), h.bytes / 1048576.0,
                100.0 * h.bytes / full.bytes, static_cast<long long>(h.fit));
  }
  return 0;
}
