// Fences (kv_cache_fences.cc): a block a writer kvd can no longer reach may still write is never
// handed to a new owner — not across a handoff's snapshot, not after a restart on kept memory,
// not to a resume of the interrupted request's checkpoint — until the fence is lifted by its
// writer's attachment (re-attached quiesced), its process going, or time on the engine's clock.
// Accounting stays exact throughout (the invariant checker).
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

TEST_CASE("A live request's blocks stay fenced across a handoff until its attachment re-attaches or the TTL passes",
          "[core][fences]") {
  FakeClock clock;
  auto old_cache = MakeCache(SmallOptions(8), &clock);
  RequestSpec live = Spec("live", Seq(0, 16));  // 4 blocks, still being written
  live.owner = WorkerId("w-writer");
  const AcquireResult writing = Start(*old_cache, live);
  REQUIRE(old_cache->EndAllFenced(absl::Seconds(10), {{WorkerId("w-writer"), 4242}}) == 1);
  RequireInvariants(*old_cache);
  // The stopped cache itself hands none of them out either.
  RequestSpec probe = Spec("probe", Seq(100, 16));
  REQUIRE(Disjoint(Blocks(Start(*old_cache, probe)), Blocks(writing)));
  REQUIRE(old_cache->Release(probe.id, false).ok());

  const CacheSnapshot snap = old_cache->ExportSnapshot();
  REQUIRE(snap.fences_known);
  REQUIRE(snap.fences.size() == 1);
  REQUIRE(snap.fences[0].pid == 4242);
  REQUIRE(snap.fences[0].attachment == WorkerId("w-writer"));
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

  SECTION("lifted by its attachment") {
    REQUIRE(fresh->LiftFences(WorkerId("w-writer"), 999) == 0);  // another process's word changes nothing
    // Another attachment of the same process (a second client in the engine) lifts nothing either.
    REQUIRE(fresh->LiftFences(WorkerId("w-other"), 4242) == 0);
    REQUIRE(fresh->LiftFences(WorkerId("w-writer"), 4242) == 4);
  }
  SECTION("lifted when its process is gone") {
    REQUIRE(fresh->LiftFencesOfGone(999) == 0);
    REQUIRE(fresh->LiftFencesOfGone(4242) == 4);
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
  REQUIRE(cache->FenceFreeBlocks(absl::Seconds(10)) == 8);
  RequireInvariants(*cache);
  auto admitted = cache->Admit(Spec("a", Seq(0, 4)));
  REQUIRE(admitted.ok());
  REQUIRE(admitted->decision != AdmitDecision::kAdmitted);
  REQUIRE(cache->LiftFencesOfGone(0) == 0);  // pid 0 (unknown) is lifted by time only
  REQUIRE(cache->LiftFences(WorkerId(), 0) == 0);
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
  REQUIRE(old_cache->EndAllFenced(absl::Seconds(10), {{gen.owner, 77}}) == 1);
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
  REQUIRE(fresh->LiftFences(gen.owner, 77) > 0);
  RequireInvariants(*fresh);
}

TEST_CASE("A snapshot whose fences do not fit is refused and changes nothing", "[core][fences]") {
  FakeClock clock;
  auto cache = MakeCache(SmallOptions(8), &clock);
  CacheSnapshot snap;
  snap.fences_known = true;
  snap.fences.push_back(CacheSnapshot::Fence{.pid = 1, .pool = 0, .blocks = {1, 1}, .remaining = absl::Seconds(5)});
  REQUIRE(absl::IsInvalidArgument(cache->ImportSnapshot(snap).status()));
  snap.fences.pop_back();
  snap.fences.push_back(CacheSnapshot::Fence{.pid = 2, .pool = 0, .blocks = {8}, .remaining = absl::Seconds(5)});
  REQUIRE(absl::IsInvalidArgument(cache->ImportSnapshot(snap).status()));
  snap.fences.back().pool = 3;
  snap.fences.back().blocks = {3};
  REQUIRE(absl::IsInvalidArgument(cache->ImportSnapshot(snap).status()));
  RequireInvariants(*cache);
  Start(*cache, Spec("all", Seq(0, 32)));  // every block is free still
}

TEST_CASE("A block fenced twice crosses the next handoff: the successor holds it until both are lifted",
          "[core][fences][handoff]") {
  FakeClock clock;
  // Handoff 1: a generation live at it is fenced for its writer (pid 77) with its checkpoint.
  auto first = MakeCache(SmallOptions(16), &clock);
  RequestSpec gen = Spec("gen", Seq(0, 6), /*max_new=*/10);
  const AcquireResult acq = Start(*first, gen);
  REQUIRE(first->Checkpoint(gen.id, Seq(0, 6), "state").ok());
  REQUIRE(first->EndAllFenced(absl::Seconds(10), {{gen.owner, 77}}) == 1);
  auto second = MakeCache(SmallOptions(16), &clock);
  REQUIRE(second->ImportSnapshot(first->ExportSnapshot()).ok());
  // On the successor another worker resumes it (block 0 is read where it lies, fenced still),
  // and is live at handoff 2: block 0 is fenced again, for this worker.
  RequestSpec resume = Spec("resume", Seq(0, 6), /*max_new=*/10);
  resume.resume_from = gen.id;
  resume.owner = WorkerId("w-resumer");
  const AcquireResult r = Start(*second, resume);
  REQUIRE(r.blocks[0] == acq.blocks[0]);
  REQUIRE(second->EndAllFenced(absl::Seconds(10), {{resume.owner, 88}}) == 1);
  RequireInvariants(*second);
  const CacheSnapshot snap = second->ExportSnapshot();
  int64_t holding_block0 = 0;
  for (const CacheSnapshot::Fence& f : snap.fences) holding_block0 += std::count(f.blocks.begin(), f.blocks.end(), acq.blocks[0]);
  REQUIRE(holding_block0 == 2);

  auto third = MakeCache(SmallOptions(16), &clock);
  REQUIRE(third->ImportSnapshot(snap).ok());  // was refused: "fenced twice"
  RequireInvariants(*third);
  REQUIRE(third->LiftFences(gen.owner, 77) > 0);
  RequireInvariants(*third);
  // The resumer may still write it: no new request is given block 0.
  RequestSpec probe = Spec("probe", Seq(500, 48));
  const AcquireResult p = Start(*third, probe);
  REQUIRE_FALSE(Blocks(p).contains(acq.blocks[0]));
  REQUIRE(third->Release(probe.id, true).ok());
  REQUIRE(third->LiftFences(resume.owner, 88) > 0);
  RequireInvariants(*third);
}

TEST_CASE("Fence deadlines cross a handoff as durations: the successor's clock need not agree",
          "[core][fences][handoff]") {
  FakeClock old_clock;
  // The successor's clock reads an hour later (another process's anchor, a wall-clock step).
  FakeClock new_clock(old_clock.Now() + absl::Hours(1));
  auto old_cache = MakeCache(SmallOptions(8), &old_clock);
  RequestSpec live = Spec("live", Seq(0, 16));
  live.owner = WorkerId("w-writer");
  const AcquireResult writing = Start(*old_cache, live);
  REQUIRE(old_cache->EndAllFenced(absl::Seconds(10), {{live.owner, 4242}}) == 1);
  old_clock.Advance(absl::Seconds(4));
  const CacheSnapshot snap = old_cache->ExportSnapshot();
  REQUIRE(snap.fences.size() == 1);
  REQUIRE(snap.fences[0].remaining == absl::Seconds(6));

  auto fresh = MakeCache(SmallOptions(8), &new_clock);
  REQUIRE(fresh->ImportSnapshot(snap).ok());
  REQUIRE(fresh->ExpireFences() == 4);  // not lifted by the clocks' difference
  new_clock.Advance(absl::Seconds(5));
  REQUIRE(fresh->ExpireFences() == 4);
  new_clock.Advance(absl::Seconds(1));
  REQUIRE(fresh->ExpireFences() == 0);
  RequireInvariants(*fresh);
  RequestSpec c = Spec("c", Seq(300, 16));
  REQUIRE(Blocks(Start(*fresh, c)) == Blocks(writing));
}

TEST_CASE("A lost attach stream fences what the worker held until it re-attaches quiesced or the TTL passes",
          "[core][fences]") {
  FakeClock clock;
  auto cache = MakeCache(SmallOptions(8), &clock);
  RequestSpec live = Spec("live", Seq(0, 16));
  live.owner = WorkerId("w-lost");
  const AcquireResult writing = Start(*cache, live);
  REQUIRE(cache->FenceWorker(live.owner, 4242, absl::Seconds(10)) == 1);
  RequireInvariants(*cache);
  REQUIRE(absl::IsNotFound(cache->Release(live.id, false)));  // the request itself ended
  RequestSpec other = Spec("other", Seq(100, 16));
  const AcquireResult got = Start(*cache, other);
  REQUIRE(Disjoint(Blocks(got), Blocks(writing)));
  REQUIRE(cache->Release(other.id, true).ok());
  SECTION("its re-attach, quiesced, hands them on") {
    REQUIRE(cache->LiftFences(WorkerId("w-new"), 4242) == 0);
    REQUIRE(cache->LiftFences(live.owner, 4242) == 4);
  }
  SECTION("else the lease TTL does") {
    clock.Advance(absl::Seconds(10));
    REQUIRE(cache->ExpireFences() == 0);
  }
  RequireInvariants(*cache);
  REQUIRE(Blocks(Start(*cache, Spec("next", Seq(200, 32)))).size() == 8);
}

TEST_CASE("Memory from a predecessor that predates fences: orphaned checkpoints' tails are fenced too",
          "[core][fences][handoff]") {
  FakeClock clock;
  auto old_cache = MakeCache(SmallOptions(16), &clock);
  RequestSpec gen = Spec("gen", Seq(0, 6), /*max_new=*/10);
  const AcquireResult acq = Start(*old_cache, gen);
  REQUIRE(old_cache->Checkpoint(gen.id, Seq(0, 6), "state").ok());
  REQUIRE(old_cache->Release(gen.id, false).ok());  // as a kvd without fences ended it
  CacheSnapshot snap = old_cache->ExportSnapshot();
  snap.fences_known = false;
  snap.fences.clear();
  auto fresh = MakeCache(SmallOptions(16), &clock);
  REQUIRE(fresh->ImportSnapshot(snap).ok());
  // Every free block, and the checkpoint's tail (block 1: tokens 4-5, its writer went on past 6).
  REQUIRE(fresh->FenceFreeBlocks(absl::Seconds(10)) == 16 - 2 + 1);
  RequireInvariants(*fresh);
  clock.Advance(absl::Seconds(10));
  REQUIRE(fresh->ExpireFences() == 0);
  RequestSpec resume = Spec("resume", Seq(0, 6), /*max_new=*/10);
  resume.resume_from = gen.id;
  const AcquireResult r = Start(*fresh, resume);
  REQUIRE(r.resumed);
  REQUIRE(r.blocks[1] == acq.blocks[1]);  // lifted by time: its own tail again
  RequireInvariants(*fresh);
}

}  // namespace
}  // namespace kvd
