// Prefixes in flight (kvd-reuse-2 item 2; docs/architecture.md, "Prefixes in flight"): the
// InflightIndex alone, then KvCache's use of it: a start whose lookup stops at blocks another
// request of the namespace computes learns which, by whom and how far it got; the entries go at
// publish and at every end (release, End, preempt, a fence, the worker gone), never name another
// namespace's request, and the invariant checker vouches for them after every op.
#include <catch2/catch.hpp>

#include "proto/vocab/pool_geometry.h"
#include "proto/vocab/step_types.h"
#include "server/core/inflight_index.h"
#include "server/core/kv_cache.h"
#include "tests/unit/core/test_util.h"

namespace kvd {
namespace {

using namespace kvd::testing;

const std::vector<Token> kShared = Seq(0, 16);  // four 4-token blocks

std::vector<BlockKey> Keys(const Namespace& ns, const std::vector<Token>& t) { return ChainKeys(ns, t, 4); }

TEST_CASE("InflightIndex holds, publishes and ends", "[core][inflight]") {
  InflightIndex index;
  const Namespace ns{.pool = "m"};
  const std::vector<BlockKey> keys = Keys(ns, kShared);
  REQUIRE(index.Hold(7, RequestId("a"), ns, keys, 1) == 3);
  // A second holder of the same keys holds nothing: the first one computes them.
  REQUIRE(index.Hold(8, RequestId("b"), ns, keys, 0) == 1);
  std::optional<InflightIndex::Run> run = index.Probe(ns, keys, 1);
  REQUIRE(run.has_value());
  REQUIRE(run->holder == RequestId("a"));
  REQUIRE(run->blocks == 3);
  REQUIRE(run->holder_first == 1);
  REQUIRE(index.Probe(ns, keys, 0)->holder == RequestId("b"));
  REQUIRE_FALSE(index.Probe(ns, keys, 4).has_value());  // past the keys
  // Another namespace (another tenant's salt) never sees it, even with the same keys.
  REQUIRE_FALSE(index.Probe(Namespace{.pool = "m", .cache_salt = "t2"}, keys, 1).has_value());
  REQUIRE(index.Published(7, 3) == 2);  // positions 1 and 2
  REQUIRE(index.Probe(ns, keys, 1) == std::nullopt);
  REQUIRE(index.Probe(ns, keys, 3)->holder_first == 3);
  REQUIRE(index.HoldsAny(7, run->keys));
  REQUIRE(index.End(7) == 1);
  REQUIRE_FALSE(index.HoldsAny(7, run->keys));
  REQUIRE(index.End(7) == 0);
  REQUIRE(index.End(8) == 1);
  REQUIRE(index.size() == 0);
  REQUIRE(index.holders() == 0);
}

TEST_CASE("A start learns the blocks another request computes, until it publishes them", "[core][inflight]") {
  FakeClock clock;
  auto cache = MakeCache(SmallOptions(), &clock);
  const RequestSpec a = Spec("a", Concat(kShared, Seq(100, 5)));
  const RequestSpec b = Spec("b", Concat(kShared, Seq(200, 5)));
  const AcquireResult ra = Start(*cache, a);
  REQUIRE_FALSE(ra.in_flight.has_value());
  REQUIRE(cache->inflight_blocks() == 5);  // its five full prompt blocks
  RequireInvariants(*cache);
  // b's next four blocks are a's; a got nowhere yet.
  auto ahead = cache->InFlightAhead(b.ns, b.prompt);
  REQUIRE(ahead.ok());
  REQUIRE(ahead->has_value());
  const InFlightInfo seen = **ahead;
  REQUIRE(seen.request_id == RequestId("a"));
  REQUIRE(seen.first_block == 0);
  REQUIRE(seen.blocks == 4);
  REQUIRE(seen.published_tokens == 0);
  REQUIRE(cache->InFlightHeld(seen));
  // a publishes two blocks: b's lookup now stops at the third, still a's.
  std::vector<BlockIndex> two(ra.blocks.begin(), ra.blocks.begin() + 2);
  REQUIRE(cache->Publish(a.id, a.prompt, two).ok());
  RequireInvariants(*cache);
  REQUIRE(cache->InFlightHeld(seen));  // a still computes blocks 2 and 3
  auto later = cache->InFlightAhead(b.ns, b.prompt);
  REQUIRE((*later)->first_block == 2);
  REQUIRE((*later)->blocks == 2);
  REQUIRE((*later)->published_tokens == 8);
  // All of them published: nothing in flight for b; it acquires them as a hit.
  REQUIRE(PublishAll(*cache, a, a.prompt, ra).kept == 3);  // two were published above
  REQUIRE_FALSE(cache->InFlightHeld(seen));
  REQUIRE_FALSE((*cache->InFlightAhead(b.ns, b.prompt)).has_value());
  const AcquireResult rb = Start(*cache, b);
  REQUIRE(rb.cached_tokens == 16);
  REQUIRE_FALSE(rb.in_flight.has_value());
  RequireInvariants(*cache);
  REQUIRE(cache->Release(a.id, true).ok());
  REQUIRE(cache->Release(b.id, true).ok());
  REQUIRE(cache->inflight_blocks() == 0);
  RequireInvariants(*cache);
}

TEST_CASE("A request that starts without waiting learns it and holds none of those blocks", "[core][inflight]") {
  FakeClock clock;
  auto cache = MakeCache(SmallOptions(), &clock);
  const RequestSpec a = Spec("a", Concat(kShared, Seq(100, 5)));
  const RequestSpec b = Spec("b", Concat(kShared, Seq(200, 5)));
  Start(*cache, a);
  const AcquireResult rb = Start(*cache, b);
  REQUIRE(rb.in_flight.has_value());
  REQUIRE(rb.in_flight->request_id == RequestId("a"));
  REQUIRE(rb.in_flight->blocks == 4);
  REQUIRE(cache->inflight_blocks() == 6);  // a's five, b's own fifth
  RequireInvariants(*cache);
  // a ends without publishing: b now holds nothing of the shared blocks, nobody does; a third
  // request's lookup finds b's own block after them only if the shared ones were cached.
  REQUIRE(cache->Release(a.id, /*completed=*/false).ok());
  REQUIRE(cache->inflight_blocks() == 1);
  REQUIRE_FALSE((*cache->InFlightAhead(b.ns, b.prompt)).has_value());
  RequireInvariants(*cache);
  REQUIRE(cache->Release(b.id, true).ok());
  REQUIRE(cache->inflight_blocks() == 0);
}

TEST_CASE("Two starts admitted together: the later acquire defers, acquiring nothing", "[core][inflight]") {
  FakeClock clock;
  auto cache = MakeCache(SmallOptions(), &clock);
  const RequestSpec a = Spec("a", Concat(kShared, Seq(100, 5)));
  const RequestSpec b = Spec("b", Concat(kShared, Seq(200, 5)));
  // Both admitted before either acquires: InFlightAhead finds nothing for either.
  REQUIRE(cache->Admit(a).ok());
  REQUIRE(cache->Admit(b).ok());
  REQUIRE_FALSE((*cache->InFlightAhead(b.ns, b.prompt)).has_value());
  const absl::StatusOr<AcquireResult> ra = cache->Acquire(a.id, OnInFlight::kDefer);
  REQUIRE(ra.ok());
  REQUIRE_FALSE(ra->deferred);  // nothing in flight ahead of the first: it computes
  const CacheReport before = cache->Report();
  const absl::StatusOr<AcquireResult> rb = cache->Acquire(b.id, OnInFlight::kDefer);
  REQUIRE(rb.ok());
  REQUIRE(rb->deferred);
  REQUIRE(rb->blocks.empty());
  REQUIRE(rb->in_flight.has_value());
  REQUIRE(rb->in_flight->request_id == RequestId("a"));
  REQUIRE(rb->in_flight->blocks == 4);
  // Nothing changed: b holds no block and no in-flight entry, and is still only admitted.
  REQUIRE(cache->Report().pools[0].owned_blocks == before.pools[0].owned_blocks);
  REQUIRE(cache->inflight_blocks() == 5);
  RequireInvariants(*cache);
  // Once a published them, b's deferring acquire hits them; a plain acquire never defers.
  REQUIRE(PublishAll(*cache, a, a.prompt, *ra).kept == 5);
  const absl::StatusOr<AcquireResult> rb2 = cache->Acquire(b.id, OnInFlight::kDefer);
  REQUIRE(rb2.ok());
  REQUIRE_FALSE(rb2->deferred);
  REQUIRE(rb2->cached_tokens == 16);
  const RequestSpec c = Spec("c", Concat(Seq(300, 16), Seq(400, 5)));
  const RequestSpec d = Spec("d", Concat(Seq(300, 16), Seq(500, 5)));
  Start(*cache, c);
  REQUIRE(cache->Admit(d).ok());
  const absl::StatusOr<AcquireResult> rd = cache->Acquire(d.id);
  REQUIRE(rd.ok());
  REQUIRE_FALSE(rd->deferred);
  REQUIRE(rd->in_flight.has_value());  // it computes them too, told who else does
  RequireInvariants(*cache);
  for (const RequestSpec* s : {&a, &b, &c, &d}) REQUIRE(cache->Release(s->id, false).ok());
  REQUIRE(cache->inflight_blocks() == 0);
  RequireInvariants(*cache);
}

TEST_CASE("Every end of the computing request lets its blocks go", "[core][inflight]") {
  FakeClock clock;
  auto cache = MakeCache(SmallOptions(), &clock);
  const RequestSpec a = Spec("a", Concat(kShared, Seq(100, 5)));
  const RequestSpec b = Spec("b", Concat(kShared, Seq(200, 5)));
  const AcquireResult ra = Start(*cache, a);
  const InFlightInfo seen = **cache->InFlightAhead(b.ns, b.prompt);
  const int how = GENERATE(0, 1, 2, 3, 4);
  if (how == 0) {
    REQUIRE(cache->End(a.id, 0, {}, /*completed=*/true).ok());  // ends without publishing
  } else if (how == 1) {  // preempted in a step, with a checkpoint
    StepOp op;
    op.kind = StepOpKind::kPreempt;
    op.id = a.id;
    op.token_ids = Seq(0, 6);
    std::vector<StepOp> ops;
    ops.push_back(std::move(op));
    REQUIRE(cache->Step(a.owner, a.owner, std::move(ops), {}, nullptr)[0].status.ok());
  } else if (how == 2) {
    REQUIRE(cache->ReleaseWorker(a.owner) == 1);  // its worker is gone
  } else if (how == 3) {
    REQUIRE(cache->FenceWorker(a.owner, 4242, absl::Seconds(10)) == 1);  // its stream broke
  } else {
    REQUIRE(cache->End(a.id, 5, {}, /*completed=*/true).ok());  // End publishes them
  }
  REQUIRE_FALSE(cache->InFlightHeld(seen));
  REQUIRE(cache->inflight_blocks() == 0);
  RequireInvariants(*cache);
  // b computes them itself (or, after End's publish, hits them): nothing is wedged.
  const AcquireResult rb = Start(*cache, b);
  REQUIRE(rb.cached_tokens == (how == 4 ? 16 : 0));
  REQUIRE_FALSE(rb.in_flight.has_value());
  REQUIRE(cache->Release(b.id, true).ok());
  RequireInvariants(*cache);
  (void)ra;
}

TEST_CASE("A block the hit cap leaves to compute, cached already, is nobody's in flight", "[core][inflight]") {
  FakeClock clock;
  auto cache = MakeCache(SmallOptions(), &clock);
  const RequestSpec a = Spec("a", kShared);  // exactly four blocks
  const AcquireResult ra = Start(*cache, a);
  REQUIRE(PublishAll(*cache, a, a.prompt, ra).kept == 4);
  REQUIRE(cache->End(a.id, 0, {}, true).ok());
  // The same prompt again: three blocks hit, the fourth (cached) is computed again, by either.
  const AcquireResult rb = Start(*cache, Spec("b", kShared));
  REQUIRE(rb.cached_tokens == 12);
  REQUIRE(cache->inflight_blocks() == 0);
  REQUIRE_FALSE((*cache->InFlightAhead(a.ns, kShared)).has_value());
  RequireInvariants(*cache);
}

TEST_CASE("Another tenant never learns of a request in flight", "[core][inflight]") {
  FakeClock clock;
  auto cache = MakeCache(SmallOptions(), &clock);
  RequestSpec a = Spec("a", Concat(kShared, Seq(100, 5)));
  a.ns.cache_salt = "tenant-1";
  RequestSpec b = Spec("b", Concat(kShared, Seq(200, 5)));
  b.ns.cache_salt = "tenant-2";
  RequestSpec c = Spec("c", Concat(kShared, Seq(300, 5)));  // no salt at all
  Start(*cache, a);
  REQUIRE_FALSE((*cache->InFlightAhead(b.ns, b.prompt)).has_value());
  REQUIRE_FALSE((*cache->InFlightAhead(c.ns, c.prompt)).has_value());
  const AcquireResult rb = Start(*cache, b);
  REQUIRE_FALSE(rb.in_flight.has_value());  // the same answer as if nothing ran
  // The same tenant does.
  RequestSpec d = Spec("d", Concat(kShared, Seq(400, 5)));
  d.ns.cache_salt = "tenant-1";
  REQUIRE((*cache->InFlightAhead(d.ns, d.prompt))->request_id == RequestId("a"));
  REQUIRE(absl::IsNotFound(cache->InFlightAhead(Namespace{.pool = "nope"}, d.prompt).status()));
  RequireInvariants(*cache);
}

TEST_CASE("On a hybrid pool the spine's blocks are in flight, and the hit follows the groups", "[core][inflight]") {
  PoolGeometry g;
  g.name = "h";
  g.block_tokens = 4;
  g.bytes_per_token_per_layer = 8;
  g.max_model_len = 256;
  g.step_tokens = 8;
  g.groups.push_back(KvGroup{.name = "full", .kind = KvGroupKind::kFull, .layers = {0}, .capacity = 64});
  g.groups.push_back(
      KvGroup{.name = "swa", .kind = KvGroupKind::kSlidingWindow, .layers = {1}, .window = 64, .capacity = 64});
  g.num_layers = 2;
  REQUIRE(g.ResolveGroups().ok());
  CacheOptions o = SmallOptions();
  o.pools = {g};
  FakeClock clock;
  auto cache = MakeCache(o, &clock);
  const RequestSpec a = Spec("a", Concat(kShared, Seq(100, 5)), 0, "h");
  const RequestSpec b = Spec("b", Concat(kShared, Seq(200, 5)), 0, "h");
  const AcquireResult ra = Start(*cache, a);
  REQUIRE(cache->inflight_blocks() == 5);  // the full group's prompt blocks
  REQUIRE(testing::Grow(*cache, "a", 0, 8).status.ok());  // the engine computed 8 tokens
  const InFlightInfo seen = **cache->InFlightAhead(b.ns, b.prompt);
  REQUIRE(seen.request_id == RequestId("a"));
  REQUIRE(seen.blocks == 4);
  REQUIRE(seen.computed_tokens == 8);  // how far it got
  RequireInvariants(*cache);
  REQUIRE(testing::Grow(*cache, "a", 0, 21).status.ok());
  REQUIRE(cache->Publish(a.id, a.prompt, std::vector<BlockIndex>(ra.blocks.begin(), ra.blocks.begin() + 5)).ok());
  REQUIRE_FALSE(cache->InFlightHeld(seen));
  const AcquireResult rb = Start(*cache, b);
  REQUIRE(rb.cached_tokens == 16);  // the window group holds every block: the spine's hit stands
  REQUIRE_FALSE(rb.in_flight.has_value());
  RequireInvariants(*cache);
  REQUIRE(cache->Release(a.id, true).ok());
  REQUIRE(cache->Release(b.id, true).ok());
  REQUIRE(cache->inflight_blocks() == 0);
  RequireInvariants(*cache);
}

}  // namespace
}  // namespace kvd
