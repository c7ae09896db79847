// Fences (kv_cache_fences.cc): a block a writer kvd can no longer reach may still write is never
// handed to a new owner — not across a handoff's snapshot, not after a restart on kept memory,
// not to a resume of the interrupted request's checkpoint — until the fence is lifted by its
// writer's pid or by time. Accounting stays exact throughout (the invariant checker).
#include <catch2/catch.hpp>

#include <algorithm>
#include <set>

#include "server/core/kv_cache.h"
#include "tests/unit/core/test_util.h"

namespace kvd {
namespace {

using namespace kvd::testing;

std::set<BlockIndex> Blocks(const AcquireResult& a) { return {a.blocks.begin(), a.blocks.end()}; }

bool Disjoint(const std::set<BlockIndex>& a, const std::set<BlockIndex>& b) {
  return std::none_of(a.begin(), a.end(), [&b](BlockIndex x) { return b.contains(x); });
}

TEST_CASE("A live request's blocks stay fenced across a handoff until its pid re-attaches or the TTL passes",
          "[core][fences]") {
  FakeClock clock;
  auto old_cache = MakeCache(SmallOptions(8), &clock);
  RequestSpec live = Spec("live", Seq(0, 16));  // 4 blocks, still being written
  live.owner = WorkerId("w-writer");
  const AcquireResult writing = Start(*old_cache, live);
  REQUIRE(old_cache->EndAllFenced(clock.Now() + absl::Seconds(10), {{WorkerId("w-writer"), 4242}}) == 1);
  RequireInvariants(*old_cache);
  // The stopped cache itself hands none of them out either.
  RequestSpec probe = Spec("probe", Seq(100, 16));
  REQUIRE(Disjoint(Blocks(Start(*old_cache, probe)), Blocks(writing)));
  REQUIRE(old_cache->Release(probe.id, false).ok());

  const CacheSnapshot snap = old_cache->ExportSnapshot();
  REQUIRE(snap.fences_known);
  REQUIRE(snap.fences.size() == 1);
  REQUIRE(snap.fences[0].pid == 4242);
  auto fresh = MakeCache(SmallOptions(8), &clock);
  REQUIRE(fresh->ImportSnapshot(snap).ok());
  RequireInvariants(*fresh);
  REQUIRE(fresh->FencedPids() == std::vector<uint32_t>{4242});

  // Another worker is given only the other four blocks; a fifth does not fit: the budget counts
  // the fence.
  RequestSpec b = Spec("b", Seq(200, 16));
  const AcquireResult got = Start(*fresh, b);
  REQUIRE(Disjoint(Blocks(got), Blocks(writing)));
  auto more = fresh->Admit(Spec("c", Seq(300, 4)));
  REQUIRE(more.ok());
  REQUIRE(more->decision != AdmitDecision::kAdmitted);
  RequireInvariants(*fresh);

  SECTION("lifted by its pid") {
    REQUIRE(fresh->LiftFences(999) == 0);  // another process's word changes nothing
    REQUIRE(fresh->LiftFences(4242) == 4);
  }
  SECTION("lifted by time") {
    clock.Advance(absl::Seconds(9));
    REQUIRE(fresh->ExpireFences() == 4);
    clock.Advance(absl::Seconds(1));
    REQUIRE(fresh->ExpireFences() == 0);
  }
  RequireInvariants(*fresh);
  REQUIRE(fresh->FencedPids().empty());
  RequestSpec c = Spec("c", Seq(300, 16));
  REQUIRE(Blocks(Start(*fresh, c)) == Blocks(writing));  // handed on once lifted
  RequireInvariants(*fresh);
}

TEST_CASE("A start on kept memory fences every free block until the TTL", "[core][fences]") {
  FakeClock clock;
  auto cache = MakeCache(SmallOptions(8), &clock);
  REQUIRE(cache->FenceFreeBlocks(clock.Now() + absl::Seconds(10)) == 8);
  RequireInvariants(*cache);
  auto admitted = cache->Admit(Spec("a", Seq(0, 4)));
  REQUIRE(admitted.ok());
  REQUIRE(admitted->decision != AdmitDecision::kAdmitted);
  REQUIRE(cache->LiftFences(0) == 0);  // pid 0 (unknown) is lifted by time only
  clock.Advance(absl::Seconds(10));
  Start(*cache, Spec("a", Seq(0, 4)));
  RequireInvariants(*cache);
}

TEST_CASE("Resuming a fenced checkpoint writes its tail into fresh blocks, never the fenced ones",
          "[core][fences]") {
  FakeClock clock;
  auto old_cache = MakeCache(SmallOptions(16), &clock);
  RequestSpec gen = Spec("gen", Seq(0, 6), /*max_new=*/10);  // 6 prompt tokens, writing on
  const AcquireResult acq = Start(*old_cache, gen);
  REQUIRE(old_cache->Checkpoint(gen.id, Seq(0, 6), "state").ok());
  REQUIRE(old_cache->EndAllFenced(clock.Now() + absl::Seconds(10), {{gen.owner, 77}}) == 1);
  const CacheSnapshot snap = old_cache->ExportSnapshot();
  REQUIRE(snap.checkpoints.size() == 1);
  auto fresh = MakeCache(SmallOptions(16), &clock);
  REQUIRE(fresh->ImportSnapshot(snap).ok());
  RequireInvariants(*fresh);

  RequestSpec resume = Spec("resume", Seq(0, 6), /*max_new=*/10);
  resume.resume_from = gen.id;
  const AcquireResult r = Start(*fresh, resume);
  REQUIRE(r.resumed);
  // Block 0 (tokens 0-3, complete at the checkpoint) is read where it lies; block 1 (tokens 4-5
  // written, 6 on still being written by the old worker) is recomputed in a fresh block.
  REQUIRE(r.blocks[0] == acq.blocks[0]);
  const std::set<BlockIndex> old_tail(acq.blocks.begin() + 1, acq.blocks.end());
  REQUIRE(Disjoint(std::set<BlockIndex>(r.blocks.begin() + 1, r.blocks.end()), old_tail));
  REQUIRE(r.cached_tokens == 4);
  RequireInvariants(*fresh);
  REQUIRE(fresh->Release(resume.id, true).ok());
  RequireInvariants(*fresh);
  REQUIRE(fresh->LiftFences(77) > 0);
  RequireInvariants(*fresh);
}

TEST_CASE("A snapshot whose fences do not fit is refused and changes nothing", "[core][fences]") {
  FakeClock clock;
  auto cache = MakeCache(SmallOptions(8), &clock);
  CacheSnapshot snap;
  snap.fences_known = true;
  snap.fences.push_back(CacheSnapshot::Fence{.pid = 1, .pool = 0, .blocks = {1, 2}, .until = clock.Now() + absl::Seconds(5)});
  snap.fences.push_back(CacheSnapshot::Fence{.pid = 2, .pool = 0, .blocks = {2}, .until = clock.Now() + absl::Seconds(5)});
  REQUIRE(absl::IsInvalidArgument(cache->ImportSnapshot(snap).status()));
  snap.fences.pop_back();
  snap.fences.push_back(CacheSnapshot::Fence{.pid = 2, .pool = 0, .blocks = {8}, .until = clock.Now() + absl::Seconds(5)});
  REQUIRE(absl::IsInvalidArgument(cache->ImportSnapshot(snap).status()));
  snap.fences.back().pool = 3;
  snap.fences.back().blocks = {3};
  REQUIRE(absl::IsInvalidArgument(cache->ImportSnapshot(snap).status()));
  RequireInvariants(*cache);
  Start(*cache, Spec("all", Seq(0, 32)));  // every block is free still
}

}  // namespace
}  // namespace kvd
