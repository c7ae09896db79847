// Hybrid chains continue past duplicates (docs/hybrid.md §2.7): a request that recomputes a prefix
// it did not hit (its checkpoint or window was evicted) publishes its later blocks and checkpoints
// onto the cached chain, and a later request hits there. The checker runs after every operation.
#include <catch2/catch.hpp>

#include <algorithm>

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

// full (layers 0, 3), sliding window W = 6 (layer 1: 2 blocks before a hit), a state group every
// 2 blocks (layer 2) with `slots` slots. 4-token blocks, S = 8.
PoolGeometry Geometry(int64_t cap, int64_t slots) {
  PoolGeometry g;
  g.name = "h";
  g.block_tokens = 4;
  g.bytes_per_token_per_layer = 8;
  g.max_model_len = 128;
  g.step_tokens = 8;
  g.groups.push_back(KvGroup{.name = "full", .kind = KvGroupKind::kFull, .layers = {0, 3}, .capacity = cap});
  g.groups.push_back(
      KvGroup{.name = "swa", .kind = KvGroupKind::kSlidingWindow, .layers = {1}, .window = 6, .capacity = cap});
  g.groups.push_back(KvGroup{.name = "rec", .kind = KvGroupKind::kState, .layers = {2}, .bytes_per_state = 64,
                             .checkpoint_every_blocks = 2, .checkpoint_at_end = false, .capacity = slots});
  g.num_layers = 4;
  const absl::Status resolved = g.ResolveGroups();
  INFO(resolved.ToString());
  REQUIRE(resolved.ok());
  return g;
}

StepOpResult Grow(KvCache& cache, const std::string& id, int64_t computed) {
  return testing::Grow(cache, id, 0, computed);
}

std::vector<BlockIndex> First(const std::vector<BlockIndex>& v, size_t n) { return {v.begin(), v.begin() + n}; }

const PoolReport::Group& GroupReport(const KvCache& cache, int g) {
  static CacheReport r;
  r = cache.Report();
  return r.pools[0].groups[g];
}

