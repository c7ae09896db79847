// Fences (kv_cache_fences.cc): a block a writer kvd can no longer reach may still write is never
// handed to a new owner — not across a handoff's snapshot, not after a restart on kept memory,
// not to a resume of the interrupted request's checkpoint — until the fence is lifted by its
// writer's attachment (re-attached quiesced), its process going, or time on the engine's clock.
// Accounting stays exact throughout (the invariant checker).
#include <catch2/catch.hpp>

#include <algorithm>
#include <optional>
#include <set>

#include "absl/strings/str_cat.h"
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

// The writer of `b` in pool 0 (block_ledger.h): REQUIREs it is a fence of `attachment`.
void RequireFenceWrites(const KvCache& cache, BlockIndex b, const WorkerId& attachment) {
  const std::optional<Owner> w = cache.WriterForTesting(0, b);
  INFO("block " << b);
  REQUIRE(w.has_value());
  REQUIRE(w->kind == OwnerKind::kFence);
  REQUIRE(w->attachment == attachment);
}

void RequireNoWriter(const KvCache& cache, BlockIndex b) {
  INFO("block " << b);
  REQUIRE_FALSE(cache.WriterForTesting(0, b).has_value());
}

TEST_CASE("A fence is the ledger writer of a lost worker's requests' blocks and credit until it lifts",
          "[core][fences][ledger]") {
  FakeClock clock;
  CacheOptions o = SmallOptions(16);
  o.step_credit_blocks = 2;
  auto cache = MakeCache(o, &clock);
  const WorkerId w("w-lost");
  RequestSpec live = Spec("live", Seq(0, 16));
  live.owner = w;
  const AcquireResult writing = Start(*cache, live);
  std::vector<CreditHeld> held;
  cache->Step(w, w, {}, {CreditWant{0, 2, {}}}, &held);
  REQUIRE(held.size() == 1);
  REQUIRE(held[0].blocks.size() == 2);
  std::set<BlockIndex> fenced = Blocks(writing);
  fenced.insert(held[0].blocks.begin(), held[0].blocks.end());
  REQUIRE(fenced.size() == 6);

  REQUIRE(cache->FenceWorker(w, 4242, absl::Seconds(10)) == 1);
  RequireInvariants(*cache);
  for (BlockIndex b : fenced) RequireFenceWrites(*cache, b, w);
  // The other ten blocks go to the next request; nothing the fence writes does.
  RequestSpec other = Spec("other", Seq(100, 40));
  other.owner = WorkerId("w-other");
  const AcquireResult got = Start(*cache, other);
  REQUIRE(Disjoint(Blocks(got), fenced));
  REQUIRE_FALSE(cache->Admit(Spec("more", Seq(300, 4))).value().decision == AdmitDecision::kAdmitted);
  REQUIRE(cache->Release(other.id, true).ok());
  RequireInvariants(*cache);

  REQUIRE(cache->LiftFences(w, 4242) == 6);
  RequireInvariants(*cache);
  for (BlockIndex b : fenced) RequireNoWriter(*cache, b);
  REQUIRE(Blocks(Start(*cache, Spec("next", Seq(500, 64)))).size() == 16);
  RequireInvariants(*cache);
}

