// The horizon policy: the queue's horizon order, the shadow-cache duel that picks an order, and
// the policy inside KvCache (docs/architecture.md, "Eviction").
#include <catch2/catch.hpp>

#include <deque>

#include "server/core/eviction_queue.h"
#include "server/core/policy_duel.h"
#include "tests/unit/core/test_util.h"

namespace kvd {
namespace {

using namespace kvd::testing;

// Queue entries made by hand: last_use and use_clock advance together, as KvCache stamps them.
struct Blocks {
  std::deque<CachedBlock> nodes;
  CachedBlock* Make(uint64_t tick, uint32_t clock, bool reused) {
    CachedBlock& b = nodes.emplace_back();
    b.serial = nodes.size();
    b.last_use = tick;
    b.use_clock = clock;
    b.reused = reused;
    return &b;
  }
};

TEST_CASE("The horizon order evicts overdue blocks first, then the newest probation block", "[core][policy]") {
  EvictionQueue q;
  q.set_order(EvictionQueue::Order::kHorizon);
  q.set_horizons(/*probation_blocks=*/10, /*main_blocks=*/20);
  Blocks b;
  CachedBlock* p_old = b.Make(1, 0, false);
  CachedBlock* p_new = b.Make(2, 5, false);
  CachedBlock* m_old = b.Make(3, 0, true);
  CachedBlock* m_new = b.Make(4, 8, true);
  for (CachedBlock* x : {p_old, p_new, m_old, m_new}) q.Push(x);
  for (int i = 0; i < 8; ++i) q.TickClock();
  // Nothing overdue: the newest probation block goes (the older one is nearer its reuse).
  REQUIRE(q.Peek() == p_new);
  for (int i = 0; i < 3; ++i) q.TickClock();  // clock 11: p_old is 11 stored blocks old, past 10
  REQUIRE(q.Peek() == p_old);
  q.Remove(p_old);
  REQUIRE(q.Peek() == p_new);
  for (int i = 0; i < 10; ++i) q.TickClock();  // clock 21: m_old past its horizon of 20
  REQUIRE(q.Peek() == p_new);                  // p_new (16 old) overdue, probation first
  q.Remove(p_new);
  REQUIRE(q.Peek() == m_old);
  q.Remove(m_old);
  REQUIRE(q.Peek() == m_new);  // the newest main block when probation is empty
  // The recency order on the same queue: oldest first, as SLRU.
  q.Push(p_new);
  q.set_order(EvictionQueue::Order::kRecency);
  REQUIRE(q.Peek() == p_new);
  REQUIRE(q.Newest(EvictionQueue::kMain) == m_new);
}

TEST_CASE("The horizon order leaves protected blocks for last", "[core][policy]") {
  EvictionQueue q;
  q.set_order(EvictionQueue::Order::kHorizon);
  q.set_horizons(1, 1);
  Blocks b;
  CachedBlock* prot = b.Make(1, 0, false);
  prot->protect_count = 1;
  CachedBlock* p = b.Make(2, 0, false);
  q.Push(prot);
  q.Push(p);
  REQUIRE(q.Peek() == p);
  REQUIRE(q.PeekUnprotected() == p);
  q.Remove(p);
  REQUIRE(q.Peek() == prot);
  REQUIRE(q.PeekUnprotected() == nullptr);
}

// Keys as the engine makes them: well-mixed 128-bit hashes.
BlockKey Key(uint64_t i) { return ChainBlockKey(BlockKey{}, BlockKey{1, 2}, std::vector<Token>{static_cast<Token>(i)}); }

// A duel that sees every key, over 100 blocks, with horizons beyond the tests' reach.
PolicyDuel::Options FullDuel() {
  PolicyDuel::Options o;
  o.capacity_blocks = 100;
  o.probation_horizon = 1000;
  o.main_horizon = 1000;
  o.sample_every = 1;
  return o;
}

TEST_CASE("The duel prefers the horizon order on a loop larger than the cache", "[core][policy]") {
  // A loop over 3x the cache's keys: recency evicts each key before its reuse and hits only
  // what SLRU's main segment happens to hold; the horizon order keeps the oldest keys and hits on
  // them every lap.
  PolicyDuel duel(FullDuel());
  uint64_t clock = 0;
  for (int lap = 0; lap < 6; ++lap) {
    for (uint64_t k = 0; k < 300; ++k) duel.Access(Key(k), /*reused=*/lap > 0, ++clock);
  }
  REQUIRE(duel.score(EvictionQueue::Order::kHorizon) > 2 * duel.score(EvictionQueue::Order::kRecency));
  REQUIRE(duel.preferred() == EvictionQueue::Order::kHorizon);
}

TEST_CASE("The duel prefers the recency order when reuse comes soon", "[core][policy]") {
  // Each key is used twice, 30 stores apart, in a cache of 100: recency keeps every key until its
  // reuse; the horizon order evicts the newest keys, which are the ones about to be reused.
  PolicyDuel duel(FullDuel());
  uint64_t clock = 0;
  for (uint64_t k = 0; k < 2000; ++k) {
    duel.Access(Key(k), false, ++clock);
    if (k >= 30) duel.Access(Key(k - 30), false, clock);
  }
  REQUIRE(duel.score(EvictionQueue::Order::kRecency) > 1.1 * duel.score(EvictionQueue::Order::kHorizon));
  REQUIRE(duel.preferred() == EvictionQueue::Order::kRecency);
}

TEST_CASE("The duel samples the same keys for both shadows and ignores the rest", "[core][policy]") {
  PolicyDuel::Options o;
  o.capacity_blocks = 64;
  o.sample_every = 16;
  PolicyDuel duel(o);
  int sampled = 0;
  for (uint64_t k = 0; k < 4096; ++k) sampled += duel.Sampled(Key(k)) ? 1 : 0;
  REQUIRE(sampled > 4096 / 16 / 2);
  REQUIRE(sampled < 4096 / 16 * 2);
  for (uint64_t k = 0; k < 4096; ++k) {
    if (!duel.Sampled(Key(k))) duel.Access(Key(k), true, k);
  }
  REQUIRE(duel.score(EvictionQueue::Order::kRecency) == 0);
  REQUIRE(duel.score(EvictionQueue::Order::kHorizon) == 0);
}

CacheOptions HorizonOptions(int64_t capacity, double probation_horizon) {
  CacheOptions o = SmallOptions(capacity);
  o.eviction_policy = EvictionPolicy::kHorizon;
  o.horizon_sample_every = 0;  // no shadows: the horizon order always
  o.horizon_probation = probation_horizon;
  o.horizon_main = 2 * probation_horizon;
  return o;
}

TEST_CASE("Under the horizon order an older prefix outlives a newer one until it is overdue", "[core][cache][policy]") {
  for (bool overdue : {false, true}) {
    INFO("overdue " << overdue);
    FakeClock clock;
    // Capacity 8 blocks; horizon 4 pool capacities (32 stored blocks) or a quarter (2).
    auto cache = MakeCache(HorizonOptions(8, overdue ? 0.25 : 4), &clock);
    const Namespace ns{.pool = "m"};
    RequestSpec a = Spec("a", Seq(0, 13));  // blocks A1..A3
    PublishAll(*cache, a, a.prompt, Start(*cache, a));
    REQUIRE(cache->Release(a.id, true).ok());
    clock.Advance(absl::Seconds(1));
    RequestSpec b = Spec("b", Seq(100, 13));  // B1..B3, newer
    PublishAll(*cache, b, b.prompt, Start(*cache, b));
    REQUIRE(cache->Release(b.id, true).ok());
    RequestSpec c = Spec("c", Seq(500, 17));  // 5 blocks over 2 free: three evictions
    Start(*cache, c);
    if (!overdue) {
      // LRU and SLRU would evict A (older); the horizon order evicts the newest prefix, B, tail first.
      REQUIRE(*cache->PeekPrefixLen(ns, a.prompt) == 12);
      REQUIRE(*cache->PeekPrefixLen(ns, b.prompt) == 0);
    } else {
      // A's blocks (6 stored blocks old, past 2) are overdue: they go first, oldest first.
      REQUIRE(*cache->PeekPrefixLen(ns, a.prompt) == 0);
      REQUIRE(*cache->PeekPrefixLen(ns, b.prompt) == 12);
    }
    RequireInvariants(*cache);
  }
}

TEST_CASE("The horizon policy's options are validated", "[core][cache][policy]") {
  CacheOptions o = HorizonOptions(8, 2);
  REQUIRE(o.Validate().ok());
  o.horizon_probation = 0;
  REQUIRE(o.Validate().code() == absl::StatusCode::kInvalidArgument);
  REQUIRE_THAT(std::string(o.Validate().message()), Catch::Contains("horizon_probation"));
  o = HorizonOptions(8, 2);
  o.horizon_sample_every = -1;
  REQUIRE_THAT(std::string(o.Validate().message()), Catch::Contains("horizon_sample_every"));
  o = HorizonOptions(8, 2);
  o.horizon_margin = 0.5;
  REQUIRE_THAT(std::string(o.Validate().message()), Catch::Contains("horizon_margin"));
  EvictionPolicy p = EvictionPolicy::kLru;
  REQUIRE(ParseEvictionPolicy("horizon", &p));
  REQUIRE(p == EvictionPolicy::kHorizon);
  REQUIRE_FALSE(ParseEvictionPolicy("lfu", &p));
  REQUIRE(p == EvictionPolicy::kHorizon);
  REQUIRE(EvictionPolicyName(EvictionPolicy::kSlru) == "slru");
}

}  // namespace
}  // namespace kvd