TEST_CASE("a hybrid chain continues past a recomputed prefix whose checkpoint was evicted", "[spine][reuse]") {
  FakeClock clock;
  // Three state slots: a request holds two (running, spare), so each kept checkpoint's fresh spare
  // evicts the oldest unreferenced checkpoint once the group is full.
  auto cache = testing::PoolCache(Geometry(/*cap=*/32, /*slots=*/3), &clock);
  const Namespace ns{.pool = "h"};

  // a computes 16 tokens with checkpoints at 8 and 16; the second's fresh spare evicts the first
  // (an internal node: a state tombstone, and its window blocks go by U4). Nodes 0 and 1 stay.
  const RequestSpec a = Spec("a", Seq(1, 17), 0, "h");
  const AcquireResult ra = testing::Start(*cache, a);
  Grow(*cache, "a", 8);
  std::vector<BlockIndex> slots_a = ra.group_tables[kRec].blocks;
  absl::StatusOr<PublishResult> p =
      cache->Publish(a.id, a.prompt, First(ra.blocks, 2), std::vector<StateCheckpoint>{{kRec, 8, slots_a[1]}});
  REQUIRE(p.ok());
  REQUIRE(p->checkpoint_outcomes == std::vector<CheckpointOutcome>{CheckpointOutcome::kKept});
  REQUIRE(p->fresh_slots[0] >= 0);
  slots_a[1] = static_cast<BlockIndex>(p->fresh_slots[0]);
  RequireInvariants(*cache);
  Grow(*cache, "a", 16);
  p = cache->Publish(a.id, a.prompt, First(ra.blocks, 4), std::vector<StateCheckpoint>{{kRec, 16, slots_a[1]}});
  REQUIRE(p.ok());
  REQUIRE(p->checkpoint_outcomes == std::vector<CheckpointOutcome>{CheckpointOutcome::kKept});
  RequireInvariants(*cache);
  REQUIRE(cache->End(a.id, 4, {}, true).ok());
  RequireInvariants(*cache);
  REQUIRE(*cache->PeekPrefixLen(ns, Seq(1, 17)) == 16);
  REQUIRE(*cache->PeekPrefixLen(ns, Seq(1, 9)) == 0);  // the checkpoint at 8 is gone
  REQUIRE(GroupReport(*cache, kFull).cached == 4);

  // b shares a's first 8 tokens: the spine matches 2 blocks, the state group serves none, so b
  // computes them again. Its publish finds them cached (duplicate) and continues the chain there.
  const RequestSpec b = Spec("b", Concat(Seq(1, 8), Seq(200, 17)), 0, "h");
  const AcquireResult rb = testing::Start(*cache, b);
  REQUIRE(rb.cached_tokens == 0);
  REQUIRE(rb.full_hit_tokens == 8);
  REQUIRE(rb.limited_by == kSwa);  // the window at 8 went with the checkpoint (U4); both limit, swa first
  Grow(*cache, "b", 8);
  Grow(*cache, "b", 16);
  const std::vector<BlockIndex> slots_b = rb.group_tables[kRec].blocks;
  p = cache->Publish(b.id, b.prompt, First(rb.blocks, 4), std::vector<StateCheckpoint>{{kRec, 16, slots_b[1]}});
  REQUIRE(p.ok());
  CHECK(p->outcomes == std::vector<PublishOutcome>{PublishOutcome::kDuplicate, PublishOutcome::kDuplicate,
                                                   PublishOutcome::kKept, PublishOutcome::kKept});
  // The old rule answered no_chain here (and no_parent for blocks 2 and 3): the pool never learnt.
  CHECK(p->checkpoint_outcomes == std::vector<CheckpointOutcome>{CheckpointOutcome::kKept});
  RequireInvariants(*cache);
  // b's table holds the cached blocks at 0 and 1; its own copies stay its own while it runs,
  // within its reservation of the full group.
  const HandleInfo hb = *cache->GetHandle(b.id);
  CHECK(First(hb.blocks, 2) == First(ra.blocks, 2));
  CHECK(GroupReport(*cache, kFull).owned == static_cast<int64_t>(rb.blocks.size()) - 4 + 2);
  // A repeat publish naming b's own copies answers already_cached.
  p = cache->Publish(b.id, b.prompt, First(rb.blocks, 4));
  REQUIRE(p.ok());
  CHECK(p->outcomes == std::vector<PublishOutcome>(4, PublishOutcome::kAlreadyCached));
  REQUIRE(cache->End(b.id, 4, {}, true).ok());
  RequireInvariants(*cache);
  CHECK(GroupReport(*cache, kFull).owned == 0);
  CHECK(GroupReport(*cache, kRec).owned == 0);

  // c hits at b's checkpoint: a's blocks at 0 and 1, b's after them.
  const RequestSpec c = Spec("c", Concat(First(b.prompt, 16), {999}), 0, "h");
  const AcquireResult rc = testing::Start(*cache, c);
  CHECK(rc.cached_tokens == 16);
  CHECK(rc.limited_by == -1);
  CHECK(First(rc.blocks, 2) == First(ra.blocks, 2));
  CHECK(std::vector<BlockIndex>(rc.blocks.begin() + 2, rc.blocks.begin() + 4) ==
        std::vector<BlockIndex>(rb.blocks.begin() + 2, rb.blocks.begin() + 4));
  CHECK(rc.group_tables[kRec].checkpoint_slot == slots_b[1]);
  RequireInvariants(*cache);
  REQUIRE(cache->Release(c.id, true).ok());
  RequireInvariants(*cache);
  const CacheReport r = cache->Report();
  CHECK(r.no_parent_blocks == 0);
  CHECK(r.duplicate_blocks == 2);
}

