// A hybrid pool's units and the lower tiers (docs/hybrid.md §2.9, step 6): a spine node leaves G1
// with its window blocks and checkpoint as one demotion (HeldBlock::parts), an allocation takes the
// units its own evictions hold for the copy, and units installed back (BeginInstall /
// FinishInstall) serve a hit only where §2.6 and §2.7 allow: a checkpoint whose window did not come
// back is dropped with the unit it would have made servable. The checker runs after every step.
#include <catch2/catch.hpp>

#include "absl/synchronization/mutex.h"
#include "proto/vocab/pool_geometry.h"
#include "tests/unit/core/test_util.h"

namespace kvd {
namespace {

using testing::Concat;
using testing::RequireInvariants;
using testing::Seq;
using testing::Spec;

constexpr int kSwa = 1, kRec = 2;

// full (layers 0, 3), a 6-token window (layer 1), state every 2 blocks (layer 2); 4-token blocks.
PoolGeometry Geometry(int64_t full_cap, int64_t swa_cap, int64_t slots) {
  PoolGeometry g;
  g.name = "h";
  g.block_tokens = 4;
  g.num_layers = 4;
  g.bytes_per_token_per_layer = 8;
  g.max_model_len = 64;
  g.step_tokens = 8;
  g.groups.push_back(KvGroup{.name = "full", .kind = KvGroupKind::kFull, .layers = {0, 3}, .capacity = full_cap});
  g.groups.push_back(
      KvGroup{.name = "swa", .kind = KvGroupKind::kSlidingWindow, .layers = {1}, .window = 6, .capacity = swa_cap});
  g.groups.push_back(KvGroup{.name = "rec", .kind = KvGroupKind::kState, .layers = {2}, .bytes_per_state = 64,
                             .checkpoint_every_blocks = 2, .checkpoint_at_end = false, .capacity = slots});
  const absl::Status resolved = g.ResolveGroups();
  INFO(resolved.ToString());
  REQUIRE(resolved.ok());
  return g;
}

// Records every demotion: its tokens and its parts' groups (tail flags too).
class UnitSink final : public EvictionSink {
 public:
  struct Seen {
    std::vector<Token> tokens;
    std::vector<std::pair<int, bool>> parts;
  };
  void OnEvict(const CachedBlockView& block, EvictReason) override {
    Seen s{{block.tokens.begin(), block.tokens.end()}, {}};
    for (const UnitComponent& c : block.parts) s.parts.emplace_back(c.group, c.tail);
    absl::MutexLock lock(&mu_);
    seen_.push_back(std::move(s));
  }
  std::vector<Seen> seen() const {
    absl::MutexLock lock(&mu_);
    return seen_;
  }

