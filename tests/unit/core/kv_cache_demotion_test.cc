// No data under the engine lock: the eviction sink's copies (demotions) and VisitCached's copies
// run without KvCache's mutex, while the blocks they read stay held — never free, never handed to
// anyone but the request whose call is still running.
#include <atomic>
#include <thread>

#include <catch2/catch.hpp>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "tests/unit/core/test_util.h"

namespace kvd {
namespace {

using namespace kvd::testing;

// Records every demotion; the first one blocks until `release` is notified.
class BlockingSink final : public EvictionSink {
 public:
  void OnEvict(const CachedBlockView& block, EvictReason) override {
    {
      absl::MutexLock lock(&mu_);
      seen_.push_back(block.index);
      tokens_.emplace_back(block.tokens.begin(), block.tokens.end());
      if (seen_.size() > 1) return;
    }
    entered.Notify();
    release.WaitForNotification();
  }
  std::vector<BlockIndex> seen() const {
    absl::MutexLock lock(&mu_);
    return seen_;
  }
  std::vector<std::vector<Token>> tokens() const {
    absl::MutexLock lock(&mu_);
    return tokens_;
  }
  absl::Notification entered, release;

 private:
  mutable absl::Mutex mu_;
  std::vector<BlockIndex> seen_;
  std::vector<std::vector<Token>> tokens_;
};

// Caches `n` one-block prompts [100*i, 100*i+4) and releases them: n blocks, nothing else held.
void Fill(KvCache& cache, int n) {
  for (int i = 0; i < n; ++i) {
    const RequestSpec s = Spec("fill" + std::to_string(i), Seq(100 * i, 4));
    const AcquireResult a = Start(cache, s);
    PublishAll(cache, s, s.prompt, a);
    REQUIRE(cache.Release(s.id, true).ok());
  }
}

TEST_CASE("A blocked demotion holds no lock and its block goes to nobody else", "[core][demotion]") {
  FakeClock clock;
  auto cache = MakeCache(SmallOptions(8), &clock);
  BlockingSink sink;
  cache->SetEvictionSink(&sink);
  Fill(*cache, 8);  // 8 cached blocks, none free

  // A's Acquire needs 2 blocks: it evicts the 2 oldest and the first copy blocks.
  std::vector<BlockIndex> a_blocks;
  std::atomic<bool> a_done{false};
  std::thread a([&] {  // no Catch2 assertions off the main thread
    const RequestSpec spec = Spec("a", Seq(5000, 6));
    if (cache->Admit(spec).ok()) {
      absl::StatusOr<AcquireResult> got = cache->Acquire(spec.id);
      if (got.ok()) a_blocks = got->blocks;
    }
    a_done = true;
  });
  sink.entered.WaitForNotification();
  const BlockIndex copying = sink.seen().front();
  CHECK(sink.tokens().front() == Seq(0, 4));  // the oldest block, its tokens intact

  // Meanwhile the engine serves everyone else: reports, lookups, and a request that itself
  // evicts (its copies do not block) — and never gets the block being copied.
  CHECK(cache->Report().live_requests == 1);
  CHECK(cache->PeekPrefixLen(Spec("x", Seq(700, 5)).ns, Seq(700, 5)).value() == 4);
  const RequestSpec b = Spec("b", Seq(9000, 6));
  const AcquireResult b_blocks = Start(*cache, b);
  CHECK(std::find(b_blocks.blocks.begin(), b_blocks.blocks.end(), copying) == b_blocks.blocks.end());
  REQUIRE(cache->Release(b.id, false).ok());
  CHECK(cache->Gc().blocks_freed >= 0);  // more evictions, more copies, still no wait
  CHECK_FALSE(a_done.load());  // A is still inside its copy
  REQUIRE(cache->CheckInvariantsForTesting().ok());

  sink.release.Notify();
  a.join();
  CHECK(a_done.load());
  // The held victims became A's blocks (nobody else's), and nothing leaked.
  REQUIRE(a_blocks.size() == 2);
  CHECK(std::find(a_blocks.begin(), a_blocks.end(), copying) != a_blocks.end());
  REQUIRE(cache->Release(RequestId("a"), false).ok());
  REQUIRE(cache->CheckInvariantsForTesting().ok());
  CHECK(cache->Report().live_requests == 0);
  cache->SetEvictionSink(nullptr);
}

TEST_CASE("A block a Gc demotes is not free until its copy is done", "[core][demotion]") {
  FakeClock clock;
  auto cache = MakeCache(SmallOptions(8), &clock);
  BlockingSink sink;
  cache->SetEvictionSink(&sink);
  Fill(*cache, 2);
  std::thread gc([&] { (void)cache->Gc(); });
  sink.entered.WaitForNotification();
  const BlockIndex copying = sink.seen().front();
  // Every free block can be taken now; the one being copied is not among them.
  // 6 blocks: every free one (both demoted blocks are held, one being copied, one waiting).
  const RequestSpec all = Spec("all", Seq(9000, 4 * 6));
  const AcquireResult got = Start(*cache, all);
  CHECK(std::find(got.blocks.begin(), got.blocks.end(), copying) == got.blocks.end());
  CHECK(cache->Report().pools[0].free_blocks == 0);
  const RequestSpec more = Spec("more", Seq(7000, 4));
  REQUIRE(cache->Admit(more).ok());
  CHECK(absl::IsResourceExhausted(cache->Acquire(more.id).status()));  // the held ones are not for taking
  REQUIRE(cache->Release(more.id, false).ok());
  REQUIRE(cache->CheckInvariantsForTesting().ok());
  sink.release.Notify();
  gc.join();
  REQUIRE(cache->Release(all.id, false).ok());
  REQUIRE(cache->CheckInvariantsForTesting().ok());
  CHECK(cache->Report().pools[0].free_blocks == 8);
  cache->SetEvictionSink(nullptr);
}

TEST_CASE("VisitCached copies without the lock, the visited prefix held and its recency kept", "[core][demotion]") {
  FakeClock clock;
  auto cache = MakeCache(SmallOptions(8), &clock);
  const RequestSpec s = Spec("s", Seq(1, 13));  // 3 blocks
  const AcquireResult acq = Start(*cache, s);
  PublishAll(*cache, s, s.prompt, acq);
  REQUIRE(cache->Release(s.id, true).ok());
  const std::vector<CachedBlockRef> refs = cache->SnapshotCached();
  REQUIRE(refs.size() == 3);

  int visits = 0;
  const int64_t visited = cache->VisitCached(refs, [&](const CachedBlockView& v) {
    ++visits;
    // The engine is usable from here (a held lock would deadlock), and nothing visited, nor
    // its prefix, can be evicted meanwhile.
    CHECK(cache->Gc().blocks_freed == 0);
    CHECK(v.tokens.size() == 4);
    REQUIRE(cache->CheckInvariantsForTesting().ok());
  });
  CHECK(visited == 3);
  CHECK(visits == 3);
  REQUIRE(cache->CheckInvariantsForTesting().ok());
  // Let go: evictable again, the whole chain.
  CHECK(cache->Gc().blocks_freed == 3);
}

}  // namespace
}  // namespace kvd