TEST_CASE("a recomputed hybrid prefix fills the window blocks and checkpoint its cached nodes lack", "[spine][reuse]") {
  FakeClock clock;
  auto cache = testing::PoolCache(Geometry(/*cap=*/32, /*slots=*/4), &clock);
  const Namespace ns{.pool = "h"};
  // a publishes 4 blocks with one checkpoint at 16, after its window left blocks 0 and 1
  // (released unpublished): nodes 0 and 1 hold no window block and no checkpoint.
  const RequestSpec a = Spec("a", Seq(1, 17), 0, "h");
  const AcquireResult ra = testing::Start(*cache, a);
  Grow(*cache, "a", 8);
  Grow(*cache, "a", 16);
  absl::StatusOr<PublishResult> p = cache->Publish(a.id, a.prompt, First(ra.blocks, 4),
                                                   std::vector<StateCheckpoint>{{kRec, 16, ra.group_tables[kRec].blocks[1]}});
  REQUIRE(p.ok());
  REQUIRE(p->checkpoint_outcomes == std::vector<CheckpointOutcome>{CheckpointOutcome::kKept});
  REQUIRE(cache->End(a.id, 4, {}, true).ok());
  RequireInvariants(*cache);
  REQUIRE(*cache->PeekPrefixLen(ns, Seq(1, 9)) == 0);

  // b recomputes the first 8 tokens and publishes them with its window and a checkpoint at 8: the
  // cached nodes take them (the copies of the full blocks stay b's).
  const RequestSpec b = Spec("b", Concat(Seq(1, 8), Seq(300, 9)), 0, "h");
  const AcquireResult rb = testing::Start(*cache, b);
  REQUIRE(rb.cached_tokens == 0);
  REQUIRE(rb.full_hit_tokens == 8);
  Grow(*cache, "b", 8);
  const std::vector<BlockIndex> swa_b = First(rb.group_tables[kSwa].blocks, 2);
  const BlockIndex slot = rb.group_tables[kRec].blocks[1];
  p = cache->Publish(b.id, b.prompt, First(rb.blocks, 2), std::vector<StateCheckpoint>{{kRec, 8, slot}});
  REQUIRE(p.ok());
  CHECK(p->outcomes == std::vector<PublishOutcome>(2, PublishOutcome::kDuplicate));
  CHECK(p->checkpoint_outcomes == std::vector<CheckpointOutcome>{CheckpointOutcome::kKept});  // was no_chain
  RequireInvariants(*cache);
  // A worker that ends b without publishing more: the copies are freed, the filled units stay.
  REQUIRE(cache->Release(b.id, false).ok());
  RequireInvariants(*cache);
  CHECK(GroupReport(*cache, kFull).owned == 0);
  CHECK(*cache->PeekPrefixLen(ns, Seq(1, 9)) == 8);
  const AcquireResult rd = testing::Start(*cache, Spec("d", Seq(1, 9), 0, "h"));
  CHECK(rd.cached_tokens == 8);
  CHECK(First(rd.blocks, 2) == First(ra.blocks, 2));
  CHECK(First(rd.group_tables[kSwa].blocks, 2) == swa_b);
  CHECK(rd.group_tables[kRec].checkpoint_slot == slot);
  RequireInvariants(*cache);
  REQUIRE(cache->Release(RequestId("d"), true).ok());
  RequireInvariants(*cache);
  CHECK(cache->Report().no_parent_blocks == 0);
}

// full + sliding window (W = 6: a hit reads 2 window blocks before it), no state group: the
// gpt-oss shape, where any node may keep or tombstone its window block (U4).
PoolGeometry WindowOnly(int64_t swa_cap) {
  PoolGeometry g;
  g.name = "h";
  g.block_tokens = 4;
  g.bytes_per_token_per_layer = 8;
  g.max_model_len = 128;
  g.step_tokens = 8;
  g.groups.push_back(KvGroup{.name = "full", .kind = KvGroupKind::kFull, .layers = {0}, .capacity = 64});
  g.groups.push_back(
      KvGroup{.name = "swa", .kind = KvGroupKind::kSlidingWindow, .layers = {1}, .window = 6, .capacity = swa_cap});
  g.num_layers = 2;
  const absl::Status resolved = g.ResolveGroups();
  INFO(resolved.ToString());
  REQUIRE(resolved.ok());
  return g;
}

