// KvCache as PeerPort (server/core/peer_port.h): a hybrid pool's hit as the unit a peer pull moves
// (docs/hybrid.md §2.9, "peers"). The lender pins every group's components of its hit past the
// borrower's; the borrower pins its own targets (a window group's positions past its table in
// loose units), and a finished pull publishes them as one unit with the checkpoint — or, unwritten,
// leaves the request at its hit with every unit back where it was. The checker runs after each step.
#include <catch2/catch.hpp>

#include "absl/strings/str_cat.h"
#include "proto/vocab/pool_geometry.h"
#include "proto/vocab/step_types.h"
#include "tests/unit/core/test_util.h"

namespace kvd {
namespace {

using testing::Concat;
using testing::RequireInvariants;
using testing::Seq;
using testing::Spec;

constexpr int kFull = 0, kSwa = 1, kRec = 2;

// full (layers 0, 3), sliding window W = 6 (layer 1), state every 2 blocks (layer 2); 4-token
// blocks, S = 8: a window table holds at most 3 blocks past its first needed one.
PoolGeometry Geometry() {
  PoolGeometry g;
  g.name = "h";
  g.block_tokens = 4;
  g.num_layers = 4;
  g.bytes_per_token_per_layer = 8;
  g.max_model_len = 128;
  g.step_tokens = 8;
  g.groups.push_back(KvGroup{.name = "full", .kind = KvGroupKind::kFull, .layers = {0, 3}, .capacity = 48});
  g.groups.push_back(KvGroup{.name = "swa", .kind = KvGroupKind::kSlidingWindow, .layers = {1}, .window = 6, .capacity = 48});
  g.groups.push_back(KvGroup{.name = "rec", .kind = KvGroupKind::kState, .layers = {2}, .bytes_per_state = 64,
                             .checkpoint_every_blocks = 2, .checkpoint_at_end = false, .capacity = 12});
  const absl::Status resolved = g.ResolveGroups();
  INFO(resolved.ToString());
  REQUIRE(resolved.ok());
  return g;
}

std::unique_ptr<KvCache> Cache(FakeClock* clock) {
  CacheOptions o = testing::SmallOptions();
  o.pools = {Geometry()};
  return testing::MakeCache(o, clock);
}

const Namespace kNs{.pool = "h"};

// On `cache`, request `id` computes `prompt` and publishes its first `depth` blocks (even) with the
// state after them; returns its tables as they were when it published.
struct Published {
  std::vector<BlockIndex> full;
  std::vector<BlockIndex> swa;  // positions depth - 2 and depth - 1
  BlockIndex checkpoint = 0;
};
Published PublishUnit(KvCache& cache, const std::string& id, const std::vector<Token>& prompt, int64_t depth = 8) {
  const RequestSpec a = Spec(id, prompt, 0, "h");
  const AcquireResult ra = testing::Start(cache, a);
  testing::GroupView swa{ra.group_tables[kSwa].first_block_position, ra.group_tables[kSwa].blocks};
  for (int64_t computed = 8; computed <= depth * 4; computed += 8) {
    swa.Apply(testing::Grow(cache, id, 0, computed).group_tables[kSwa]);
  }
  REQUIRE(swa.first == depth - 2);
  Published out{{ra.blocks.begin(), ra.blocks.begin() + depth},
                {swa.at(depth - 2), swa.at(depth - 1)},
                ra.group_tables[kRec].blocks[1]};
  const absl::StatusOr<PublishResult> p = cache.Publish(a.id, absl::MakeConstSpan(prompt).first(depth * 4), out.full,
                                                        std::vector<StateCheckpoint>{{kRec, depth * 4, out.checkpoint}});
  REQUIRE(p.ok());
  REQUIRE(p->checkpoint_outcomes == std::vector<CheckpointOutcome>{CheckpointOutcome::kKept});
  REQUIRE(cache.Release(a.id, true).ok());
  RequireInvariants(cache);
  return out;
}

const PoolReport::Group& Group(const CacheReport& r, int g) { return r.pools[0].groups[static_cast<size_t>(g)]; }

TEST_CASE("a lender pins the unit of its hybrid hit past the borrower's: full blocks, window, checkpoint", "[core][peer]") {
  FakeClock clock;
  auto lender = Cache(&clock);
  const std::vector<Token> prompt = Seq(1, 33);
  const Published a = PublishUnit(*lender, "a", prompt);

  auto all = lender->PinHybridUnit(kNs, prompt, 0, 0);
  REQUIRE(all.ok());
  CHECK(all->depth == 8);
  std::vector<BlockIndex> want = a.full;
  want.insert(want.end(), a.swa.begin(), a.swa.end());
  want.push_back(a.checkpoint);
  CHECK(all->components == want);
  CHECK(all->serials.size() == want.size());
  CHECK(UnitLayout(Geometry(), 0, 8).size() == want.size());
  // Past a borrower's hit of 3 blocks: full [3, 8), the window before 8, the checkpoint.
  auto past = lender->PinHybridUnit(kNs, prompt, 3, 0);
  REQUIRE(past.ok());
  CHECK(past->depth == 8);
  CHECK(past->components.size() == 5 + 2 + 1);
  // Capped below the only checkpoint: no unit every group serves, nothing pinned.
  auto capped = lender->PinHybridUnit(kNs, prompt, 0, 7);
  REQUIRE(capped.ok());
  CHECK(capped->depth == 0);
  CHECK(capped->components.empty());
  RequireInvariants(*lender);
  // Pinned units survive the operator's clear; once unpinned they can go.
  CHECK(lender->ClearCache() == 0);
  CHECK(*lender->PeekPrefixLen(kNs, prompt) == 32);
  lender->UnpinBlocks(all->pool, all->components);
  lender->UnpinBlocks(past->pool, past->components);
  RequireInvariants(*lender);
  lender->ClearCache();
  CHECK(*lender->PeekPrefixLen(kNs, prompt) == 0);
  RequireInvariants(*lender);
  // Not a hybrid pool with a full group, or no such pool: refused.
  CHECK(absl::IsNotFound(lender->PinHybridUnit(Namespace{.pool = "nope"}, prompt, 0, 0).status()));
}

TEST_CASE("a borrower adopts a pulled unit whole, and hits at its depth; unwritten, nothing changes",
          "[core][peer]") {
  FakeClock clock;
  auto borrower = Cache(&clock);
  const std::vector<Token> prompt = Seq(1, 33);
  const RequestSpec b = Spec("b", prompt, 0, "h");
  const AcquireResult rb = testing::Start(*borrower, b);
  REQUIRE(rb.cached_tokens == 0);
  CHECK(*borrower->PullHorizon(b.id) == 8);

  SECTION("written: published as one unit") {
    auto targets = borrower->PinUnitTargets(b.id, 8);
    REQUIRE(targets.ok());
    REQUIRE(targets->blocks.size() == 8 + 2 + 1);
    // The window's positions 6 and 7 lie past the table's step horizon (2 blocks): loose units.
    CHECK(targets->loose.size() == 2);
    CHECK(std::vector<BlockIndex>(targets->blocks.begin(), targets->blocks.begin() + 8) ==
          std::vector<BlockIndex>(rb.blocks.begin(), rb.blocks.begin() + 8));
    CHECK(targets->blocks.back() == rb.group_tables[kRec].blocks[1]);
    REQUIRE(borrower->FinishUnitPull(b.id, 0, 8, *targets, /*written=*/true).ok());
    RequireInvariants(*borrower);
    auto tables = borrower->GroupTablesOf(b.id);
    REQUIRE(tables.ok());
    CHECK((*tables)[kSwa].first_block_position == 6);
    REQUIRE((*tables)[kSwa].blocks.size() == 3);  // [6, 9): the window and the step horizon
    CHECK((*tables)[kSwa].blocks[0] == targets->blocks[8]);
    CHECK((*tables)[kSwa].blocks[1] == targets->blocks[9]);
    CHECK((*tables)[kRec].checkpoint_slot == targets->blocks[10]);
    CHECK((*tables)[kRec].blocks.size() == 1);  // the running slot; the checkpoint stands for the spare
    // Another request hits at the unit's depth, reading exactly its components.
    const AcquireResult hit = testing::Start(*borrower, Spec("c", Concat(Seq(1, 32), {7}), 0, "h"));
    CHECK(hit.cached_tokens == 32);
    CHECK(std::vector<BlockIndex>(hit.blocks.begin(), hit.blocks.begin() + 8) ==
          std::vector<BlockIndex>(targets->blocks.begin(), targets->blocks.begin() + 8));
    CHECK(hit.group_tables[kSwa].first_block_position == 6);
    CHECK(hit.group_tables[kSwa].blocks[0] == targets->blocks[8]);
    CHECK(hit.group_tables[kRec].checkpoint_slot == targets->blocks[10]);
    RequireInvariants(*borrower);
    // A next grow lets the checkpoint go as after any hit.
    testing::Grow(*borrower, "b", 0, 33);
    RequireInvariants(*borrower);
    REQUIRE(borrower->Release(b.id, true).ok());
    REQUIRE(borrower->Release(RequestId("c"), true).ok());
    RequireInvariants(*borrower);
    CHECK(*borrower->PeekPrefixLen(kNs, prompt) == 32);
  }
  SECTION("unwritten (a lender gone, a checksum that differs): the request stays at its hit") {
    const CacheReport before = borrower->Report();
    auto targets = borrower->PinUnitTargets(b.id, 8);
    REQUIRE(targets.ok());
    CHECK(!borrower->FinishUnitPull(b.id, 0, 8, *targets, /*written=*/false).ok());
    RequireInvariants(*borrower);
    const CacheReport after = borrower->Report();
    for (int g : {kFull, kSwa, kRec}) {
      INFO("group " << g);
      CHECK(Group(after, g).owned == Group(before, g).owned);  // the loose units went back
      CHECK(Group(after, g).cached == 0);
    }
    auto tables = borrower->GroupTablesOf(b.id);
    REQUIRE(tables.ok());
    CHECK((*tables)[kSwa].first_block_position == 0);
    CHECK((*tables)[kSwa].blocks == rb.group_tables[kSwa].blocks);
    CHECK((*tables)[kRec].blocks == rb.group_tables[kRec].blocks);
    CHECK(*borrower->PeekPrefixLen(kNs, prompt) == 0);
    REQUIRE(borrower->Release(b.id, true).ok());
    RequireInvariants(*borrower);
    for (int g : {kFull, kSwa, kRec}) CHECK(Group(borrower->Report(), g).owned == 0);
  }
  SECTION("the request ends while its pull writes: every unit goes back") {
    auto targets = borrower->PinUnitTargets(b.id, 8);
    REQUIRE(targets.ok());
    REQUIRE(borrower->Release(b.id, false).ok());
    CHECK(absl::IsNotFound(borrower->FinishUnitPull(b.id, 0, 8, *targets, /*written=*/true)));
    RequireInvariants(*borrower);
    for (int g : {kFull, kSwa, kRec}) CHECK(Group(borrower->Report(), g).owned == 0);
    CHECK(*borrower->PeekPrefixLen(kNs, prompt) == 0);
  }
}

TEST_CASE("a borrower whose spine holds the prompt past its hit pulls no unit (it would publish duplicates)",
          "[core][peer]") {
  FakeClock clock;
  auto borrower = Cache(&clock);
  const std::vector<Token> prompt = Seq(1, 33);
  // 4 full blocks published without a state: the spine holds them, the hit is 0 (limited by rec).
  const RequestSpec a = Spec("a", prompt, 0, "h");
  const AcquireResult ra = testing::Start(*borrower, a);
  REQUIRE(borrower->Publish(a.id, Seq(1, 16), std::vector<BlockIndex>(ra.blocks.begin(), ra.blocks.begin() + 4)).ok());
  const RequestSpec b = Spec("b", prompt, 0, "h");
  REQUIRE(testing::Start(*borrower, b).cached_tokens == 0);
  const absl::StatusOr<PeerPort::UnitTargets> targets = borrower->PinUnitTargets(b.id, 8);
  CHECK(absl::IsFailedPrecondition(targets.status()));
  CHECK(std::string(targets.status().message()).find("caches block 0 of the prompt already") != std::string::npos);
  // Past the prompt (its last token is computed) or not past the hit: refused too.
  CHECK(absl::IsFailedPrecondition(borrower->PinUnitTargets(b.id, 9).status()));
  CHECK(absl::IsFailedPrecondition(borrower->PinUnitTargets(b.id, 0).status()));
  RequireInvariants(*borrower);
}


TEST_CASE("a borrower with a hit of its own pulls the rest: its old checkpoint goes, the new one stands for the spare",
          "[core][peer]") {
  FakeClock clock;
  auto borrower = Cache(&clock);
  const std::vector<Token> prompt = Seq(1, 33);
  // The borrower holds the unit at 16 tokens itself: its start hits there.
  const Published local = PublishUnit(*borrower, "x", Seq(1, 17), 4);
  const RequestSpec b = Spec("b", prompt, 0, "h");
  const AcquireResult rb = testing::Start(*borrower, b);
  REQUIRE(rb.cached_tokens == 16);
  REQUIRE(rb.group_tables[kRec].checkpoint_slot == local.checkpoint);
  REQUIRE(rb.group_tables[kRec].blocks.size() == 1);
  REQUIRE(rb.group_tables[kSwa].first_block_position == 2);
  auto targets = borrower->PinUnitTargets(b.id, 8);
  REQUIRE(targets.ok());
  // Full [4, 8), the window's 6 and 7 (past the table's horizon at 6: loose), the running slot.
  REQUIRE(targets->blocks.size() == 4 + 2 + 1);
  CHECK(targets->loose.size() == 2);
  CHECK(targets->blocks.back() == rb.group_tables[kRec].blocks[0]);
  REQUIRE(borrower->FinishUnitPull(b.id, 0, 8, *targets, /*written=*/true).ok());
  RequireInvariants(*borrower);
  auto tables = borrower->GroupTablesOf(b.id);
  REQUIRE(tables.ok());
  CHECK((*tables)[kRec].checkpoint_slot == targets->blocks.back());
  REQUIRE((*tables)[kRec].blocks.size() == 1);  // a fresh spare; the hit's checkpoint stands for the other
  CHECK((*tables)[kRec].blocks[0] != targets->blocks.back());
  CHECK((*tables)[kSwa].first_block_position == 6);
  CHECK((*tables)[kSwa].blocks[0] == targets->blocks[4]);
  // Both units are cached: the one at 16 (unreferenced now) and the pulled one at 32.
  CHECK(*borrower->PeekPrefixLen(kNs, Seq(1, 17)) == 16);
  CHECK(*borrower->PeekPrefixLen(kNs, prompt) == 32);
  const AcquireResult hit = testing::Start(*borrower, Spec("c", Concat(Seq(1, 32), {5}), 0, "h"));
  CHECK(hit.cached_tokens == 32);
  CHECK(hit.group_tables[kRec].checkpoint_slot == targets->blocks.back());
  REQUIRE(borrower->Release(b.id, true).ok());
  REQUIRE(borrower->Release(RequestId("c"), true).ok());
  RequireInvariants(*borrower);
  for (int g : {kFull, kSwa, kRec}) CHECK(Group(borrower->Report(), g).owned == 0);
}
}  // namespace
}  // namespace kvd
