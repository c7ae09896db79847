// libFuzzer target: the input bytes drive a sequence of KvCache operations — valid and invalid
// (unknown ids, foreign blocks, tokens that disagree, sizes past every limit) — and after every
// operation the cache's full invariant check must pass. A failure or a crash is a bug.
#include <fuzzer/FuzzedDataProvider.h>

#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include "server/core/clock.h"
#include "server/core/kv_cache.h"

namespace {

// Mostly a small value in [lo, hi]; sometimes one at the edge of int64 (sums of wire values must
// be checked before they are added).
int64_t Extreme(FuzzedDataProvider& in, int64_t lo, int64_t hi) {
  switch (in.ConsumeIntegralInRange<int>(0, 7)) {
    case 0: return std::numeric_limits<int64_t>::max();
    case 1: return std::numeric_limits<int64_t>::max() - in.ConsumeIntegralInRange<int64_t>(0, 300);
    case 2: return std::numeric_limits<int64_t>::min();
    default: return in.ConsumeIntegralInRange<int64_t>(lo, hi);
  }
}

using namespace kvd;

CacheOptions Options(int policy) {
  CacheOptions o;
  o.eviction_policy = policy == 1 ? EvictionPolicy::kSlru : policy == 2 ? EvictionPolicy::kHorizon : EvictionPolicy::kLru;
  o.horizon_sample_every = 1;  // the 24-block pool's shadows see every key
  PoolGeometry g;
  g.name = "m";
  g.block_tokens = 4;
  g.num_layers = 2;
  g.bytes_per_token_per_layer = 8;
  g.capacity_blocks = 24;
  g.max_model_len = 64;
  o.pools.push_back(g);
  o.checkpoint_budget_bytes = 8 * 64;
  o.session_max_protected_blocks = 3;
  o.max_requests_per_worker = 5;
  return o;
}

std::vector<Token> Tokens(FuzzedDataProvider& in, size_t max) {
  // A small alphabet, so that prompts share prefixes and the index is exercised.
  const size_t n = in.ConsumeIntegralInRange<size_t>(0, max);
  std::vector<Token> t(n);
  for (Token& x : t) x = in.ConsumeIntegralInRange<Token>(0, 3);
  return t;
}

void Check(const KvCache& cache, int op) {
  absl::Status s = cache.CheckInvariantsForTesting();
  if (!s.ok()) {
    std::fprintf(stderr, "invariant broken after op %d: %s\n", op, s.ToString().c_str());
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  FakeClock clock;
  auto cache = KvCache::Create(Options(in.ConsumeIntegralInRange<int>(0, 2)), &clock);
  if (!cache.ok()) std::abort();
  KvCache& c = **cache;
  const auto id = [&] { return RequestId("r" + std::to_string(in.ConsumeIntegralInRange<int>(0, 7))); };
  const auto worker = [&] { return WorkerId("w" + std::to_string(in.ConsumeIntegralInRange<int>(0, 2))); };
  while (in.remaining_bytes() > 0) {
    const int op = in.ConsumeIntegralInRange<int>(0, 13);
    switch (op) {
      case 0: {
        RequestSpec s;
        s.id = id();
        s.ns.pool = in.ConsumeBool() ? "m" : "x";
        s.ns.cache_salt = in.ConsumeBool() ? "" : "t";
        s.prompt = Tokens(in, 40);
        s.max_new_tokens = Extreme(in, -1, 40);
        if (in.ConsumeBool()) s.session = SessionId("s" + std::to_string(in.ConsumeIntegralInRange<int>(0, 2)));
        if (in.ConsumeBool()) s.resume_from = id();
        s.owner = worker();
        (void)c.Admit(s);
        break;
      }
      case 1: (void)c.Acquire(id()); break;
      case 2: (void)c.Extend(id(), Extreme(in, -2, 20)); break;
      case 3:
      case 4: {
        const RequestId r = id();
        std::vector<Token> tokens = Tokens(in, 48);
        std::vector<BlockIndex> blocks;
        if (auto h = c.GetHandle(r); h.ok() && in.ConsumeBool()) {
          // Mostly the request's own table prefix, with its known tokens: the publish path.
          blocks.assign(h->blocks.begin(), h->blocks.begin() + in.ConsumeIntegralInRange<size_t>(0, h->blocks.size()));
        } else {
          for (size_t n = in.ConsumeIntegralInRange<size_t>(0, 6); n > 0; --n) {
            blocks.push_back(in.ConsumeIntegralInRange<BlockIndex>(0, 30));
          }
        }
        if (op == 3) (void)c.Publish(r, tokens, blocks);
        else (void)c.Keeps(r, tokens, blocks);
        break;
      }
      case 5: (void)c.Checkpoint(id(), Tokens(in, 48), std::string(in.ConsumeIntegralInRange<size_t>(0, 64), 'e')); break;
      case 6: (void)c.Release(id(), in.ConsumeBool()); break;
      case 7: (void)c.ReleaseWorker(worker()); break;
      case 8: clock.Advance(absl::Seconds(in.ConsumeIntegralInRange<int>(0, 4000))); (void)c.Gc(absl::Seconds(in.ConsumeIntegralInRange<int>(0, 100))); break;
      case 9: (void)c.Boundary(); break;
      case 10: (void)c.ClearCache(); break;
      case 11: (void)c.PeekPrefixLen(Namespace{.pool = "m"}, Tokens(in, 40)); break;
      case 12: (void)c.CloseSession(SessionId("s" + std::to_string(in.ConsumeIntegralInRange<int>(0, 2)))); break;
      case 13: (void)c.Fits(RequestSpec{.id = id(), .ns = {.pool = "m"}, .prompt = Tokens(in, 40), .owner = worker()}); break;
    }
    Check(c, op);
  }
  return 0;
}