TEST_CASE("A block in two fences passes from the fence that lifts to the one that holds it, in either order",
          "[core][fences][ledger]") {
  FakeClock clock;
  // As in the double fence across handoffs: gen's fence (pid 77, imported) and the resumer's
  // (pid 88) both hold block 0 on `second`.
  auto first = MakeCache(SmallOptions(16), &clock);
  RequestSpec gen = Spec("gen", Seq(0, 6), /*max_new=*/10);
  const AcquireResult acq = Start(*first, gen);
  REQUIRE(first->Checkpoint(gen.id, Seq(0, 6), "state").ok());
  REQUIRE(first->EndAllFenced(absl::Seconds(10), {{gen.owner, 77}}) == 1);
  for (BlockIndex b : acq.blocks) RequireFenceWrites(*first, b, gen.owner);
  auto second = MakeCache(SmallOptions(16), &clock);
  REQUIRE(second->ImportSnapshot(first->ExportSnapshot()).ok());
  RequireInvariants(*second);
  // The imported fence writes them again on the successor.
  for (BlockIndex b : acq.blocks) RequireFenceWrites(*second, b, gen.owner);
  RequestSpec resume = Spec("resume", Seq(0, 6), /*max_new=*/10);
  resume.resume_from = gen.id;
  resume.owner = WorkerId("w-resumer");
  const AcquireResult r = Start(*second, resume);
  REQUIRE(r.blocks[0] == acq.blocks[0]);
  // Below the checkpoint's tail: taken from gen's fence; the tail stays that fence's.
  REQUIRE(second->WriterForTesting(0, acq.blocks[0])->kind == OwnerKind::kRequest);
  RequireFenceWrites(*second, acq.blocks[1], gen.owner);
  RequireInvariants(*second);
  REQUIRE(second->EndAllFenced(absl::Seconds(20), {{resume.owner, 88}}) == 1);
  RequireInvariants(*second);
  RequireFenceWrites(*second, acq.blocks[0], resume.owner);
  // Every block anyone is handed meanwhile, one at a time until none is left, is another.
  const auto probe_excludes_block0 = [&](const char* name) {
    std::vector<RequestId> probes;
    for (int i = 0; i < 16; ++i) {
      RequestSpec probe = Spec(absl::StrCat(name, "-", i), Seq(1000 + 10 * i, 4));
      auto admitted = second->Admit(probe);
      REQUIRE(admitted.ok());
      if (admitted->decision != AdmitDecision::kAdmitted) break;
      probes.push_back(probe.id);
      auto got = second->Acquire(probe.id);
      if (!got.ok()) break;  // the fences hold the rest
      REQUIRE(std::find(got->blocks.begin(), got->blocks.end(), acq.blocks[0]) == got->blocks.end());
    }
    REQUIRE_FALSE(probes.empty());
    RequireInvariants(*second);
    for (const RequestId& id : probes) REQUIRE(second->Release(id, false).ok());
  };

  SECTION("the writer lifts first: the other fence writes it") {
    REQUIRE(second->LiftFences(resume.owner, 88) > 0);
    RequireInvariants(*second);
    RequireFenceWrites(*second, acq.blocks[0], gen.owner);
    probe_excludes_block0("probe1");
    REQUIRE(second->LiftFences(gen.owner, 77) > 0);
  }
  SECTION("the other lifts first: the writer keeps it") {
    REQUIRE(second->LiftFences(gen.owner, 77) > 0);
    RequireInvariants(*second);
    RequireFenceWrites(*second, acq.blocks[0], resume.owner);
    probe_excludes_block0("probe2");
    REQUIRE(second->LiftFences(resume.owner, 88) > 0);
  }
  SECTION("by time: the first to expire passes it on") {
    clock.Advance(absl::Seconds(10));
    REQUIRE(second->ExpireFences() > 0);
    RequireInvariants(*second);
    RequireFenceWrites(*second, acq.blocks[0], resume.owner);
    probe_excludes_block0("probe3");
    clock.Advance(absl::Seconds(10));
    REQUIRE(second->ExpireFences() == 0);
  }
  RequireInvariants(*second);
  RequireNoWriter(*second, acq.blocks[0]);
  const AcquireResult all = Start(*second, Spec("all", Seq(900, 64)));
  REQUIRE(Blocks(all).contains(acq.blocks[0]));
  RequireInvariants(*second);
}

