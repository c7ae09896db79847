#include "server/core/kv_cache.h"

#include <limits>

#include <catch2/catch.hpp>

#include "absl/container/flat_hash_set.h"
#include "tests/unit/core/test_util.h"

namespace kvd {
namespace {

using namespace kvd::testing;

TEST_CASE("A published prefix is reused by the next request, capped to leave one token", "[core][cache]") {
  FakeClock clock;
  auto cache = MakeCache(SmallOptions(), &clock);
  auto prompt = Seq(100, 12);  // three full blocks
  RequestSpec a = Spec("a", prompt);
  AcquireResult acq = Start(*cache, a);
  REQUIRE(acq.cached_tokens == 0);
  REQUIRE(acq.blocks.size() == 3);
  REQUIRE(PublishAll(*cache, a, prompt, acq).kept == 3);
  REQUIRE(cache->Release(a.id, true).ok());

  // Same prompt: all three blocks are cached, but one token must be left to compute.
  RequestSpec b = Spec("b", prompt);
  AcquireResult hit = Start(*cache, b);
  REQUIRE(hit.cached_tokens == 8);
  REQUIRE(hit.blocks[0] == acq.blocks[0]);
  REQUIRE(hit.blocks[1] == acq.blocks[1]);
  REQUIRE(hit.blocks[2] != acq.blocks[2]);  // the last block is fresh and writable

  // A longer prompt with the same prefix reuses all three.
  RequestSpec c = Spec("c", Concat(prompt, Seq(5, 3)));
  AcquireResult longer = Start(*cache, c);
  REQUIRE(longer.cached_tokens == 12);
  REQUIRE(longer.blocks.size() == 4);
  RequireInvariants(*cache);

  auto report = cache->Report();
  REQUIRE(report.lookups == 3);
  REQUIRE(report.hit_tokens == 20);
  REQUIRE(report.miss_tokens == 12 + 4 + 3);
  REQUIRE(*cache->PeekPrefixLen(Namespace{.pool = "m"}, Concat(prompt, {1})) == 12);
}

TEST_CASE("Writable blocks belong to exactly one request; published blocks are read-only", "[core][cache][invariant1]") {
  FakeClock clock;
  auto cache = MakeCache(SmallOptions(), &clock);
  auto prefix = Seq(0, 8);
  RequestSpec a = Spec("a", Concat(prefix, Seq(50, 4)));
  AcquireResult ra = Start(*cache, a);
  PublishAll(*cache, a, a.prompt, ra);
  RequestSpec b = Spec("b", Concat(prefix, Seq(60, 4)));
  AcquireResult rb = Start(*cache, b);
  REQUIRE(rb.cached_tokens == 8);
  // b's writable blocks (from cached_tokens on) are disjoint from everything a holds.
  absl::flat_hash_set<BlockIndex> a_blocks(ra.blocks.begin(), ra.blocks.end());
  for (size_t i = rb.cached_tokens / 4; i < rb.blocks.size(); ++i) {
    REQUIRE_FALSE(a_blocks.contains(rb.blocks[i]));
  }
  // b cannot publish a's blocks as its own.
  auto bad = cache->Publish(b.id, b.prompt, ra.blocks);
  REQUIRE(bad.status().code() == absl::StatusCode::kInvalidArgument);
  RequireInvariants(*cache);
}

TEST_CASE("The shared prefix of two released requests is evicted after their tails", "[core][cache][invariant3]") {
  FakeClock clock;
  auto o = SmallOptions(6);
  auto cache = MakeCache(o, &clock);
  auto prefix = Seq(0, 4);
  RequestSpec a = Spec("a", Concat(prefix, Seq(10, 5)));  // blocks: P, A1, (partial)
  RequestSpec b = Spec("b", Concat(prefix, Seq(20, 5)));  // blocks: P, B1, (partial)
  AcquireResult ra = Start(*cache, a);
  PublishAll(*cache, a, a.prompt, ra);
  AcquireResult rb = Start(*cache, b);
  REQUIRE(rb.cached_tokens == 4);
  PublishAll(*cache, b, b.prompt, rb);
  REQUIRE(cache->Release(a.id, true).ok());
  REQUIRE(cache->Release(b.id, true).ok());
  REQUIRE(cache->Report().pools[0].evictable_blocks == 3);

  // Each single-block request needing fresh blocks forces evictions one by one.
  std::vector<uint64_t> removed;
  cache->AddEventListener([&](const CacheEvent& e) {
    if (e.kind == CacheEventKind::kRemoved) removed.push_back(e.block);
  });
  RequestSpec big = Spec("big", Seq(1000, 6 * 4));
  big.max_new_tokens = 0;
  Start(*cache, big);  // needs all 6 blocks: evicts A1, B1, then P
  REQUIRE(removed.size() == 3);
  REQUIRE(removed[2] == ra.blocks[0]);  // the shared head goes last
  REQUIRE((removed[0] == ra.blocks[1] || removed[0] == rb.blocks[1]));
  RequireInvariants(*cache);
}

TEST_CASE("Least recently used leaves are evicted first", "[core][cache][invariant3]") {
  FakeClock clock;
  auto cache = MakeCache(SmallOptions(4), &clock);
  RequestSpec a = Spec("a", Seq(0, 5));
  RequestSpec b = Spec("b", Seq(100, 5));
  AcquireResult ra = Start(*cache, a);
  PublishAll(*cache, a, a.prompt, ra);
  REQUIRE(cache->Release(a.id, true).ok());
  clock.Advance(absl::Seconds(1));
  AcquireResult rb = Start(*cache, b);
  PublishAll(*cache, b, b.prompt, rb);
  REQUIRE(cache->Release(b.id, true).ok());
  clock.Advance(absl::Seconds(1));
  // Touch a's prefix again: b's block is now the least recently used.
  RequestSpec a2 = Spec("a2", Seq(0, 5));
  REQUIRE(Start(*cache, a2).cached_tokens == 4);
  REQUIRE(cache->Release(a2.id, true).ok());
  RequestSpec c = Spec("c", Seq(500, 12));  // 3 blocks: 2 free + 1 eviction
  Start(*cache, c);
  REQUIRE(*cache->PeekPrefixLen(Namespace{.pool = "m"}, a.prompt) == 4);
  REQUIRE(*cache->PeekPrefixLen(Namespace{.pool = "m"}, b.prompt) == 0);
}

TEST_CASE("A failed allocation leaves reference counts, budget and index unchanged", "[core][cache][invariant4]") {
  FakeClock clock;
  auto cache = MakeCache(SmallOptions(4), &clock);
  RequestSpec a = Spec("a", Seq(0, 9), /*max_new=*/0);  // 3 blocks reserved
  AcquireResult ra = Start(*cache, a);
  PublishAll(*cache, a, a.prompt, ra);
  RequestSpec b = Spec("b", Seq(100, 3));  // 1 block: the budget is now full
  Start(*cache, b);
  auto before = cache->Report();
  auto handles_before = cache->ListHandles();

  // Extending past the reservation needs budget that is not there.
  auto ext = cache->Extend(a.id, 4);
  REQUIRE(ext.status().code() == absl::StatusCode::kResourceExhausted);
  // A new request has to wait.
  auto c = cache->Admit(Spec("c", Seq(200, 3)));
  REQUIRE(c.ok());
  REQUIRE(c->decision == AdmitDecision::kWait);

  auto after = cache->Report();
  REQUIRE(after.reserved_bytes == before.reserved_bytes);
  REQUIRE(after.pools[0].free_blocks == before.pools[0].free_blocks);
  REQUIRE(after.pools[0].cached_blocks == before.pools[0].cached_blocks);
  REQUIRE(after.indexed_blocks == before.indexed_blocks);
  auto handles_after = cache->ListHandles();
  REQUIRE(handles_after.size() == handles_before.size());
  for (size_t i = 0; i < handles_after.size(); ++i) {
    REQUIRE(handles_after[i].blocks == handles_before[i].blocks);
    REQUIRE(handles_after[i].num_tokens == handles_before[i].num_tokens);
  }
  REQUIRE(after.waited == 1);
  RequireInvariants(*cache);
}

TEST_CASE("Admission reserves prompt plus max_new_tokens and never exceeds the budget", "[core][cache][invariant6]") {
  FakeClock clock;
  auto cache = MakeCache(SmallOptions(8), &clock);
  auto a = cache->Admit(Spec("a", Seq(0, 10), 6));  // 16 tokens = 4 blocks
  REQUIRE(a->decision == AdmitDecision::kAdmitted);
  REQUIRE(a->projected_bytes == 4 * 64);
  REQUIRE(cache->Fits(Spec("b", Seq(0, 16)))->decision == AdmitDecision::kAdmitted);
  REQUIRE(cache->Fits(Spec("b", Seq(0, 17)))->decision == AdmitDecision::kWait);
  REQUIRE(cache->Report().reserved_bytes == 4 * 64);  // Fits held nothing
  REQUIRE(cache->Admit(Spec("b", Seq(0, 16)))->decision == AdmitDecision::kAdmitted);
  REQUIRE(cache->Admit(Spec("c", Seq(0, 1)))->decision == AdmitDecision::kWait);
  REQUIRE(cache->Report().reserved_bytes == cache->Report().budget_bytes);
  // Cached, unreferenced blocks do not count against admission.
  REQUIRE(cache->Acquire(RequestId("a")).ok());
  REQUIRE(cache->Release(RequestId("a"), true).ok());
  REQUIRE(cache->Admit(Spec("c", Seq(0, 1)))->decision == AdmitDecision::kAdmitted);
  RequireInvariants(*cache);
}

TEST_CASE("A different cache_salt or adapter is a full miss", "[core][cache][invariant5]") {
  FakeClock clock;
  auto cache = MakeCache(SmallOptions(), &clock);
  RequestSpec a = Spec("a", Seq(0, 13));
  a.ns.cache_salt = "tenant-a";
  PublishAll(*cache, a, a.prompt, Start(*cache, a));
  RequestSpec b = Spec("b", Seq(0, 13));
  b.ns.cache_salt = "tenant-b";
  REQUIRE(Start(*cache, b).cached_tokens == 0);
  RequestSpec c = Spec("c", Seq(0, 13));
  c.ns.cache_salt = "tenant-a";
  c.ns.adapter = "lora";
  REQUIRE(Start(*cache, c).cached_tokens == 0);
  RequestSpec d = Spec("d", Seq(0, 13));
  d.ns.cache_salt = "tenant-a";
  REQUIRE(Start(*cache, d).cached_tokens == 12);
  RequireInvariants(*cache);
}

TEST_CASE("An interrupted generation resumes from its checkpoint in another request", "[core][cache][checkpoint]") {
  FakeClock clock;
  auto cache = MakeCache(SmallOptions(), &clock);
  auto prompt = Seq(0, 6);
  RequestSpec a = Spec("gen", prompt, /*max_new=*/10);
  AcquireResult ra = Start(*cache, a);
  auto ext = cache->Extend(a.id, 3);  // 9 tokens: 3 blocks
  REQUIRE(ext.ok());
  REQUIRE(ext->size() == 1);
  auto tokens = Concat(prompt, {900, 901, 902});
  REQUIRE(cache->Checkpoint(a.id, tokens, "sampler-state").ok());
  auto held = cache->GetHandle(a.id);
  REQUIRE(held->has_checkpoint);
  auto table = held->blocks;
  REQUIRE(cache->Release(a.id, /*completed=*/false).ok());
  REQUIRE(cache->Report().orphaned_checkpoints == 1);
  RequireInvariants(*cache);

  RequestSpec b = Spec("gen2", prompt, 10);
  b.resume_from = RequestId("gen");
  AcquireResult rb = Start(*cache, b);
  REQUIRE(rb.resumed);
  REQUIRE(rb.resumed_tokens == tokens);
  REQUIRE(rb.engine_state == "sampler-state");
  REQUIRE(rb.blocks == table);  // the same blocks: nothing recomputed, nothing copied
  REQUIRE(rb.cached_tokens == 9);
  REQUIRE(cache->Report().orphaned_checkpoints == 0);
  RequireInvariants(*cache);

  // A completed release removes the checkpoint; nothing resumes it afterwards.
  REQUIRE(cache->Checkpoint(b.id, tokens, "s2").ok());
  REQUIRE(cache->Release(b.id, /*completed=*/true).ok());
  RequestSpec c = Spec("gen3", prompt, 10);
  c.resume_from = RequestId("gen2");
  REQUIRE_FALSE(Start(*cache, c).resumed);
  RequireInvariants(*cache);
}

TEST_CASE("Resume is refused across namespaces", "[core][cache][checkpoint]") {
  FakeClock clock;
  auto cache = MakeCache(SmallOptions(), &clock);
  RequestSpec a = Spec("gen", Seq(0, 6), 4);
  Start(*cache, a);
  REQUIRE(cache->Checkpoint(a.id, a.prompt, "").ok());
  REQUIRE(cache->Release(a.id, false).ok());
  RequestSpec b = Spec("other", Seq(0, 6), 4);
  b.ns.cache_salt = "tenant";
  b.resume_from = a.id;
  REQUIRE(cache->Admit(b).ok());
  REQUIRE(cache->Acquire(b.id).status().code() == absl::StatusCode::kFailedPrecondition);
  REQUIRE(cache->Report().orphaned_checkpoints == 1);
  RequireInvariants(*cache);
}

TEST_CASE("Orphaned checkpoints are bounded by their budget and TTL", "[core][cache][checkpoint]") {
  FakeClock clock;
  auto o = SmallOptions(32);
  o.checkpoint_budget_bytes = 4 * 64;  // four blocks
  o.checkpoint_ttl = absl::Minutes(1);
  auto cache = MakeCache(o, &clock);
  for (int i = 0; i < 3; ++i) {
    RequestSpec s = Spec("g" + std::to_string(i), Seq(i * 100, 6), 2);  // 2 blocks each
    Start(*cache, s);
    REQUIRE(cache->Checkpoint(s.id, s.prompt, "").ok());
    REQUIRE(cache->Release(s.id, false).ok());
    clock.Advance(absl::Seconds(1));
  }
  auto r = cache->Report();
  REQUIRE(r.orphaned_checkpoints == 2);  // the oldest was dropped to make room
  REQUIRE(r.checkpoint_bytes == 4 * 64);
  RequireInvariants(*cache);
  clock.Advance(absl::Minutes(2));
  GcStats gc = cache->Gc();
  REQUIRE(gc.checkpoints_dropped == 2);
  REQUIRE(cache->Report().orphaned_checkpoints == 0);
  REQUIRE(cache->Report().reserved_bytes == 0);
  RequireInvariants(*cache);
}

TEST_CASE("Gc never frees a referenced block", "[core][cache][invariant2]") {
  FakeClock clock;
  auto cache = MakeCache(SmallOptions(), &clock);
  RequestSpec a = Spec("a", Seq(0, 9));
  AcquireResult ra = Start(*cache, a);
  PublishAll(*cache, a, a.prompt, ra);
  RequestSpec b = Spec("b", Seq(500, 9));
  PublishAll(*cache, b, b.prompt, Start(*cache, b));
  REQUIRE(cache->Release(b.id, true).ok());
  GcStats gc = cache->Gc();
  REQUIRE(gc.blocks_freed == 2);  // b's two published blocks
  REQUIRE(*cache->PeekPrefixLen(Namespace{.pool = "m"}, a.prompt) == 8);
  REQUIRE(cache->Report().pools[0].cached_blocks == 2);
  REQUIRE(cache->ClearCache() == 0);
  REQUIRE(cache->Boundary() == 0);
  REQUIRE(*cache->PeekPrefixLen(Namespace{.pool = "m"}, a.prompt) == 8);
  RequireInvariants(*cache);
}

TEST_CASE("Gc with an idle age keeps recently used blocks", "[core][cache]") {
  FakeClock clock;
  auto cache = MakeCache(SmallOptions(), &clock);
  RequestSpec a = Spec("a", Seq(0, 5));
  PublishAll(*cache, a, a.prompt, Start(*cache, a));
  REQUIRE(cache->Release(a.id, true).ok());
  clock.Advance(absl::Minutes(10));
  RequestSpec b = Spec("b", Seq(100, 5));
  PublishAll(*cache, b, b.prompt, Start(*cache, b));
  REQUIRE(cache->Release(b.id, true).ok());
  REQUIRE(cache->Gc(absl::Minutes(5)).blocks_freed == 1);
  REQUIRE(*cache->PeekPrefixLen(Namespace{.pool = "m"}, b.prompt) == 4);
  REQUIRE(*cache->PeekPrefixLen(Namespace{.pool = "m"}, a.prompt) == 0);
}

TEST_CASE("Boundary trims unreferenced cache from the high to the low watermark", "[core][cache]") {
  FakeClock clock;
  auto o = SmallOptions(10);
  o.boundary_high_watermark = 0.8;
  o.boundary_low_watermark = 0.5;
  auto cache = MakeCache(o, &clock);
  RequestSpec a = Spec("a", Seq(0, 37));  // 10 blocks, 9 full
  PublishAll(*cache, a, a.prompt, Start(*cache, a));
  REQUIRE(cache->Release(a.id, true).ok());
  REQUIRE(cache->Report().pools[0].free_blocks == 1);
  REQUIRE(cache->Boundary() == 4);  // 9 used -> 5 used
  REQUIRE(cache->Report().pools[0].free_blocks == 5);
  REQUIRE(cache->Boundary() == 0);  // below the high watermark now
  REQUIRE(*cache->PeekPrefixLen(Namespace{.pool = "m"}, a.prompt) == 20);  // tail went first
  RequireInvariants(*cache);
}

TEST_CASE("Duplicate publishes keep the block already cached", "[core][cache]") {
  FakeClock clock;
  auto cache = MakeCache(SmallOptions(), &clock);
  auto prompt = Seq(0, 9);
  RequestSpec a = Spec("a", prompt);
  RequestSpec b = Spec("b", prompt);
  AcquireResult ra = Start(*cache, a);
  AcquireResult rb = Start(*cache, b);  // both miss: computed twice
  REQUIRE(PublishAll(*cache, a, prompt, ra).kept == 2);
  std::vector<BlockIndex> b_blocks(rb.blocks.begin(), rb.blocks.begin() + 2);
  auto keeps = cache->Keeps(b.id, prompt, b_blocks);
  REQUIRE(keeps.ok());
  // The chain continues past the first duplicate: the second block is one too (kvd-reuse-2), not
  // no_parent as before.
  REQUIRE(keeps->outcomes[0] == PublishOutcome::kDuplicate);
  REQUIRE(keeps->outcomes[1] == PublishOutcome::kDuplicate);
  auto pub = cache->Publish(b.id, prompt, b_blocks);
  REQUIRE(pub->outcomes == keeps->outcomes);
  REQUIRE(pub->kept == 0);
  REQUIRE(cache->Report().duplicate_blocks == 2);
  REQUIRE(cache->Report().no_parent_blocks == 0);
  RequireInvariants(*cache);
  REQUIRE(cache->Release(b.id, true).ok());  // b's private copies are freed
  REQUIRE(cache->Report().pools[0].owned_blocks == 1);  // only a's partial block
  RequireInvariants(*cache);
}

TEST_CASE("Keeps predicts Publish and changes nothing", "[core][cache]") {
  FakeClock clock;
  auto cache = MakeCache(SmallOptions(), &clock);
  RequestSpec a = Spec("a", Seq(0, 9));
  AcquireResult ra = Start(*cache, a);
  std::vector<BlockIndex> blocks(ra.blocks.begin(), ra.blocks.begin() + 2);
  auto keeps = cache->Keeps(a.id, a.prompt, blocks);
  REQUIRE(keeps->kept == 2);
  REQUIRE(cache->Report().indexed_blocks == 0);
  REQUIRE(cache->events().last_sequence() == 0);
  REQUIRE(cache->Publish(a.id, a.prompt, blocks)->kept == 2);
  REQUIRE(cache->Keeps(a.id, a.prompt, blocks)->outcomes[0] == PublishOutcome::kAlreadyCached);
}

TEST_CASE("Bad input gets a clear status and changes nothing", "[core][cache][errors]") {
  FakeClock clock;
  auto cache = MakeCache(SmallOptions(), &clock);
  RequestSpec ok = Spec("ok", Seq(0, 9), 4);
  AcquireResult acq = Start(*cache, ok);
  auto before = cache->Report();
  using C = absl::StatusCode;

  REQUIRE(cache->Admit(Spec("x", Seq(0, 4), 0, "nope")).status().code() == C::kNotFound);
  REQUIRE(cache->Admit(Spec("x", {})).status().code() == C::kInvalidArgument);
  REQUIRE(cache->Admit(Spec("", Seq(0, 4))).status().code() == C::kInvalidArgument);
  REQUIRE(cache->Admit(Spec(std::string(300, 'x'), Seq(0, 4))).status().code() == C::kInvalidArgument);
  REQUIRE(cache->Admit(Spec("x", Seq(0, 4), -1)).status().code() == C::kInvalidArgument);
  REQUIRE(cache->Admit(Spec("x", Seq(0, 250), 10)).status().code() == C::kOutOfRange);  // > max_model_len
  REQUIRE(cache->Admit(Spec("x", Seq(0, 200))).status().code() == C::kOutOfRange);      // > whole pool
  REQUIRE(cache->Admit(ok).status().code() == C::kAlreadyExists);
  REQUIRE(cache->Acquire(RequestId("ghost")).status().code() == C::kNotFound);
  REQUIRE(cache->Acquire(ok.id).status().code() == C::kFailedPrecondition);
  REQUIRE(cache->Extend(ok.id, -1).status().code() == C::kInvalidArgument);
  REQUIRE(cache->Extend(ok.id, 1000).status().code() == C::kOutOfRange);
  // Sums of wire values never wrap: INT64_MAX is out of range, not "wait" or a negative length.
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  REQUIRE(cache->Admit(Spec("x", Seq(0, 9), kMax)).status().code() == C::kOutOfRange);
  REQUIRE(cache->Admit(Spec("x", Seq(0, 9), kMax - 8)).status().code() == C::kOutOfRange);
  REQUIRE(cache->Fits(Spec("x", Seq(0, 9), kMax)).status().code() == C::kOutOfRange);
  REQUIRE(cache->Extend(ok.id, kMax).status().code() == C::kOutOfRange);
  REQUIRE(cache->Extend(ok.id, kMax - 8).status().code() == C::kOutOfRange);
  REQUIRE(cache->GetHandle(ok.id)->num_tokens == 9);
  // Publish: too many blocks, wrong blocks, short tokens, tokens past the positions, wrong tokens.
  REQUIRE(cache->Publish(ok.id, ok.prompt, {0, 1, 2, 3, 4}).status().code() == C::kInvalidArgument);
  REQUIRE(cache->Publish(ok.id, ok.prompt, {acq.blocks[1]}).status().code() == C::kInvalidArgument);
  REQUIRE(cache->Publish(ok.id, Seq(0, 3), {acq.blocks[0]}).status().code() == C::kInvalidArgument);
  REQUIRE(cache->Publish(ok.id, Seq(0, 12), {acq.blocks[0]}).status().code() == C::kInvalidArgument);
  REQUIRE(cache->Publish(ok.id, Seq(1, 8), {acq.blocks[0]}).status().code() == C::kInvalidArgument);
  REQUIRE(cache->Publish(RequestId("ghost"), ok.prompt, {}).status().code() == C::kNotFound);
  // Checkpoint: empty, past positions, oversized state.
  REQUIRE(cache->Checkpoint(ok.id, {}, "").code() == C::kInvalidArgument);
  REQUIRE(cache->Checkpoint(ok.id, Seq(0, 10), "").code() == C::kOutOfRange);
  REQUIRE(cache->Checkpoint(ok.id, ok.prompt, std::string(2 << 20, 'x')).code() == C::kInvalidArgument);
  REQUIRE(cache->CloseSession(SessionId("nope")).code() == C::kNotFound);
  REQUIRE(cache->GetHandle(RequestId("ghost")).status().code() == C::kNotFound);
  REQUIRE(cache->PeekPrefixLen(Namespace{.pool = "nope"}, Seq(0, 4)).status().code() == C::kNotFound);

  auto after = cache->Report();
  REQUIRE(after.reserved_bytes == before.reserved_bytes);
  REQUIRE(after.pools[0].free_blocks == before.pools[0].free_blocks);
  REQUIRE(after.indexed_blocks == before.indexed_blocks);
  REQUIRE(after.live_requests == 1);
  RequireInvariants(*cache);

  // A double release is refused the second time.
  REQUIRE(cache->Release(ok.id, true).ok());
  REQUIRE(cache->Release(ok.id, true).code() == C::kNotFound);
  RequireInvariants(*cache);
}

TEST_CASE("Invalid options are rejected before anything starts", "[core][cache][errors]") {
  FakeClock clock;
  CacheOptions none;
  REQUIRE(KvCache::Create(none, &clock).status().code() == absl::StatusCode::kInvalidArgument);
  auto dup = SmallOptions();
  dup.pools.push_back(dup.pools[0]);
  REQUIRE_FALSE(KvCache::Create(dup, &clock).ok());
  auto bad = SmallOptions();
  bad.pools[0].block_tokens = 0;
  REQUIRE_FALSE(KvCache::Create(bad, &clock).ok());
  auto wm = SmallOptions();
  wm.boundary_low_watermark = 0.95;
  REQUIRE_FALSE(KvCache::Create(wm, &clock).ok());
}

TEST_CASE("Index events carry increasing sequence numbers", "[core][cache][events]") {
  FakeClock clock;
  auto cache = MakeCache(SmallOptions(), &clock);
  std::vector<CacheEvent> seen;
  cache->AddEventListener([&](const CacheEvent& e) { seen.push_back(e); });
  RequestSpec a = Spec("a", Seq(0, 9));
  PublishAll(*cache, a, a.prompt, Start(*cache, a));
  REQUIRE(cache->Release(a.id, true).ok());
  REQUIRE(cache->Gc() .blocks_freed == 2);
  RequestSpec b = Spec("b", Seq(50, 5));
  PublishAll(*cache, b, b.prompt, Start(*cache, b));
  REQUIRE(cache->Release(b.id, true).ok());
  REQUIRE(cache->ClearCache() == 1);
  REQUIRE(seen.size() == 6);
  REQUIRE(seen[0].kind == CacheEventKind::kStored);
  REQUIRE_FALSE(seen[0].has_parent);
  REQUIRE(seen[1].has_parent);
  REQUIRE(seen[1].parent_key == seen[0].key);
  REQUIRE(seen[1].tokens == Seq(4, 4));
  REQUIRE(seen[2].kind == CacheEventKind::kRemoved);
  REQUIRE(seen[2].key == seen[1].key);  // tail removed first
  REQUIRE(seen[5].kind == CacheEventKind::kCleared);
  for (size_t i = 0; i < seen.size(); ++i) REQUIRE(seen[i].sequence == i + 1);
  REQUIRE(cache->events().last_sequence() == 6);
}

TEST_CASE("Pressure listeners hear the level change as the budget fills", "[core][cache][pressure]") {
  FakeClock clock;
  auto cache = MakeCache(SmallOptions(20), &clock);
  std::vector<PressureLevel> levels;
  cache->AddPressureListener([&](PressureLevel l, double) { levels.push_back(l); });
  REQUIRE(cache->Admit(Spec("a", Seq(0, 64)))->decision == AdmitDecision::kAdmitted);  // 16/20
  REQUIRE(cache->Admit(Spec("b", Seq(0, 12)))->decision == AdmitDecision::kAdmitted);  // 19/20
  REQUIRE(cache->Admit(Spec("c", Seq(0, 4)))->decision == AdmitDecision::kAdmitted);   // 20/20
  REQUIRE(levels.size() == 2);
  REQUIRE(levels[0] == PressureLevel::kHigh);
  REQUIRE(levels[1] == PressureLevel::kCritical);
  REQUIRE(cache->Release(RequestId("a"), true).ok());
  REQUIRE(levels.back() == PressureLevel::kNormal);
  REQUIRE(cache->pressure_level() == PressureLevel::kNormal);
}

TEST_CASE("ReleaseWorker releases every request of a dead worker as interrupted", "[core][cache][invariant7]") {
  FakeClock clock;
  auto cache = MakeCache(SmallOptions(), &clock);
  RequestSpec a = Spec("a", Seq(0, 9), 4);
  a.owner = WorkerId("dead");
  AcquireResult ra = Start(*cache, a);
  PublishAll(*cache, a, a.prompt, ra);
  REQUIRE(cache->Checkpoint(a.id, a.prompt, "st").ok());
  RequestSpec b = Spec("b", Seq(100, 5));
  b.owner = WorkerId("alive");
  Start(*cache, b);
  REQUIRE(cache->ReleaseWorker(WorkerId("dead")) == 1);
  auto r = cache->Report();
  REQUIRE(r.live_requests == 1);
  REQUIRE(r.orphaned_checkpoints == 1);
  REQUIRE(*cache->PeekPrefixLen(Namespace{.pool = "m"}, a.prompt) == 8);  // published blocks stay
  RequireInvariants(*cache);
}

TEST_CASE("Multiple pools share one budget but allocate separately", "[core][cache]") {
  FakeClock clock;
  auto o = SmallOptions(8);
  PoolGeometry g2 = o.pools[0];
  g2.name = "m2";
  g2.block_tokens = 8;
  o.pools.push_back(g2);  // 128-byte blocks
  o.budget_bytes = 8 * 64 + 2 * 128;
  auto cache = MakeCache(o, &clock);
  REQUIRE(cache->Admit(Spec("a", Seq(0, 16), 0, "m2"))->decision == AdmitDecision::kAdmitted);
  REQUIRE(cache->Admit(Spec("c", Seq(0, 32), 0, "m"))->decision == AdmitDecision::kAdmitted);
  // m2 has free blocks, but the global budget is spent.
  REQUIRE(cache->Admit(Spec("b", Seq(0, 1), 0, "m2"))->decision == AdmitDecision::kWait);
  REQUIRE(cache->Admit(Spec("d", Seq(0, 1), 0, "m"))->decision == AdmitDecision::kWait);
  auto acq = cache->Acquire(RequestId("a"));
  REQUIRE(acq->pool == 1);
  REQUIRE(acq->blocks.size() == 2);
  RequireInvariants(*cache);
}

}  // namespace
}  // namespace kvd