// Computes `prompt` as the bench's engine does: each step's blocks published before the grow
// that reports them computed (and lets the window go), then End publishing every full block.
// Returns the tokens its hit served.
int64_t Compute(KvCache& cache, const RequestSpec& spec) {
  const AcquireResult r = testing::Start(cache, spec);
  const int64_t n = static_cast<int64_t>(spec.prompt.size());
  for (int64_t c = r.cached_tokens; c < n;) {
    const int64_t c2 = std::min<int64_t>(n, c + 8);
    REQUIRE(cache.Publish(spec.id, spec.prompt, First(r.blocks, static_cast<size_t>(c2 / 4))).ok());
    REQUIRE(Grow(cache, spec.id.value(), c2).status.ok());
    c = c2;
    RequireInvariants(cache);
  }
  REQUIRE(cache.End(spec.id, n / 4, {}, true).ok());
  RequireInvariants(cache);
  return r.cached_tokens;
}

TEST_CASE("window pressure tombstones interior window blocks before those a chain end's hit reads", "[spine][reuse]") {
  FakeClock clock;
  auto cache = testing::PoolCache(WindowOnly(/*swa_cap=*/16), &clock);
  const Namespace ns{.pool = "h"};
  // Two chains of 6 blocks, a then b: each keeps its window block at every position (12 cached).
  const RequestSpec a = Spec("a", Seq(1, 25), 0, "h");
  const RequestSpec b = Spec("b", Seq(5000, 25), 0, "h");
  Compute(*cache, a);
  Compute(*cache, b);
  REQUIRE(*cache->PeekPrefixLen(ns, Concat(Seq(1, 24), {7})) == 24);
  REQUIRE(*cache->PeekPrefixLen(ns, Concat(Seq(5000, 24), {7})) == 24);
  REQUIRE(GroupReport(*cache, kSwa).cached == 12);
  // Window pressure: requests that hold window blocks while they run evict some of the 12, fewer
  // than the 8 interior ones (positions 0-3 of each chain). a's end (its blocks at 4 and 5) was
  // released before b's interior blocks left b's window: by age alone a's would go first.
  // Three of them (reservations of 5 window blocks each fit 16): 2 blocks each at the start, 4
  // once two have computed 8 tokens: 10 held, 4 free before, so 6 of the cached blocks go.
  for (int i = 0; i < 3; ++i) testing::Start(*cache, Spec(absl::StrCat("p", i), Seq(10000 * (i + 1), 25), 0, "h"));
  for (int i = 0; i < 2; ++i) REQUIRE(Grow(*cache, absl::StrCat("p", i), 8).status.ok());
  RequireInvariants(*cache);
  const int64_t left = GroupReport(*cache, kSwa).cached;
  INFO("window blocks cached " << left);
  REQUIRE(left >= 4);
  REQUIRE(left <= 7);
  // Both chain ends still serve a continuation of the whole chain.
  CHECK(*cache->PeekPrefixLen(ns, Concat(Seq(1, 24), {7})) == 24);
  CHECK(*cache->PeekPrefixLen(ns, Concat(Seq(5000, 24), {7})) == 24);
  for (int i = 0; i < 3; ++i) REQUIRE(cache->Release(RequestId(absl::StrCat("p", i)), true).ok());
  RequireInvariants(*cache);
}

// Starts `count` requests of fresh 25-token prompts and grows the first `grown` of them to 8
// computed tokens: window blocks held while they run (2 each at the start, 4 once grown).
void HoldWindows(KvCache& cache, int count, int grown) {
  for (int i = 0; i < count; ++i) testing::Start(cache, Spec(absl::StrCat("p", i), Seq(10000 * (i + 1), 25), 0, "h"));
  for (int i = 0; i < grown; ++i) REQUIRE(Grow(cache, absl::StrCat("p", i), 8).status.ok());
  RequireInvariants(cache);
}

