// Chains continue past duplicates (kvd-reuse-2 item 1; docs/architecture.md, "Publish and
// duplicates"): requests that computed the same prefix at once each get their own blocks after it
// cached, in either order of publish, through Publish, End and steps, across checkpoints, resumes
// and a lost worker, with every outcome counted once and the invariant checker after every op.
#include <catch2/catch.hpp>

#include "server/core/kv_cache.h"
#include "tests/unit/core/test_util.h"

namespace kvd {
namespace {

using namespace kvd::testing;

int64_t Owned(const KvCache& cache) { return cache.Report().pools[0].owned_blocks; }

std::vector<BlockIndex> First(const std::vector<BlockIndex>& blocks, size_t n) {
  return std::vector<BlockIndex>(blocks.begin(), blocks.begin() + n);
}

// Two prompts sharing two blocks (8 tokens), then 9 tokens of their own: 4 full blocks and a
// partial one each.
const std::vector<Token> kShared = Seq(0, 8);

TEST_CASE("A chain continues past duplicates, in either order of publish", "[core][publish]") {
  FakeClock clock;
  auto cache = MakeCache(SmallOptions(), &clock);
  RequestSpec a = Spec("a", Concat(kShared, Seq(100, 9)));
  RequestSpec b = Spec("b", Concat(kShared, Seq(200, 9)), /*max_new=*/8);
  const AcquireResult ra = Start(*cache, a);
  const AcquireResult rb = Start(*cache, b);  // both miss: the shared blocks are computed twice
  const bool a_first = GENERATE(true, false);
  const RequestSpec& first = a_first ? a : b;
  const RequestSpec& second = a_first ? b : a;
  const AcquireResult& r1 = a_first ? ra : rb;
  const AcquireResult& r2 = a_first ? rb : ra;

  REQUIRE(PublishAll(*cache, first, first.prompt, r1).kept == 4);
  RequireInvariants(*cache);
  auto keeps = cache->Keeps(second.id, second.prompt, First(r2.blocks, 4));
  REQUIRE(keeps.ok());
  const std::vector<PublishOutcome> want = {PublishOutcome::kDuplicate, PublishOutcome::kDuplicate,
                                            PublishOutcome::kKept, PublishOutcome::kKept};
  REQUIRE(keeps->outcomes == want);
  auto pub = cache->Publish(second.id, second.prompt, First(r2.blocks, 4));
  REQUIRE(pub.ok());
  REQUIRE(pub->outcomes == want);
  REQUIRE(pub->kept == 2);
  RequireInvariants(*cache);
  CacheReport report = cache->Report();
  REQUIRE(report.duplicate_blocks == 2);
  REQUIRE(report.no_parent_blocks == 0);
  // The second request's table holds the cached blocks at the duplicates' positions; its own
  // copies stay its own (two partial blocks and two copies are owned).
  auto handle = cache->GetHandle(second.id);
  REQUIRE(handle.ok());
  REQUIRE(First(handle->blocks, 2) == First(r1.blocks, 2));
  REQUIRE(handle->blocks[2] == r2.blocks[2]);
  REQUIRE(Owned(*cache) == 4);
  // Both prompts are found whole (less the last token) while both requests run.
  REQUIRE(*cache->PeekPrefixLen(Namespace{.pool = "m"}, a.prompt) == 16);
  REQUIRE(*cache->PeekPrefixLen(Namespace{.pool = "m"}, b.prompt) == 16);

  // A repeat publish, naming the own copies (the engine's table) or the cached blocks (the
  // handle's), answers already_cached and counts nothing again.
  for (const std::vector<BlockIndex>& named : {First(r2.blocks, 4), First(handle->blocks, 4)}) {
    auto again = cache->Publish(second.id, second.prompt, named);
    REQUIRE(again.ok());
    REQUIRE(again->outcomes == std::vector<PublishOutcome>(4, PublishOutcome::kAlreadyCached));
  }
  // Another block at a copy's position is refused, changing nothing.
  std::vector<BlockIndex> wrong = First(r2.blocks, 4);
  wrong[1] = r1.blocks[2];
  auto refused = cache->Publish(second.id, second.prompt, wrong);
  REQUIRE(absl::IsInvalidArgument(refused.status()));
  REQUIRE(cache->Report().duplicate_blocks == 2);
  RequireInvariants(*cache);

  // b grows within its reservation, which covers its copies while it runs.
  if (a_first) {
    auto grown = cache->Extend(b.id, 8);
    REQUIRE(grown.ok());
    RequireInvariants(*cache);
  }
  auto ended = cache->End(second.id, 4, {}, true);
  INFO(ended.status().ToString());
  REQUIRE(ended.ok());
  REQUIRE(ended->outcomes == std::vector<PublishOutcome>(4, PublishOutcome::kAlreadyCached));
  RequireInvariants(*cache);
  REQUIRE(cache->Release(first.id, true).ok());
  RequireInvariants(*cache);
  REQUIRE(Owned(*cache) == 0);  // the copies were freed with their requests
  REQUIRE(cache->Report().duplicate_blocks == 2);
  REQUIRE(*cache->PeekPrefixLen(Namespace{.pool = "m"}, a.prompt) == 16);
  REQUIRE(*cache->PeekPrefixLen(Namespace{.pool = "m"}, b.prompt) == 16);
  // Evicting everything goes leaf first through both chains and leaves nothing behind.
  REQUIRE(cache->ClearCache() == 6);
  RequireInvariants(*cache);
}

TEST_CASE("End continues a chain its Publish stopped for want of budget", "[core][publish]") {
  FakeClock clock;
  auto cache = MakeCache(SmallOptions(32), &clock);
  RequestSpec a = Spec("a", Concat(kShared, Seq(100, 9)));
  RequestSpec b = Spec("b", Concat(kShared, Seq(200, 9)));
  const AcquireResult ra = Start(*cache, a);
  const AcquireResult rb = Start(*cache, b);
  REQUIRE(cache->Admit(Spec("filler", Seq(1000, 88))).value().decision == AdmitDecision::kAdmitted);  // the rest
  REQUIRE(PublishAll(*cache, a, a.prompt, ra).kept == 4);
  // No room to hold b's copies while it runs: the chain stops at the first duplicate.
  auto pub = cache->Publish(b.id, b.prompt, First(rb.blocks, 4));
  REQUIRE(pub.ok());
  REQUIRE(pub->outcomes == std::vector<PublishOutcome>{PublishOutcome::kDuplicate, PublishOutcome::kNoParent,
                                                       PublishOutcome::kNoParent, PublishOutcome::kNoParent});
  REQUIRE(cache->Report().duplicate_blocks == 1);
  REQUIRE(cache->Report().no_parent_blocks == 3);
  RequireInvariants(*cache);
  // End releases the request under the same lock: the copies need no room, the chain continues.
  auto ended = cache->End(b.id, 4, {}, true);
  REQUIRE(ended.ok());
  REQUIRE(ended->outcomes == std::vector<PublishOutcome>{PublishOutcome::kDuplicate, PublishOutcome::kDuplicate,
                                                         PublishOutcome::kKept, PublishOutcome::kKept});
  REQUIRE(ended->kept == 2);
  CacheReport report = cache->Report();
  REQUIRE(report.duplicate_blocks == 1);  // each position counted once, at its first publish
  REQUIRE(report.no_parent_blocks == 3);
  RequireInvariants(*cache);
  REQUIRE(*cache->PeekPrefixLen(Namespace{.pool = "m"}, b.prompt) == 16);
  REQUIRE(Owned(*cache) == 1);  // a's partial block
}

TEST_CASE("A checkpoint holds the cached duplicate, and a resume continues from it", "[core][publish]") {
  FakeClock clock;
  auto cache = MakeCache(SmallOptions(), &clock);
  RequestSpec a = Spec("a", Concat(kShared, Seq(100, 9)));
  RequestSpec b = Spec("b", Concat(kShared, Seq(200, 9)), /*max_new=*/4);
  const AcquireResult ra = Start(*cache, a);
  const AcquireResult rb = Start(*cache, b);
  const bool checkpoint_first = GENERATE(true, false);
  if (checkpoint_first) REQUIRE(cache->Checkpoint(b.id, b.prompt, "state").ok());
  REQUIRE(PublishAll(*cache, a, a.prompt, ra).kept == 4);
  REQUIRE(PublishAll(*cache, b, b.prompt, rb).kept == 2);
  if (!checkpoint_first) REQUIRE(cache->Checkpoint(b.id, b.prompt, "state").ok());
  RequireInvariants(*cache);
  REQUIRE(cache->Release(a.id, true).ok());
  REQUIRE(cache->Release(b.id, /*completed=*/false).ok());  // the checkpoint stays, orphaned
  RequireInvariants(*cache);
  REQUIRE(Owned(*cache) == 1);  // the checkpoint's partial block: b's copies are gone
  // What the checkpoint holds (a's shared blocks and b's own) is not evictable.
  cache->ClearCache();
  RequireInvariants(*cache);
  REQUIRE(*cache->PeekPrefixLen(Namespace{.pool = "m"}, b.prompt) == 16);

  RequestSpec resume = Spec("b2", b.prompt, /*max_new=*/4);
  resume.resume_from = b.id;
  const AcquireResult rr = Start(*cache, resume);
  REQUIRE(rr.resumed);
  REQUIRE(First(rr.blocks, 2) == First(ra.blocks, 2));
  REQUIRE(rr.blocks[2] == rb.blocks[2]);
  RequireInvariants(*cache);
  REQUIRE(cache->Release(resume.id, true).ok());
  RequireInvariants(*cache);
  REQUIRE(Owned(*cache) == 0);
}

TEST_CASE("A preempted request's checkpoint crosses a handoff holding the cached duplicate", "[core][publish]") {
  FakeClock clock;
  auto cache = MakeCache(SmallOptions(), &clock);
  RequestSpec a = Spec("a", Concat(kShared, Seq(100, 9)));
  RequestSpec b = Spec("b", Concat(kShared, Seq(200, 9)), /*max_new=*/4);
  const AcquireResult ra = Start(*cache, a);
  const AcquireResult rb = Start(*cache, b);
  REQUIRE(PublishAll(*cache, a, a.prompt, ra).kept == 4);
  REQUIRE(PublishAll(*cache, b, b.prompt, rb).kept == 2);
  std::vector<StepOp> ops(1);
  ops[0].kind = StepOpKind::kPreempt;
  ops[0].id = b.id;
  ops[0].token_ids = b.prompt;
  ops[0].engine_state = "sampler";
  std::vector<StepOpResult> preempted = cache->Step(b.owner, b.owner, std::move(ops), {}, nullptr);
  REQUIRE(preempted[0].status.ok());
  REQUIRE(cache->Release(a.id, true).ok());
  RequireInvariants(*cache);

  const CacheSnapshot snap = cache->ExportSnapshot();
  auto fresh = MakeCache(SmallOptions(), &clock);
  REQUIRE(fresh->ImportSnapshot(snap).ok());
  RequireInvariants(*fresh);
  RequestSpec resume = Spec("b2", b.prompt, /*max_new=*/4);
  resume.resume_from = b.id;
  const AcquireResult rr = Start(*fresh, resume);
  REQUIRE(rr.resumed);
  REQUIRE(First(rr.blocks, 2) == First(ra.blocks, 2));  // blocks keep their indices across
  RequireInvariants(*fresh);
  REQUIRE(fresh->Release(resume.id, true).ok());
  REQUIRE(Owned(*fresh) == 0);
  REQUIRE(*fresh->PeekPrefixLen(Namespace{.pool = "m"}, b.prompt) == 16);
  RequireInvariants(*fresh);
}

TEST_CASE("A lost worker's copies of duplicates are fenced and then freed", "[core][publish]") {
  FakeClock clock;
  auto cache = MakeCache(SmallOptions(), &clock);
  RequestSpec a = Spec("a", Concat(kShared, Seq(100, 9)));
  RequestSpec b = Spec("b", Concat(kShared, Seq(200, 9)));
  b.owner = WorkerId("w-lost");
  const AcquireResult ra = Start(*cache, a);
  const AcquireResult rb = Start(*cache, b);
  REQUIRE(PublishAll(*cache, a, a.prompt, ra).kept == 4);
  REQUIRE(PublishAll(*cache, b, b.prompt, rb).kept == 2);
  REQUIRE(cache->FenceWorker(b.owner, 4242, absl::Seconds(10)) == 1);
  RequireInvariants(*cache);
  // Its copies and its partial block stay fenced (its process may still be writing).
  REQUIRE(cache->WriterForTesting(0, rb.blocks[0]).has_value());
  REQUIRE(cache->WriterForTesting(0, rb.blocks[0])->kind == OwnerKind::kFence);
  REQUIRE(cache->LiftFencesOfGone(4242) == 3);
  RequireInvariants(*cache);
  REQUIRE(cache->Release(a.id, true).ok());
  REQUIRE(Owned(*cache) == 0);
  REQUIRE(*cache->PeekPrefixLen(Namespace{.pool = "m"}, b.prompt) == 16);
  RequireInvariants(*cache);
}

TEST_CASE("Sixteen requests ended in one step each leave their own blocks cached", "[core][publish][step]") {
  FakeClock clock;
  auto cache = MakeCache(SmallOptions(128), &clock);
  std::vector<CacheEvent> stored;
  cache->AddEventListener([&](const CacheEvent& e) {
    if (e.kind == CacheEventKind::kStored) stored.push_back(e);
  });
  std::vector<RequestSpec> specs;
  for (int i = 0; i < 16; ++i) {
    specs.push_back(Spec("r" + std::to_string(i), Concat(kShared, Seq(1000 * (i + 1), 9))));
    Start(*cache, specs.back());  // all miss: none has published yet
  }
  std::vector<StepOp> ops;
  for (const RequestSpec& s : specs) {
    StepOp op;
    op.kind = StepOpKind::kEnd;
    op.id = s.id;
    op.num_blocks = 4;
    op.completed = true;
    ops.push_back(std::move(op));
  }
  std::vector<StepOpResult> results = cache->Step(WorkerId("w0"), WorkerId("w0"), std::move(ops), {}, nullptr);
  REQUIRE(results.size() == 16);
  REQUIRE(results[0].status.ok());
  REQUIRE(results[0].publish.kept == 4);
  for (size_t i = 1; i < results.size(); ++i) {
    REQUIRE(results[i].status.ok());
    REQUIRE(results[i].publish.outcomes ==
            std::vector<PublishOutcome>{PublishOutcome::kDuplicate, PublishOutcome::kDuplicate,
                                        PublishOutcome::kKept, PublishOutcome::kKept});
  }
  RequireInvariants(*cache);
  for (const RequestSpec& s : specs) REQUIRE(*cache->PeekPrefixLen(Namespace{.pool = "m"}, s.prompt) == 16);
  CacheReport report = cache->Report();
  REQUIRE(report.duplicate_blocks == 30);
  REQUIRE(report.no_parent_blocks == 0);
  REQUIRE(report.pools[0].owned_blocks == 0);
  // Events: 2 shared blocks, then 2 of each request's own, the first of which names the second
  // shared block as its parent (the router sees every continued chain hang off the cached one).
  REQUIRE(stored.size() == 2 + 16 * 2);
  const BlockKey shared_tail = stored[1].key;
  int children = 0;
  for (const CacheEvent& e : stored) children += e.has_parent && e.parent_key == shared_tail ? 1 : 0;
  REQUIRE(children == 16);
}

}  // namespace
}  // namespace kvd