namespace kvd {
namespace {

using namespace kvd::testing;

TEST_CASE("Acquire names the live workers that published the reused blocks", "[core][cache]") {
  FakeClock clock;
  auto cache = MakeCache(SmallOptions(), &clock);
  RequestSpec a = Spec("a", Seq(0, 9));
  a.owner = WorkerId("writer-1");
  PublishAll(*cache, a, a.prompt, Start(*cache, a));
  RequestSpec b = Spec("b", Concat(Seq(0, 8), Seq(70, 5)));
  b.owner = WorkerId("writer-2");
  AcquireResult rb = Start(*cache, b);
  REQUIRE(rb.publishers == std::vector<WorkerId>{WorkerId("writer-1")});
  PublishAll(*cache, b, b.prompt, rb);  // adds block [70..73] published by writer-2
  RequestSpec c = Spec("c", Concat(Concat(Seq(0, 8), Seq(70, 4)), {1}));
  AcquireResult rc = Start(*cache, c);
  REQUIRE(rc.publishers == std::vector<WorkerId>{WorkerId("writer-1"), WorkerId("writer-2")});
  // A gone worker is no longer named (its event died with it).
  cache->ReleaseWorker(WorkerId("writer-1"));
  RequestSpec d = Spec("d", Seq(0, 9));
  REQUIRE(Start(*cache, d).publishers.empty());
  RequireInvariants(*cache);
}

}  // namespace
}  // namespace kvd

