#include <catch2/catch.hpp>

#include "server/core/kv_cache.h"
#include "tests/unit/core/test_util.h"

namespace kvd {
namespace {

using namespace kvd::testing;

// Runs one turn of `session` with `prompt` and publishes its full blocks.
void Turn(KvCache& cache, const std::string& id, const std::string& session,
          const std::vector<Token>& prompt, const std::string& worker = "w0") {
  RequestSpec s = Spec(id, prompt);
  s.session = SessionId(session);
  s.owner = WorkerId(worker);
  PublishAll(cache, s, prompt, Start(cache, s));
  REQUIRE(cache.Release(s.id, true).ok());
}

TEST_CASE("A session's latest prefix is evicted after unprotected blocks", "[core][sessions]") {
  FakeClock clock;
  auto cache = MakeCache(SmallOptions(8), &clock);
  Turn(*cache, "s1", "chat", Seq(0, 9), "worker-7");  // protects 2 blocks
  clock.Advance(absl::Seconds(1));
  RequestSpec other = Spec("o", Seq(100, 9));
  PublishAll(*cache, other, other.prompt, Start(*cache, other));
  REQUIRE(cache->Release(other.id, true).ok());
  // 4 free + 4 evictable. A 6-block request must evict 2: the unprotected ones, although newer.
  RequestSpec big = Spec("big", Seq(1000, 24));
  Start(*cache, big);
  REQUIRE(*cache->PeekPrefixLen(Namespace{.pool = "m"}, Seq(0, 9)) == 8);
  REQUIRE(*cache->PeekPrefixLen(Namespace{.pool = "m"}, other.prompt) == 0);
  auto info = cache->GetSession(SessionId("chat"));
  REQUIRE(info.ok());
  REQUIRE(info->worker == WorkerId("worker-7"));
  REQUIRE(info->protected_blocks == 2);
  RequireInvariants(*cache);
}

TEST_CASE("Protection is soft: it yields when nothing else is left", "[core][sessions]") {
  FakeClock clock;
  auto cache = MakeCache(SmallOptions(4), &clock);
  Turn(*cache, "s1", "chat", Seq(0, 9));
  RequestSpec big = Spec("big", Seq(1000, 16));  // needs all 4 blocks
  Start(*cache, big);
  REQUIRE(*cache->PeekPrefixLen(Namespace{.pool = "m"}, Seq(0, 9)) == 0);
  RequireInvariants(*cache);
  REQUIRE(cache->Release(big.id, true).ok());
  REQUIRE(cache->CloseSession(SessionId("chat")).ok());  // stale refs are ignored safely
  RequireInvariants(*cache);
}

TEST_CASE("Session protection expires with its TTL", "[core][sessions]") {
  FakeClock clock;
  auto o = SmallOptions(8);
  o.session_ttl = absl::Seconds(30);
  auto cache = MakeCache(o, &clock);
  Turn(*cache, "s1", "chat", Seq(0, 9));
  REQUIRE(cache->Gc().blocks_freed == 0);  // protected blocks survive Gc
  clock.Advance(absl::Seconds(31));
  REQUIRE(cache->GetSession(SessionId("chat")).status().code() == absl::StatusCode::kNotFound);
  GcStats gc = cache->Gc();
  REQUIRE(gc.sessions_expired == 1);
  REQUIRE(gc.blocks_freed == 2);
  RequireInvariants(*cache);
}

TEST_CASE("A session protects at most its quota of leading blocks", "[core][sessions]") {
  FakeClock clock;
  auto o = SmallOptions(16);
  o.session_max_protected_blocks = 1;
  auto cache = MakeCache(o, &clock);
  Turn(*cache, "s1", "chat", Seq(0, 13));  // 3 full blocks
  REQUIRE(cache->GetSession(SessionId("chat"))->protected_blocks == 1);
  REQUIRE(cache->Gc().blocks_freed == 2);  // the two unprotected tail blocks
  REQUIRE(*cache->PeekPrefixLen(Namespace{.pool = "m"}, Seq(0, 13)) == 4);
  RequireInvariants(*cache);
}

TEST_CASE("A new turn moves protection to the new prefix; CloseSession keeps the blocks", "[core][sessions]") {
  FakeClock clock;
  auto cache = MakeCache(SmallOptions(16), &clock);
  Turn(*cache, "t1", "chat", Seq(0, 9));
  Turn(*cache, "t2", "chat", Concat(Seq(0, 8), Seq(50, 9)), "worker-2");
  auto info = cache->GetSession(SessionId("chat"));
  REQUIRE(info->worker == WorkerId("worker-2"));
  REQUIRE(info->protected_blocks == 4);
  RequireInvariants(*cache);
  REQUIRE(cache->CloseSession(SessionId("chat")).ok());
  REQUIRE(cache->GetSession(SessionId("chat")).status().code() == absl::StatusCode::kNotFound);
  REQUIRE(cache->Report().pools[0].cached_blocks == 4);  // reusable state stays
  REQUIRE(cache->Report().pools[0].protected_blocks == 0);
  RequireInvariants(*cache);
}

TEST_CASE("A session belongs to its tenant: another cache_salt naming it is refused and changes nothing",
          "[core][sessions]") {
  FakeClock clock;
  auto cache = MakeCache(SmallOptions(8), &clock);
  RequestSpec a = Spec("a", Seq(0, 9));
  a.session = SessionId("chat");
  a.ns.cache_salt = "tenant-a";
  PublishAll(*cache, a, a.prompt, Start(*cache, a));
  REQUIRE(cache->Release(a.id, true).ok());
  REQUIRE(cache->GetSession(SessionId("chat"))->protected_blocks == 2);
  RequestSpec b = Spec("b", Seq(500, 9));
  b.session = SessionId("chat");  // the same id, another tenant
  b.ns.cache_salt = "tenant-b";
  auto refused = cache->Admit(b);
  REQUIRE(absl::IsPermissionDenied(refused.status()));
  REQUIRE(refused.status().message().find("another tenant") != absl::string_view::npos);
  REQUIRE(cache->GetSession(SessionId("chat"))->protected_blocks == 2);
  // The tenant's own next turn, from another worker, goes on.
  RequestSpec a2 = Spec("a2", Seq(0, 13));
  a2.session = SessionId("chat");
  a2.ns.cache_salt = "tenant-a";
  a2.owner = WorkerId("w1");
  PublishAll(*cache, a2, a2.prompt, Start(*cache, a2));
  REQUIRE(cache->Release(a2.id, true).ok());
  REQUIRE(cache->GetSession(SessionId("chat"))->protected_blocks == 3);
  // It crosses a handoff scoped.
  const CacheSnapshot snap = cache->ExportSnapshot();
  auto fresh = MakeCache(SmallOptions(8), &clock);
  REQUIRE(fresh->ImportSnapshot(snap).ok());
  REQUIRE(absl::IsPermissionDenied(fresh->Admit(b).status()));
  RequireInvariants(*fresh);
}

}  // namespace
}  // namespace kvd