 private:
  mutable absl::Mutex mu_;
  std::vector<Seen> seen_;
};

// Publishes the 2 blocks of `first`.. (8 tokens) with their window blocks and the state at 8.
void PublishUnit(KvCache& cache, const std::string& id, Token first) {
  const RequestSpec a = Spec(id, Seq(first, 9), 0, "h");
  const AcquireResult ra = testing::Start(cache, a);
  const BlockIndex slot = ra.group_tables[kRec].blocks[1];
  const absl::StatusOr<PublishResult> p = cache.Publish(
      a.id, absl::MakeConstSpan(a.prompt).first(8), {ra.blocks[0], ra.blocks[1]},
      std::vector<StateCheckpoint>{{kRec, 8, slot}});
  REQUIRE(p.ok());
  REQUIRE(p->checkpoint_outcomes == std::vector<CheckpointOutcome>{CheckpointOutcome::kKept});
  REQUIRE(cache.Release(a.id, true).ok());
  RequireInvariants(cache);
}

TEST_CASE("a spine unit goes down with its window blocks and checkpoint, and comes back whole", "[spine][tiers]") {
  FakeClock clock;
  auto cache = testing::PoolCache(Geometry(16, 16, 6), &clock);
  UnitSink sink;
  cache->SetEvictionSink(&sink);
  PublishUnit(*cache, "a", 1);
  // A 63-token request needs all 16 full blocks: the unit leaves G1, depth 2 with its window
  // block and checkpoint, then depth 1 (U2) with its window block.
  const RequestSpec big = Spec("big", Seq(1000, 63), 0, "h");
  (void)testing::Start(*cache, big);
  RequireInvariants(*cache);
  const std::vector<UnitSink::Seen> seen = sink.seen();
  REQUIRE(seen.size() == 2);
  CHECK(seen[0].tokens == Seq(5, 4));
  CHECK(seen[0].parts == std::vector<std::pair<int, bool>>{{kSwa, false}, {kRec, false}});
  CHECK(seen[1].tokens == Seq(1, 4));
  CHECK(seen[1].parts == std::vector<std::pair<int, bool>>{{kSwa, false}});
  REQUIRE(cache->Release(big.id, true).ok());
  RequireInvariants(*cache);
  const CacheReport before = cache->Report();

  const Namespace ns{.pool = "h"};
  const std::vector<Token> prompt = Concat(Seq(1, 8), Seq(900, 5));
  REQUIRE(*cache->SpineMatch(ns, prompt) == 0);
  SECTION("installed whole, the hit is the publisher's") {
    absl::StatusOr<TierPort::UnitInstall> install =
        cache->BeginInstall(ns, prompt, 0, {{UnitComponent{kSwa}}, {UnitComponent{kSwa}, UnitComponent{kRec}}});
    REQUIRE(install.ok());
    const BlockIndex checkpoint = install->parts[1][1].index;
    const std::vector<BlockIndex> full = install->spine;
    const BlockIndex swa0 = install->parts[0][0].index, swa1 = install->parts[1][0].index;
    CHECK(cache->FinishInstall(ns, prompt, *std::move(install), 2) == 2);
    RequireInvariants(*cache);
    CHECK(*cache->SpineMatch(ns, prompt) == 2);
    const AcquireResult hit = testing::Start(*cache, Spec("b", prompt, 0, "h"));
    CHECK(hit.cached_tokens == 8);
    CHECK(std::vector<BlockIndex>(hit.blocks.begin(), hit.blocks.begin() + 2) == full);
    CHECK(hit.group_tables[kSwa].first_block_position == 0);
    REQUIRE(hit.group_tables[kSwa].blocks.size() >= 2);
    CHECK(hit.group_tables[kSwa].blocks[0] == swa0);
    CHECK(hit.group_tables[kSwa].blocks[1] == swa1);
    CHECK(hit.group_tables[kRec].checkpoint_slot == checkpoint);
    REQUIRE(cache->Release(RequestId("b"), true).ok());
    RequireInvariants(*cache);
  }
  SECTION("a checkpoint whose window did not come back is never served; nothing is left behind") {
    absl::StatusOr<TierPort::UnitInstall> install =
        cache->BeginInstall(ns, prompt, 0, {{UnitComponent{kSwa}}, {UnitComponent{kRec}}});
    REQUIRE(install.ok());
    CHECK(cache->FinishInstall(ns, prompt, *std::move(install), 2) == 2);
    RequireInvariants(*cache);
    // U3 refused the checkpoint, U2 then dropped both units: G1 is as it was before.
    CHECK(*cache->SpineMatch(ns, prompt) == 0);
    const CacheReport after = cache->Report();
    for (size_t g = 0; g < after.pools[0].groups.size(); ++g) {
      CHECK(after.pools[0].groups[g].cached == before.pools[0].groups[g].cached);
    }
    const AcquireResult miss = testing::Start(*cache, Spec("b", prompt, 0, "h"));
    CHECK(miss.cached_tokens == 0);
    REQUIRE(cache->Release(RequestId("b"), true).ok());
  }
  SECTION("a unit not written is freed, and so is what only it made servable") {
    absl::StatusOr<TierPort::UnitInstall> install =
        cache->BeginInstall(ns, prompt, 0, {{UnitComponent{kSwa}}, {UnitComponent{kSwa}, UnitComponent{kRec}}});
    REQUIRE(install.ok());
    CHECK(cache->FinishInstall(ns, prompt, *std::move(install), 1) == 1);
    RequireInvariants(*cache);
    CHECK(*cache->SpineMatch(ns, prompt) == 0);  // depth 1 holds no checkpoint: U2 dropped it
  }
  SECTION("bad units are refused, changing nothing") {
    CHECK(absl::IsInvalidArgument(cache->BeginInstall(ns, prompt, 0, {{UnitComponent{0}}}).status()));
    CHECK(absl::IsInvalidArgument(
        cache->BeginInstall(ns, prompt, 0, {{UnitComponent{kSwa}, UnitComponent{kSwa}}}).status()));
    CHECK(absl::IsInvalidArgument(cache->BeginInstall(ns, prompt, 0, std::vector<std::vector<UnitComponent>>(4)).status()));
    CHECK(absl::IsFailedPrecondition(cache->BeginInstall(ns, prompt, 1, {{}}).status()));
    RequireInvariants(*cache);
  }
}

TEST_CASE("an acquire takes the window blocks its own evictions hold for the copy", "[spine][tiers]") {
  FakeClock clock;
  // 8 window blocks, all cached by 4 units; a 63-token start needs every full block, so its
  // evictions hold all 8 for the sink's copy when it allocates its own window blocks.
  auto cache = testing::PoolCache(Geometry(16, 8, 8), &clock);
  UnitSink sink;
  cache->SetEvictionSink(&sink);
  for (int i = 0; i < 4; ++i) PublishUnit(*cache, "u" + std::to_string(i), 100 * (i + 1));
  const RequestSpec big = Spec("big", Seq(1000, 63), 0, "h");
  const AcquireResult a = testing::Start(*cache, big);
  CHECK(sink.seen().size() == 8);
  CHECK(a.group_tables[kSwa].blocks.size() == 2);
  RequireInvariants(*cache);
  REQUIRE(cache->Release(big.id, true).ok());
  RequireInvariants(*cache);
}

namespace peek {

// The unit list of a run: per unit, its window block (bit 0) and its checkpoint (bit 1).
std::vector<std::vector<UnitComponent>> Units(const std::vector<int>& masks) {
  std::vector<std::vector<UnitComponent>> units;
  for (int m : masks) {
    std::vector<UnitComponent> parts;
    if (m & 1) parts.push_back(UnitComponent{kSwa});
    if (m & 2) parts.push_back(UnitComponent{kRec});
    units.push_back(std::move(parts));
  }
  return units;
}

// Peeks at `masks` on G1's match of `prompt`, installs them, starts: the start hits the peek.
void PeekThenInstall(KvCache& cache, const std::vector<Token>& prompt, const std::vector<int>& masks) {
  const Namespace ns{.pool = "h"};
  const int64_t first = *cache.SpineMatch(ns, prompt);
  const std::vector<std::vector<UnitComponent>> units = Units(masks);
  const absl::StatusOr<int64_t> peek = cache.PeekInstalled(ns, prompt, first, units);
  REQUIRE(peek.ok());
  absl::StatusOr<TierPort::UnitInstall> install = cache.BeginInstall(ns, prompt, first, units);
  REQUIRE(install.ok());
  (void)cache.FinishInstall(ns, prompt, *std::move(install), static_cast<int64_t>(masks.size()));
  RequireInvariants(cache);
  const AcquireResult hit = testing::Start(cache, Spec("peeked", prompt, 0, "h"));
  CHECK(hit.cached_tokens == *peek);
  REQUIRE(cache.Release(RequestId("peeked"), true).ok());
  RequireInvariants(cache);
}

}  // namespace peek

TEST_CASE("a peek at units below G1 answers what the start after their install hits", "[spine][tiers][peek]") {
  FakeClock clock;
  const Namespace ns{.pool = "h"};
  const std::vector<Token> prompt = Concat(Seq(1, 16), {999});  // 4 blocks may hit
  // Every run of 3 units on an empty G1 (a checkpoint off the k = 2 grid, or without its window,
  // is refused; a leaf left without one goes), and of 2 units past a published unit at depth 2.
  for (int run = 0; run < 4 * 4 * 4; ++run) {
    auto cache = testing::PoolCache(Geometry(16, 16, 6), &clock);
    INFO("run " << run);
    peek::PeekThenInstall(*cache, prompt, {run & 3, (run >> 2) & 3, (run >> 4) & 3});
  }
  for (int run = 0; run < 4 * 4; ++run) {
    auto cache = testing::PoolCache(Geometry(16, 16, 6), &clock);
    PublishUnit(*cache, "a", 1);
    REQUIRE(*cache->SpineMatch(ns, prompt) == 2);
    INFO("past G1, run " << run);
    peek::PeekThenInstall(*cache, prompt, {run & 3, (run >> 2) & 3});
  }
  SECTION("known answers") {
    auto cache = testing::PoolCache(Geometry(16, 16, 6), &clock);
    CHECK(*cache->PeekInstalled(ns, prompt, 0, peek::Units({1, 3})) == 8);
    CHECK(*cache->PeekInstalled(ns, prompt, 0, peek::Units({1, 3, 1, 3})) == 16);
    CHECK(*cache->PeekInstalled(ns, prompt, 0, peek::Units({1, 2})) == 0);   // no window at 8
    CHECK(*cache->PeekInstalled(ns, prompt, 0, peek::Units({0, 3})) == 0);   // W = 6 reads blocks 0 and 1
    CHECK(*cache->PeekInstalled(ns, prompt, 0, peek::Units({1, 3, 0, 3})) == 8);
    CHECK(*cache->PeekInstalled(ns, prompt, 0, peek::Units({1, 3, 1, 3, 3})) == 0);  // past the prompt: G1's
    CHECK(*cache->PeekInstalled(ns, prompt, 1, peek::Units({1, 3})) == 0);  // G1's match is not 1
    CHECK(absl::IsNotFound(cache->PeekInstalled(Namespace{.pool = "nope"}, prompt, 0, {}).status()));
    // Another namespace's (salt's) G1 match is its own: nothing of this one's.
    PublishUnit(*cache, "a", 1);
    CHECK(*cache->PeekInstalled(ns, prompt, 2, peek::Units({1, 3})) == 16);
    CHECK(*cache->PeekInstalled(Namespace{.pool = "h", .cache_salt = "other"}, prompt, 2, peek::Units({1, 3})) == 0);
  }
  SECTION("without room for the units the start would install nothing, and the peek says so") {
    auto cache = testing::PoolCache(Geometry(16, 16, 6), &clock);
    const RequestSpec big = Spec("big", Seq(1000, 63), 0, "h");  // reserves all 16 full blocks
    (void)testing::Start(*cache, big);
    CHECK(*cache->PeekInstalled(ns, prompt, 0, peek::Units({1, 3})) == 0);
    CHECK(absl::IsResourceExhausted(cache->BeginInstall(ns, prompt, 0, peek::Units({1, 3})).status()));
    REQUIRE(cache->Release(big.id, true).ok());
    CHECK(*cache->PeekInstalled(ns, prompt, 0, peek::Units({1, 3})) == 8);
    RequireInvariants(*cache);
  }
}

}  // namespace
}  // namespace kvd