namespace kvd {
namespace {

using namespace kvd::testing;

CacheOptions SlruOptions(int64_t capacity) {
  CacheOptions o = SmallOptions(capacity);
  o.eviction_policy = EvictionPolicy::kSlru;
  o.slru_main_fraction = 0.5;
  o.slru_ghost_fraction = 4;
  return o;
}

TEST_CASE("SLRU keeps a reused block over a newer block that was never reused", "[core][cache][policy]") {
  FakeClock clock;
  auto cache = MakeCache(SlruOptions(4), &clock);
  const Namespace ns{.pool = "m"};
  RequestSpec a = Spec("a", Seq(0, 5));  // block A
  PublishAll(*cache, a, a.prompt, Start(*cache, a));
  REQUIRE(cache->Release(a.id, true).ok());
  RequestSpec a2 = Spec("a2", Seq(0, 5));  // reuses A: A moves to the main segment
  REQUIRE(Start(*cache, a2).cached_tokens == 4);
  REQUIRE(cache->Release(a2.id, true).ok());
  clock.Advance(absl::Seconds(1));
  RequestSpec b = Spec("b", Seq(100, 5));  // block B, newer, never reused
  PublishAll(*cache, b, b.prompt, Start(*cache, b));
  REQUIRE(cache->Release(b.id, true).ok());
  RequestSpec c = Spec("c", Seq(500, 12));  // needs 3 blocks: one eviction
  Start(*cache, c);
  // LRU would evict A (older); SLRU evicts B (probation) while main is within its share.
  REQUIRE(*cache->PeekPrefixLen(ns, a.prompt) == 4);
  REQUIRE(*cache->PeekPrefixLen(ns, b.prompt) == 0);
  RequireInvariants(*cache);
}

TEST_CASE("SLRU re-admits a block stored again soon after its eviction into the main segment", "[core][cache][policy]") {
  FakeClock clock;
  auto cache = MakeCache(SlruOptions(4), &clock);
  const Namespace ns{.pool = "m"};
  RequestSpec b = Spec("b", Seq(100, 5));
  PublishAll(*cache, b, b.prompt, Start(*cache, b));
  REQUIRE(cache->Release(b.id, true).ok());
  RequestSpec big = Spec("big", Seq(1000, 16));  // evicts B (remembered in the ghost list)
  Start(*cache, big);
  REQUIRE(cache->Release(big.id, true).ok());
  REQUIRE(*cache->PeekPrefixLen(ns, b.prompt) == 0);
  RequestSpec b2 = Spec("b2", Seq(100, 5));  // B computed and stored again: ghost hit -> main
  PublishAll(*cache, b2, b2.prompt, Start(*cache, b2));
  REQUIRE(cache->Release(b2.id, true).ok());
  clock.Advance(absl::Seconds(1));
  RequestSpec d = Spec("d", Seq(300, 5));  // newer, probation
  PublishAll(*cache, d, d.prompt, Start(*cache, d));
  REQUIRE(cache->Release(d.id, true).ok());
  RequestSpec c = Spec("c", Seq(500, 12));  // 3 blocks over 4 - (B, D + big's cached) ...
  Start(*cache, c);
  REQUIRE(*cache->PeekPrefixLen(ns, b.prompt) == 4);  // the re-admitted block survived
  RequireInvariants(*cache);
}

}  // namespace
}  // namespace kvd

