// Helpers shared by the core unit tests: a small pool, request specs and token sequences.
#pragma once

#include <algorithm>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "server/core/clock.h"
#include "server/core/kv_cache.h"

namespace kvd::testing {

// One pool "m": 4-token blocks, 2 layers, 8 bytes per token per layer => 64-byte blocks. Plain
// LRU eviction, so that tests state eviction order simply; SLRU has tests of its own.
inline CacheOptions SmallOptions(int64_t capacity_blocks = 32) {
  CacheOptions o;
  o.eviction_policy = EvictionPolicy::kLru;
  PoolGeometry g;
  g.name = "m";
  g.block_tokens = 4;
  g.num_layers = 2;
  g.bytes_per_token_per_layer = 8;
  g.capacity_blocks = capacity_blocks;
  g.max_model_len = 256;
  o.pools.push_back(g);
  return o;
}

inline std::unique_ptr<KvCache> MakeCache(const CacheOptions& o, const Clock* clock) {
  auto cache = KvCache::Create(o, clock);
  REQUIRE(cache.ok());
  return std::move(*cache);
}

// Tokens [start, start + n).
inline std::vector<Token> Seq(Token start, int n) {
  std::vector<Token> t(n);
  std::iota(t.begin(), t.end(), start);
  return t;
}

inline std::vector<Token> Concat(std::vector<Token> a, const std::vector<Token>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

inline RequestSpec Spec(const std::string& id, std::vector<Token> prompt, int64_t max_new = 0,
                        std::string pool = "m") {
  RequestSpec s;
  s.id = RequestId(id);
  s.ns.pool = std::move(pool);
  s.prompt = std::move(prompt);
  s.max_new_tokens = max_new;
  s.owner = WorkerId("w0");
  return s;
}

// Admits and acquires; REQUIREs both succeed.
inline AcquireResult Start(KvCache& cache, const RequestSpec& spec) {
  auto admitted = cache.Admit(spec);
  REQUIRE(admitted.ok());
  REQUIRE(admitted->decision == AdmitDecision::kAdmitted);
  auto acquired = cache.Acquire(spec.id);
  REQUIRE(acquired.ok());
  return *acquired;
}

// Publishes every full block of `tokens` held by the request.
inline PublishResult PublishAll(KvCache& cache, const RequestSpec& spec,
                                const std::vector<Token>& tokens, const AcquireResult& acq,
                                int block_tokens = 4) {
  size_t n = std::min(acq.blocks.size(), tokens.size() / block_tokens);
  std::vector<BlockIndex> blocks(acq.blocks.begin(), acq.blocks.begin() + n);
  auto r = cache.Publish(spec.id, tokens, blocks);
  REQUIRE(r.ok());
  return *r;
}

inline void RequireInvariants(const KvCache& cache) {
  absl::Status s = cache.CheckInvariantsForTesting();
  INFO(s.ToString());
  REQUIRE(s.ok());
}

// One grow step of request `id` by worker w0: `tokens` more positions (0: none) and, on a hybrid
// pool, the engine's computed tokens.
inline StepOpResult Grow(KvCache& cache, const std::string& id, int64_t tokens, int64_t computed,
                         std::vector<BlockIndex> credit = {}) {
  StepOp op;
  op.kind = StepOpKind::kGrow;
  op.id = RequestId(id);
  op.tokens = tokens;
  op.computed_tokens = computed;
  op.credit_blocks = std::move(credit);
  std::vector<StepOp> ops;
  ops.push_back(std::move(op));
  return cache.Step(WorkerId("w0"), WorkerId("w0"), std::move(ops), {}, nullptr)[0];
}

// Options and a cache holding the one pool `g` (SmallOptions otherwise); budget 0: unlimited.
inline CacheOptions PoolOptions(const PoolGeometry& g, int64_t budget = 0) {
  CacheOptions o = SmallOptions();
  o.pools = {g};
  o.budget_bytes = budget;
  return o;
}
inline std::unique_ptr<KvCache> PoolCache(const PoolGeometry& g, const Clock* clock, int64_t budget = 0) {
  return MakeCache(PoolOptions(g, budget), clock);
}

// A group's table as the engine keeps it, by the clients' rule: drop below the new first
// position, append.
struct GroupView {
  int64_t first = 0;
  std::vector<BlockIndex> blocks;
  void Apply(const GroupTable& t) {
    const int64_t drop = std::min<int64_t>(std::max<int64_t>(0, t.first_block_position - first),
                                           static_cast<int64_t>(blocks.size()));
    blocks.erase(blocks.begin(), blocks.begin() + drop);
    first = t.first_block_position;
    blocks.insert(blocks.end(), t.blocks.begin(), t.blocks.end());
  }
  BlockIndex at(int64_t pos) const { return blocks.at(static_cast<size_t>(pos - first)); }
};

}  // namespace kvd::testing
