// KvCache::ExportSnapshot / ImportSnapshot (cache_snapshot.h): what a hot handoff carries. The
// successor must serve the same prefixes from the same block indices, evict in the same order,
// keep sessions, and refuse a snapshot that does not fit — changing nothing.
#include <catch2/catch.hpp>

#include <algorithm>

#include "absl/strings/match.h"

#include "server/core/kv_cache.h"
#include "tests/unit/core/test_util.h"

namespace kvd {
namespace {

using namespace kvd::testing;

void Cached(KvCache& cache, const std::string& id, const std::vector<Token>& prompt,
            const std::string& session = "") {
  RequestSpec s = Spec(id, prompt);
  s.session = SessionId(session);
  PublishAll(cache, s, prompt, Start(cache, s));
  REQUIRE(cache.Release(s.id, true).ok());
}

int64_t Peek(KvCache& cache, const std::vector<Token>& prompt) {
  return *cache.PeekPrefixLen(Namespace{.pool = "m"}, prompt);
}

TEST_CASE("An imported snapshot serves the same prefixes from the same blocks, in the same recency",
          "[core][handoff]") {
  FakeClock clock;
  auto old_cache = MakeCache(SmallOptions(16), &clock);
  Cached(*old_cache, "a", Seq(0, 9));           // 2 blocks
  clock.Advance(absl::Seconds(1));
  Cached(*old_cache, "b", Concat(Seq(0, 8), Seq(50, 8)));  // shares a's 2 blocks, adds 2
  clock.Advance(absl::Seconds(1));
  Cached(*old_cache, "c", Seq(100, 12), "chat");  // 3 blocks, protected by a session
  clock.Advance(absl::Seconds(1));
  Cached(*old_cache, "d", Seq(200, 8));          // 2 blocks, the newest
  // A live request's own blocks are not part of the snapshot.
  RequestSpec live = Spec("live", Seq(300, 8));
  Start(*old_cache, live);

  const CacheSnapshot snap = old_cache->ExportSnapshot();
  REQUIRE(snap.blocks.size() == 9);
  REQUIRE(snap.sessions.size() == 1);
  for (size_t i = 0; i < snap.blocks.size(); ++i) REQUIRE(snap.blocks[i].parent < static_cast<int64_t>(i));

  auto fresh = MakeCache(SmallOptions(16), &clock);
  std::vector<CacheEvent> seen;
  fresh->AddEventListener([&seen](const CacheEvent& e) { seen.push_back(e); });
  auto indexed = fresh->ImportSnapshot(snap);
  REQUIRE(indexed.ok());
  REQUIRE(*indexed == 9);
  REQUIRE(seen.size() == 9);  // every block announced as stored
  for (const CacheEvent& e : seen) REQUIRE(e.kind == CacheEventKind::kStored);
  RequireInvariants(*fresh);
  REQUIRE(Peek(*fresh, Seq(0, 9)) == 8);
  REQUIRE(Peek(*fresh, Concat(Seq(0, 8), Seq(50, 9))) == 16);
  REQUIRE(Peek(*fresh, Seq(100, 13)) == 12);
  REQUIRE(fresh->GetSession(SessionId("chat")).ok());
  REQUIRE(fresh->GetSession(SessionId("chat"))->protected_blocks == 3);

  // The same blocks: a hit acquires the indices the old process wrote.
  RequestSpec again = Spec("again", Seq(0, 9));
  RequestSpec again_old = Spec("again-old", Seq(0, 9));
  const AcquireResult got = Start(*fresh, again);
  const AcquireResult want = Start(*old_cache, again_old);
  REQUIRE(std::vector<BlockIndex>(got.blocks.begin(), got.blocks.begin() + 2) ==
          std::vector<BlockIndex>(want.blocks.begin(), want.blocks.begin() + 2));
  REQUIRE(fresh->Release(again.id, true).ok());
  REQUIRE(old_cache->Release(again_old.id, true).ok());
  REQUIRE(old_cache->Release(live.id, true).ok());

  // The same eviction order: fill both so that each evicts; what survives is the same.
  clock.Advance(absl::Seconds(1));
  for (KvCache* c : {old_cache.get(), fresh.get()}) {
    RequestSpec big = Spec("big", Seq(1000, 40));  // 10 blocks
    Start(*c, big);
    REQUIRE(c->Release(big.id, true).ok());
  }
  for (const auto& prompt : {Seq(0, 9), Concat(Seq(0, 8), Seq(50, 9)), Seq(100, 13), Seq(200, 9)}) {
    REQUIRE(Peek(*fresh, prompt) == Peek(*old_cache, prompt));
  }
  RequireInvariants(*fresh);
}

TEST_CASE("An interrupted request's checkpoint crosses the handoff and resumes in the same blocks",
          "[core][handoff]") {
  FakeClock clock;
  auto old_cache = MakeCache(SmallOptions(16), &clock);
  Cached(*old_cache, "prefix", Seq(0, 9));  // 2 cached blocks the generation below reads
  RequestSpec gen = Spec("gen", Seq(0, 9), /*max_new=*/10);
  Start(*old_cache, gen);
  REQUIRE(old_cache->Extend(gen.id, 3).ok());  // 12 tokens: 3 blocks, the third its own
  const auto tokens = Concat(Seq(0, 9), {900, 901, 902});
  REQUIRE(old_cache->Checkpoint(gen.id, tokens, "sampler-state").ok());
  const std::vector<BlockIndex> table = old_cache->GetHandle(gen.id)->blocks;
  REQUIRE(old_cache->Release(gen.id, /*completed=*/false).ok());  // what a handoff does to live requests

  const CacheSnapshot snap = old_cache->ExportSnapshot();
  REQUIRE(snap.checkpoints.size() == 1);
  auto fresh = MakeCache(SmallOptions(16), &clock);
  REQUIRE(fresh->ImportSnapshot(snap).ok());
  REQUIRE(fresh->Report().orphaned_checkpoints == 1);
  RequireInvariants(*fresh);
  // Its own block is not handed out to anyone else meanwhile.
  RequestSpec other = Spec("other", Seq(500, 52));  // 13 blocks: every one not held
  const AcquireResult taken = Start(*fresh, other);
  REQUIRE(std::find(taken.blocks.begin(), taken.blocks.end(), table[2]) == taken.blocks.end());
  REQUIRE(fresh->Release(other.id, true).ok());

  RequestSpec again = Spec("gen-again", Seq(0, 9), 10);
  again.resume_from = RequestId("gen");
  const AcquireResult r = Start(*fresh, again);
  REQUIRE(r.resumed);
  REQUIRE(r.resumed_tokens == tokens);
  REQUIRE(r.engine_state == "sampler-state");
  REQUIRE(std::vector<BlockIndex>(r.blocks.begin(), r.blocks.begin() + 3) == table);
  REQUIRE(r.cached_tokens == 12);
  RequireInvariants(*fresh);
}

TEST_CASE("A snapshot that does not fit is refused, naming the field, and changes nothing", "[core][handoff]") {
  FakeClock clock;
  auto source = MakeCache(SmallOptions(16), &clock);
  Cached(*source, "a", Seq(0, 9));
  const CacheSnapshot good = source->ExportSnapshot();
  REQUIRE(good.blocks.size() == 2);

  CacheSnapshot bad = good;
  std::string expect;
  SECTION("an unknown pool") {
    bad.blocks[1].pool = 7;
    expect = "pool 7";
  }
  SECTION("an index past the pool") {
    bad.blocks[1].index = 16;
    expect = "past pool 'm'";
  }
  SECTION("a block of the wrong length") {
    bad.blocks[0].tokens.pop_back();
    expect = "4-token blocks";
  }
  SECTION("a child before its parent") {
    std::swap(bad.blocks[0], bad.blocks[1]);
    bad.blocks[0].parent = 1;
    bad.blocks[1].parent = -1;
    expect = "parent does not come before";
  }
  SECTION("two blocks at one index") {
    bad.blocks[1].index = bad.blocks[0].index;
    expect = "not free";
  }
  SECTION("a namespace of an unconfigured pool") {
    bad.namespaces[0].pool = "other";
    expect = "'other'";
  }
  SECTION("a checkpoint claiming a cached block as its own") {
    CacheSnapshot::Checkpoint c;
    c.id = RequestId("ck");
    c.tokens = Seq(0, 8);
    c.blocks = {good.blocks[0].index};
    c.cached = {-1};
    c.expires_at = clock.Now() + absl::Seconds(60);
    bad.checkpoints.push_back(c);
    expect = "not its own";
  }
  SECTION("a session protecting a block that is not there") {
    bad.sessions.push_back({SessionId("s"), WorkerId("w"), {5}, clock.Now() + absl::Seconds(60)});
    expect = "protects block 5";
  }
  auto target = MakeCache(SmallOptions(16), &clock);
  auto r = target->ImportSnapshot(bad);
  INFO(r.status().ToString());
  REQUIRE(absl::IsInvalidArgument(r.status()));
  REQUIRE(absl::StrContains(r.status().message(), expect));
  RequireInvariants(*target);
  REQUIRE(Peek(*target, Seq(0, 9)) == 0);
  // Nothing was claimed: the good snapshot still fits.
  REQUIRE(target->ImportSnapshot(good).value_or(-1) == 2);
  REQUIRE(Peek(*target, Seq(0, 9)) == 8);
  RequireInvariants(*target);
}

TEST_CASE("A snapshot is imported only into an empty cache", "[core][handoff]") {
  FakeClock clock;
  auto source = MakeCache(SmallOptions(16), &clock);
  Cached(*source, "a", Seq(0, 9));
  auto target = MakeCache(SmallOptions(16), &clock);
  Cached(*target, "x", Seq(500, 9));
  REQUIRE(absl::IsFailedPrecondition(target->ImportSnapshot(source->ExportSnapshot()).status()));
  RequireInvariants(*target);
}

}  // namespace
}  // namespace kvd