void ReleaseHeld(KvCache& cache, int count) {
  for (int i = 0; i < count; ++i) REQUIRE(cache.Release(RequestId(absl::StrCat("p", i)), true).ok());
  RequireInvariants(cache);
}

TEST_CASE("window blocks a hit read outlive unread interior ones; chain ends outlive both", "[spine][reuse]") {
  FakeClock clock;
  auto cache = testing::PoolCache(WindowOnly(/*swa_cap=*/12), &clock);
  const Namespace ns{.pool = "h"};
  // a: a chain of 6 blocks, interior window blocks at positions 0-3, its end's at 4 and 5.
  Compute(*cache, Spec("a", Seq(1, 25), 0, "h"));
  // c branches off a at 12 tokens: its hit reads a's interior window blocks at 1 and 2, and
  // releases them at its first grow, together with nothing else; its own block at 3 becomes
  // interior at its last grow, after them, and its end (4, 5) is released last.
  const std::vector<Token> c_prompt = Concat(Seq(1, 12), Seq(9000, 13));
  REQUIRE(Compute(*cache, Spec("c", c_prompt, 0, "h")) == 12);
  REQUIRE(GroupReport(*cache, kSwa).cached == 9);  // a's 6, c's 3 (positions 3-5)
  REQUIRE(*cache->PeekPrefixLen(ns, Concat(Seq(1, 12), {7})) == 12);
  // Window pressure takes 3 of the 9: 3 free, then 2 + 2 blocks held at the start and 2 more once
  // p0 grows. Unread interior blocks go first (a's at 0 and 3, c's at 3), oldest first; the blocks
  // c's hit read stay, so a hit there still reads its window. Under "interior first, newest
  // first" they would have been put first in line at c's grow (positions 1, 2 lie before c's
  // window then), and that hit would fall back to 4 tokens.
  HoldWindows(*cache, 2, 1);
  CHECK(GroupReport(*cache, kSwa).cached == 6);
  CHECK(*cache->PeekPrefixLen(ns, Concat(Seq(1, 12), {7})) == 12);
  // Both chain ends still serve a continuation of their whole chain.
  CHECK(*cache->PeekPrefixLen(ns, Concat(Seq(1, 24), {7})) == 24);
  CHECK(*cache->PeekPrefixLen(ns, Concat(Concat(Seq(1, 12), Seq(9000, 12)), {7})) == 24);
  ReleaseHeld(*cache, 2);
}

TEST_CASE("window blocks a hit at an anchor reads outlive the other interior ones", "[spine][reuse]") {
  FakeClock clock;
  // W = 6, 4-token blocks: a hit reads 2 window blocks, and anchors are every 8 windows, 16 blocks
  // (64 tokens): a hit at 64 tokens reads positions 14 and 15.
  REQUIRE(HybridSpine::kAnchorEvery == 8);
  auto cache = testing::PoolCache(WindowOnly(/*swa_cap=*/24), &clock);
  const Namespace ns{.pool = "h"};
  // a: 19 blocks; its end's window blocks are at 17 and 18, its anchor's at 14 and 15, the other
  // 15 are interior.
  Compute(*cache, Spec("a", Seq(1, 77), 0, "h"));
  REQUIRE(GroupReport(*cache, kSwa).cached == 19);
  // Pressure takes 11: 5 free, 4 requests holding 4 blocks each. The interior ones go, shallowest
  // first (0-10); under "interior first, newest first" the deepest went first (16, 15, 14, ...),
  // the anchor's with them, and a branch at 64 tokens fell back to 24.
  HoldWindows(*cache, 4, 4);
  CHECK(GroupReport(*cache, kSwa).cached == 8);
  CHECK(*cache->PeekPrefixLen(ns, Concat(Seq(1, 64), {7})) == 64);
  CHECK(*cache->PeekPrefixLen(ns, Concat(Seq(1, 76), {7})) == 76);
  ReleaseHeld(*cache, 4);
}

}  // namespace
}  // namespace kvd