namespace kvd {
namespace {

using namespace kvd::testing;

TEST_CASE("Per-worker limits refuse what would let one worker take the node", "[core][cache][limits]") {
  FakeClock clock;
  auto o = SmallOptions(32);
  o.max_requests_per_worker = 2;
  o.max_bytes_per_worker = 6 * 64;  // six blocks
  auto cache = MakeCache(o, &clock);
  RequestSpec a = Spec("a", Seq(0, 8));   // 2 blocks
  RequestSpec b = Spec("b", Seq(50, 8));  // 2 blocks
  REQUIRE(cache->Admit(a)->decision == AdmitDecision::kAdmitted);
  REQUIRE(cache->Admit(b)->decision == AdmitDecision::kAdmitted);
  auto third = cache->Admit(Spec("c", Seq(90, 4)));
  REQUIRE(third.status().code() == absl::StatusCode::kResourceExhausted);
  REQUIRE(third.status().message().find("max_requests_per_worker") != absl::string_view::npos);
  RequestSpec other = Spec("d", Seq(90, 4));
  other.owner = WorkerId("w1");
  REQUIRE(cache->Admit(other)->decision == AdmitDecision::kAdmitted);  // another worker is fine
  // Growing past the byte limit is refused and changes nothing.
  REQUIRE(cache->Acquire(a.id).ok());
  auto before = cache->GetHandle(a.id)->blocks;
  auto grown = cache->Extend(a.id, 12);  // 20 tokens = 5 blocks: 5 + 2 > 6
  REQUIRE(grown.status().code() == absl::StatusCode::kResourceExhausted);
  REQUIRE(grown.status().message().find("max_bytes_per_worker") != absl::string_view::npos);
  REQUIRE(cache->GetHandle(a.id)->blocks == before);
  REQUIRE(cache->Extend(a.id, 8).ok());  // 4 blocks: 4 + 2 = 6, at the limit
  REQUIRE(cache->Release(b.id, true).ok());
  REQUIRE(cache->Admit(Spec("c", Seq(90, 4)))->decision == AdmitDecision::kAdmitted);
  RequireInvariants(*cache);
}

TEST_CASE("Checkpoint state is bounded per worker and in total", "[core][cache][limits][checkpoint]") {
  FakeClock clock;
  auto o = SmallOptions(64);
  o.checkpoint_state_bytes = 10'000;
  o.max_checkpoint_state_bytes_per_worker = 6'000;
  auto cache = MakeCache(o, &clock);
  using C = absl::StatusCode;
  const auto start = [&](const std::string& id, Token first, const std::string& worker) {
    RequestSpec s = Spec(id, Seq(first, 4));
    s.owner = WorkerId(worker);
    Start(*cache, s);
    return s;
  };
  RequestSpec a = start("a", 0, "w0"), b = start("b", 100, "w0"), c = start("c", 200, "w1");
  REQUIRE(cache->Checkpoint(a.id, a.prompt, std::string(4'000, 'a')).ok());
  // Per worker: w0 holds 4,016 bytes; 2,016 more would pass 6,000.
  auto over = cache->Checkpoint(b.id, b.prompt, std::string(2'000, 'b'));
  REQUIRE(over.code() == C::kResourceExhausted);
  REQUIRE(over.message().find("max_checkpoint_state_bytes_per_worker") != absl::string_view::npos);
  // Replacing a request's own checkpoint counts only the difference.
  REQUIRE(cache->Checkpoint(a.id, a.prompt, std::string(5'000, 'a')).ok());
  REQUIRE(cache->Checkpoint(c.id, c.prompt, std::string(4'900, 'c')).ok());
  // In total: 5,016 + 4,916 + 116 would pass 10,000 (w1's own limit is fine).
  RequestSpec d = start("d", 300, "w1");
  over = cache->Checkpoint(d.id, d.prompt, std::string(100, 'd'));
  REQUIRE(over.code() == C::kResourceExhausted);
  REQUIRE(over.message().find("checkpoint_state_bytes") != absl::string_view::npos);
  RequireInvariants(*cache);
  // An orphaned checkpoint (still w0's) is the first to go for room.
  REQUIRE(cache->Release(a.id, /*completed=*/false).ok());
  REQUIRE(cache->Report().orphaned_checkpoints == 1);
  REQUIRE(cache->Checkpoint(d.id, d.prompt, std::string(100, 'd')).ok());
  REQUIRE(cache->Report().orphaned_checkpoints == 0);  // a's orphan was dropped for room
  REQUIRE(cache->Acquire(RequestId("a")).status().code() == C::kNotFound);
  RequireInvariants(*cache);
}

TEST_CASE("A worker's interrupted checkpoints count against its own limit and go before anyone else's",
          "[core][cache][limits][checkpoint]") {
  FakeClock clock;
  auto o = SmallOptions(64);
  o.checkpoint_state_bytes = 10'000;
  o.max_checkpoint_state_bytes_per_worker = 4'000;
  auto cache = MakeCache(o, &clock);
  const auto orphan = [&](const std::string& id, Token first, const std::string& worker, size_t state) {
    RequestSpec s = Spec(id, Seq(first, 4));
    s.owner = WorkerId(worker);
    Start(*cache, s);
    absl::Status st = cache->Checkpoint(s.id, s.prompt, std::string(state, 'x'));
    if (st.ok()) REQUIRE(cache->Release(s.id, /*completed=*/false).ok());
    return st;
  };
  // Another tenant's resumable generation.
  REQUIRE(orphan("victim", 0, "tenant-b", 1'500).ok());
  clock.Advance(absl::Seconds(1));
  // A worker ending generation after generation as interrupted never gets past its own 4,000
  // bytes: each new checkpoint drops its own oldest, never the other tenant's.
  for (int i = 0; i < 20; ++i) {
    REQUIRE(orphan("greedy-" + std::to_string(i), 100 + 10 * i, "tenant-a", 1'500).ok());
    clock.Advance(absl::Seconds(1));
    RequireInvariants(*cache);
  }
  RequestSpec resume = Spec("resume", Seq(0, 4));
  resume.owner = WorkerId("tenant-b");
  resume.resume_from = RequestId("victim");
  REQUIRE(Start(*cache, resume).resumed);
  REQUIRE(cache->Report().orphaned_checkpoints == 2);  // tenant-a's two newest
  RequireInvariants(*cache);
}

TEST_CASE("An unknown pool name is NOT_FOUND and the error names the pools there are", "[core][cache]") {
  FakeClock clock;
  CacheOptions o = SmallOptions();
  PoolGeometry second = o.pools[0];
  second.name = "tiny";
  o.pools.push_back(second);
  auto cache = MakeCache(o, &clock);
  absl::StatusOr<PoolId> id = cache->FindPool("default");
  REQUIRE(absl::IsNotFound(id.status()));
  REQUIRE(id.status().message() == "unknown pool 'default' (this kvd has: m, tiny)");
  REQUIRE(*cache->FindPool("tiny") == 1);
}

}  // namespace
}  // namespace kvd
