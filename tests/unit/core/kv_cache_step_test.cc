// KvCache::Step and block credit (kv_cache_step.cc): ops apply in order, each all or nothing with
// its own status; credit is owned by its worker, charged like a reservation, adopted exactly once,
// given back when the worker goes and fenced at a handoff. A randomized workload driven through
// steps and through the per-request calls ends in the same cache, with exact accounting after
// every step.
#include <catch2/catch.hpp>

#include <algorithm>
#include <random>
#include <set>

#include "server/core/kv_cache.h"
#include "tests/unit/core/test_util.h"

namespace kvd {
namespace {

using namespace kvd::testing;

const WorkerId kW("w0");

void RequireOk(const absl::Status& s) {
  INFO(s.ToString());
  REQUIRE(s.ok());
}

StepOp Op(StepOpKind kind, const std::string& id) {
  StepOp op;
  op.kind = kind;
  op.id = RequestId(id);
  return op;
}

std::vector<BlockIndex> Credit(KvCache& cache, int64_t want, PoolId pool = 0, const WorkerId& w = kW,
                               std::vector<BlockIndex> returned = {}, int64_t* wanted = nullptr) {
  std::vector<CreditHeld> held;
  cache.Step(w, w, {}, {CreditWant{pool, want, std::move(returned)}}, &held);
  if (wanted != nullptr) *wanted = held.empty() ? 0 : held[0].wanted;
  return held.empty() ? std::vector<BlockIndex>{} : held[0].blocks;
}

TEST_CASE("Credit is granted, adopted by a grow once, charged exactly and given back", "[core][step]") {
  FakeClock clock;
  CacheOptions o = SmallOptions(64);  // credit is capped at an eighth of the pool: 8
  o.step_credit_blocks = 100;
  auto cache = MakeCache(o, &clock);
  RequestSpec a = Spec("a", Seq(0, 8), /*max_new=*/0);  // 2 blocks reserved, grows past it
  Start(*cache, a);
  const int64_t before = cache->Report().reserved_bytes;

  std::vector<BlockIndex> credit = Credit(*cache, 1000);  // capped at an eighth of the pool
  REQUIRE(credit.size() == 8);
  RequireInvariants(*cache);
  REQUIRE(cache->Report().reserved_bytes == before + 8 * 64);

  // Growing by 5 positions takes 2 blocks: one named from credit, one allocated fresh.
  StepOp grow = Op(StepOpKind::kGrow, "a");
  grow.tokens = 5;
  grow.credit_blocks = {credit.back()};
  std::vector<CreditHeld> held;
  auto results = cache->Step(kW, kW, {grow}, {}, &held);
  REQUIRE(results[0].status.ok());
  REQUIRE(results[0].blocks.size() == 2);
  REQUIRE(results[0].blocks[0] == credit.back());
  REQUIRE(held[0].blocks.size() == 7);
  RequireInvariants(*cache);

  SECTION("a credit block used twice, or more blocks than the growth takes, is refused and changes nothing") {
    const CacheReport r0 = cache->Report();
    StepOp again = Op(StepOpKind::kGrow, "a");
    again.tokens = 4;
    again.credit_blocks = {credit.back()};  // adopted above
    StepOp too_many = Op(StepOpKind::kGrow, "a");
    too_many.tokens = 1;
    too_many.credit_blocks = {credit[0], credit[1]};
    StepOp twice = Op(StepOpKind::kGrow, "a");
    twice.tokens = 8;
    twice.credit_blocks = {credit[0], credit[0]};
    auto r = cache->Step(kW, kW, {again, too_many, twice}, {}, nullptr);
    for (const auto& x : r) REQUIRE(absl::IsInvalidArgument(x.status));
    REQUIRE(cache->Report().reserved_bytes == r0.reserved_bytes);
    RequireInvariants(*cache);
  }
  SECTION("another worker cannot use it, nor act on the request") {
    StepOp theirs = Op(StepOpKind::kGrow, "a");
    theirs.tokens = 4;
    auto r = cache->Step(WorkerId("w1"), WorkerId("w1"), {theirs}, {}, nullptr);
    REQUIRE(absl::IsPermissionDenied(r[0].status));
  }
  SECTION("the worker going gives it back") {
    REQUIRE(cache->ReleaseWorker(kW) == 1);
    RequireInvariants(*cache);
    REQUIRE(cache->Report().reserved_bytes == 0);
    REQUIRE(cache->Report().pools[0].free_blocks == 64);
  }
  SECTION("asking for less asks back and takes nothing; blocks named as returned go back") {
    int64_t wanted = 0;
    std::vector<BlockIndex> now = Credit(*cache, 2, 0, kW, {}, &wanted);
    REQUIRE(now.size() == 7);
    REQUIRE(wanted == 5);
    RequireOk(cache->CheckCreditForTesting(kW, 0, now));
    RequireInvariants(*cache);
    const int64_t reserved = cache->Report().reserved_bytes;
    // Five named, one of them twice and one never held: those two are skipped.
    std::vector<BlockIndex> back(now.begin(), now.begin() + 5);
    back.push_back(now[0]);
    back.push_back(credit.back());  // adopted by the grow above
    now = Credit(*cache, 2, 0, kW, back, &wanted);
    REQUIRE(now.size() == 2);
    REQUIRE(wanted == 0);
    REQUIRE(cache->Report().reserved_bytes == reserved - 5 * 64);
    RequireInvariants(*cache);
    REQUIRE(Credit(*cache, 0, 0, kW, now, &wanted).empty());
    RequireInvariants(*cache);
  }
  SECTION("a handoff fences it for the worker's attachment") {
    REQUIRE(cache->EndAllFenced(absl::Seconds(10), {{kW, 77}}) == 1);
    RequireInvariants(*cache);
    // Nothing the worker could still be writing is handed out: 4 table blocks + 7 credit fenced.
    REQUIRE(cache->Report().pools[0].owned_blocks == 4 + 7);
    REQUIRE(cache->LiftFences(kW, 77) == 4 + 7);
    RequireInvariants(*cache);
    REQUIRE(cache->Report().reserved_bytes == 0);
  }
}

// Issue 40, item 1: under pressure kvd used to give the first blocks of a worker's credit back to
// the free list while the worker could be placing them (the C++ client places credit with no round
// trip); the next allocation (LIFO) handed them to another worker. Now it asks and waits.
TEST_CASE("Credit is never taken back under a worker's feet, whatever the pressure", "[core][step]") {
  FakeClock clock;
  CacheOptions o = SmallOptions(64);
  o.step_credit_blocks = 100;
  auto cache = MakeCache(o, &clock);
  const WorkerId other("w1");
  std::vector<BlockIndex> credit = Credit(*cache, 8);
  REQUIRE(credit.size() == 8);
  // The worker places its last credit block into a request of its own, unreported yet.
  const std::vector<BlockIndex> believed = credit;
  const bool critical = GENERATE(false, true);
  // Another worker fills the budget: 8 + 52 of 64 blocks reserved is high pressure, 8 + 53 critical.
  RequestSpec big = Spec("big", Seq(1000, critical ? 212 : 208), 0);
  big.owner = other;
  Start(*cache, big);
  REQUIRE(cache->pressure_level() == (critical ? PressureLevel::kCritical : PressureLevel::kHigh));

  int64_t wanted = 0;
  std::vector<BlockIndex> held = Credit(*cache, 8, 0, kW, {}, &wanted);
  REQUIRE(held.size() == 8);
  REQUIRE(wanted == (critical ? 8 : 6));
  RequireOk(cache->CheckCreditForTesting(kW, 0, believed));
  RequireInvariants(*cache);
  // Whatever the other worker takes now, it is none of the blocks this worker may be writing.
  const int64_t rest = critical ? 3 : 4;
  RequestSpec small = Spec("small", Seq(5000, static_cast<int>(4 * rest)), 0);
  small.owner = other;
  const AcquireResult got = Start(*cache, small);
  for (BlockIndex b : got.blocks) {
    INFO("block " << b);
    REQUIRE(std::find(believed.begin(), believed.end(), b) == believed.end());
  }
  RequireOk(cache->CheckCreditForTesting(kW, 0, believed));
  RequireInvariants(*cache);
  // The worker answers: it gives back what it has not placed, by name; those go back at once.
  std::vector<BlockIndex> back(believed.begin(), believed.end() - 1);
  held = Credit(*cache, 8, 0, kW, back, &wanted);
  REQUIRE(held == std::vector<BlockIndex>{believed.back()});
  REQUIRE(wanted == 1);  // still critical: the small request took the rest
  RequireInvariants(*cache);
}

// Issue 40, item 5: while starts wait, the service asks a worker's credit back (wants 0); a worker
// that detaches after a grant loses what it was granted.
TEST_CASE("Credit asked back is returned only by name; a worker that goes drops it", "[core][step]") {
  FakeClock clock;
  CacheOptions o = SmallOptions(64);
  o.step_credit_blocks = 100;
  auto cache = MakeCache(o, &clock);
  std::vector<BlockIndex> credit = Credit(*cache, 8);
  int64_t wanted = 0;
  REQUIRE(Credit(*cache, 0, 0, kW, {}, &wanted).size() == 8);
  REQUIRE(wanted == 8);
  REQUIRE(cache->CreditBlocks(kW, 0) == 8);
  REQUIRE(cache->DropCredit(kW) == 8);
  REQUIRE(cache->CreditBlocks(kW, 0) == 0);
  REQUIRE(cache->Report().reserved_bytes == 0);
  REQUIRE(!cache->CheckCreditForTesting(kW, 0, credit).ok());
  RequireInvariants(*cache);
}

TEST_CASE("A step's ops apply in order, each with its own status", "[core][step]") {
  FakeClock clock;
  auto cache = MakeCache(SmallOptions(32), &clock);
  RequestSpec a = Spec("a", Seq(0, 8), 8);
  RequestSpec b = Spec("b", Seq(100, 8), 8);
  Start(*cache, a);
  Start(*cache, b);
  StepOp grow = Op(StepOpKind::kGrow, "a");
  grow.tokens = 4;
  StepOp publish = Op(StepOpKind::kPublish, "a");
  publish.num_blocks = 3;
  publish.token_ids = Seq(0, 12);
  StepOp unknown = Op(StepOpKind::kEnd, "nobody");
  StepOp bad_publish = Op(StepOpKind::kPublish, "b");
  bad_publish.num_blocks = 2;
  bad_publish.token_ids = Seq(999, 8);  // not b's prompt
  StepOp preempt = Op(StepOpKind::kPreempt, "b");
  preempt.token_ids = Seq(100, 8);
  preempt.engine_state = "s";
  StepOp end = Op(StepOpKind::kEnd, "a");
  end.num_blocks = 3;
  end.completed = true;
  auto r = cache->Step(kW, kW, {grow, publish, unknown, bad_publish, preempt, end}, {}, nullptr);
  REQUIRE(r[0].status.ok());
  REQUIRE(r[1].status.ok());
  REQUIRE(r[1].publish.kept == 3);
  REQUIRE(absl::IsNotFound(r[2].status));
  REQUIRE(absl::IsInvalidArgument(r[3].status));
  REQUIRE(r[4].status.ok());
  REQUIRE(r[5].status.ok());
  REQUIRE(r[5].publish.outcomes.size() == 3);
  REQUIRE(cache->Report().live_requests == 0);
  REQUIRE(cache->PeekPrefixLen(a.ns, Seq(0, 13)).value() == 12);
  // The preempted request resumes from its checkpoint.
  RequestSpec resumed = b;
  resumed.resume_from = b.id;
  REQUIRE(Start(*cache, resumed).resumed);
  RequireInvariants(*cache);
}

// One randomized workload applied to two caches, through steps (with credit) and through the
// per-request calls: after every step the same blocks are cached and the budget agrees except
// for the credit the stepping worker holds.
TEST_CASE("Steps and per-request calls reach the same cache", "[core][step]") {
  const uint32_t seed = GENERATE(1u, 2u, 3u, 4u);
  std::mt19937 rng(seed);
  FakeClock clock;
  CacheOptions o = SmallOptions(4096);  // no eviction: the credit would make the two caches evict differently
  o.step_credit_blocks = 16;
  auto stepped = MakeCache(o, &clock);
  auto direct = MakeCache(o, &clock);
  struct Live {
    RequestSpec spec;
    std::vector<Token> tokens;
    int64_t table = 0;  // blocks in the stepped cache's table
    size_t known = 0;   // tokens kvd knows: the prompt, then what a publish told it
  };
  std::vector<Live> live;
  std::vector<BlockIndex> credit;
  int next = 0;
  for (int step = 0; step < 300; ++step) {
    std::vector<StepOp> ops;
    // New requests: a few shared prefixes so publishes hit.
    for (int k = 0; k < 2 && live.size() < 12; ++k) {
      const Token base = static_cast<Token>(1000 * (rng() % 4));
      std::vector<Token> prompt = Concat(Seq(base, 8), Seq(static_cast<Token>(50000 + next * 10), static_cast<int>(rng() % 7)));
      RequestSpec s = Spec(absl::StrCat("r", next++), prompt, 64);
      const AcquireResult x = Start(*stepped, s);
      const AcquireResult y = Start(*direct, s);
      REQUIRE(x.cached_tokens == y.cached_tokens);
      live.push_back({s, prompt, static_cast<int64_t>(x.blocks.size()), prompt.size()});
    }
    for (size_t i = 0; i < live.size();) {
      Live& l = live[i];
      const int action = static_cast<int>(rng() % 10);
      if (action < 7) {  // decode one token
        const int64_t n = static_cast<int64_t>(l.tokens.size());
        l.tokens.push_back(static_cast<Token>(rng() % 5000));
        StepOp g = Op(StepOpKind::kGrow, l.spec.id.value());
        g.tokens = 1;
        if ((n + 1 + 3) / 4 > l.table && !credit.empty() && rng() % 4 != 0) {
          g.credit_blocks = {credit.back()};
          credit.pop_back();
        }
        ops.push_back(g);
        REQUIRE(direct->Extend(l.spec.id, 1).ok());
        l.table = (n + 1 + 3) / 4 > l.table ? l.table + 1 : l.table;
        ++i;
      } else if (action < 8) {  // publish what is full
        StepOp p = Op(StepOpKind::kPublish, l.spec.id.value());
        p.num_blocks = static_cast<int64_t>(l.tokens.size()) / 4;
        p.token_ids = l.tokens;
        ops.push_back(p);
        auto d = direct->GetHandle(l.spec.id);
        REQUIRE(d.ok());
        std::vector<BlockIndex> prefix(d->blocks.begin(), d->blocks.begin() + p.num_blocks);
        REQUIRE(direct->Publish(l.spec.id, l.tokens, prefix).ok());
        l.known = l.tokens.size();
        ++i;
      } else {  // end, publishing every full block
        StepOp e = Op(StepOpKind::kEnd, l.spec.id.value());
        e.num_blocks = static_cast<int64_t>(l.tokens.size()) / 4;
        e.token_ids.assign(l.tokens.begin() + static_cast<int64_t>(l.known), l.tokens.end());
        e.completed = true;
        ops.push_back(e);
        REQUIRE(direct->End(l.spec.id, e.num_blocks, e.token_ids, true).ok());
        live.erase(live.begin() + static_cast<int64_t>(i));
      }
    }
    std::vector<CreditHeld> held;
    auto results = stepped->Step(kW, kW, ops, {CreditWant{0, 16}}, &held);
    for (const StepOpResult& r : results) {
      INFO(r.status.ToString());
      REQUIRE(r.status.ok());
    }
    credit = held.empty() ? std::vector<BlockIndex>{} : held[0].blocks;
    RequireInvariants(*stepped);
    RequireInvariants(*direct);
    const CacheReport s = stepped->Report(), d = direct->Report();
    REQUIRE(s.pools[0].cached_blocks == d.pools[0].cached_blocks);
    REQUIRE(s.published_blocks == d.published_blocks);
    REQUIRE(s.reserved_bytes == d.reserved_bytes + static_cast<int64_t>(credit.size()) * 64);
    REQUIRE(s.live_requests == d.live_requests);
  }
}

}  // namespace
}  // namespace kvd