TEST_CASE("A resumed request gives a block it took from a fence back to that fence", "[core][fences][ledger]") {
  FakeClock clock;
  auto old_cache = MakeCache(SmallOptions(16), &clock);
  RequestSpec gen = Spec("gen", Seq(0, 10), /*max_new=*/10);  // blocks 0 and 1 complete at the checkpoint
  const AcquireResult acq = Start(*old_cache, gen);
  REQUIRE(old_cache->Checkpoint(gen.id, Seq(0, 10), "state").ok());
  REQUIRE(old_cache->EndAllFenced(absl::Seconds(10), {{gen.owner, 77}}) == 1);
  auto fresh = MakeCache(SmallOptions(16), &clock);
  REQUIRE(fresh->ImportSnapshot(old_cache->ExportSnapshot()).ok());
  RequestSpec resume = Spec("resume", Seq(0, 10), /*max_new=*/10);
  resume.resume_from = gen.id;
  resume.owner = WorkerId("w-resumer");
  const AcquireResult r = Start(*fresh, resume);
  REQUIRE(r.cached_tokens == 8);
  REQUIRE(r.blocks[0] == acq.blocks[0]);
  REQUIRE(r.blocks[1] == acq.blocks[1]);
  RequireInvariants(*fresh);
  REQUIRE(fresh->Release(resume.id, false).ok());
  RequireInvariants(*fresh);
  // Still fenced: written by the fence again, never by nobody.
  for (BlockIndex b : acq.blocks) RequireFenceWrites(*fresh, b, gen.owner);
  REQUIRE(fresh->LiftFences(gen.owner, 77) > 0);
  RequireInvariants(*fresh);
  for (BlockIndex b : acq.blocks) RequireNoWriter(*fresh, b);
}

TEST_CASE("Blocks fenced at a start on kept memory are written by a fence of nobody", "[core][fences][ledger]") {
  FakeClock clock;
  auto old_cache = MakeCache(SmallOptions(16), &clock);
  RequestSpec gen = Spec("gen", Seq(0, 6), /*max_new=*/10);
  const AcquireResult acq = Start(*old_cache, gen);
  REQUIRE(old_cache->Checkpoint(gen.id, Seq(0, 6), "state").ok());
  REQUIRE(old_cache->Release(gen.id, false).ok());
  CacheSnapshot snap = old_cache->ExportSnapshot();
  snap.fences_known = false;
  auto fresh = MakeCache(SmallOptions(16), &clock);
  REQUIRE(fresh->ImportSnapshot(snap).ok());
  REQUIRE(fresh->FenceFreeBlocks(absl::Seconds(10)) == 15);
  RequireInvariants(*fresh);
  RequireNoWriter(*fresh, acq.blocks[0]);  // the checkpoint's complete block: nobody writes it
  for (BlockIndex b = 0; b < 16; ++b) {
    if (b != acq.blocks[0]) RequireFenceWrites(*fresh, b, WorkerId());
  }
  clock.Advance(absl::Seconds(10));
  REQUIRE(fresh->ExpireFences() == 0);
  RequireInvariants(*fresh);
  for (BlockIndex b = 0; b < 16; ++b) RequireNoWriter(*fresh, b);
}

TEST_CASE("The invariant checker sees a fenced block handed to a request", "[core][fences][ledger]") {
  FakeClock clock;
  auto cache = MakeCache(SmallOptions(16), &clock);
  RequestSpec live = Spec("live", Seq(0, 16));
  live.owner = WorkerId("w-lost");
  Start(*cache, live);
  REQUIRE(cache->FenceWorker(live.owner, 4242, absl::Seconds(10)) == 1);
  RequestSpec next = Spec("next", Seq(100, 4), /*max_new=*/8);  // room for 2 more blocks
  Start(*cache, next);
  RequireInvariants(*cache);
  REQUIRE(cache->HandFencedBlockForTesting(next.id).ok());
  const absl::Status s = cache->CheckInvariantsForTesting();
  INFO(s.ToString());
  REQUIRE(absl::IsInternal(s));
  REQUIRE(s.message().find("fenced block") != absl::string_view::npos);
}

}  // namespace
}  // namespace kvd
