// The data mover (demotion_mover.h): it keeps each pool's reserve free by demoting ahead, on its
// own thread, so requests take free blocks and never run (or wait for) a copy; a slow sink stalls
// the mover only.
#include <atomic>
#include <thread>

#include <catch2/catch.hpp>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "server/core/demotion_mover.h"
#include "tests/unit/core/test_util.h"

namespace kvd {
namespace {

using namespace kvd::testing;

// Records the thread of every copy; the first copy on a thread other than `main` can be made to
// wait for `release` (a slow sink).
class ThreadSink final : public EvictionSink {
 public:
  explicit ThreadSink(std::thread::id main) : main_(main) {}
  void OnEvict(const CachedBlockView&, EvictReason) override {
    const bool on_main = std::this_thread::get_id() == main_;
    if (on_main) {
      on_main_.fetch_add(1);
    } else {
      elsewhere_.fetch_add(1);
      if (block_first_ && !blocked_once_.exchange(true)) {
        entered_.Notify();
        timed_out_ = !release_.WaitForNotificationWithTimeout(absl::Seconds(30));
      }
    }
  }
  std::thread::id main_;
  std::atomic<int64_t> on_main_{0}, elsewhere_{0};
  bool block_first_ = false;
  std::atomic<bool> blocked_once_{false};
  absl::Notification entered_, release_;
  std::atomic<bool> timed_out_{false};
};

// A full request of `blocks` blocks over fresh tokens starting at `first`, published and released.
void Cycle(KvCache& cache, const std::string& id, Token first, int blocks) {
  RequestSpec spec = Spec(id, Seq(first, 4 * blocks));
  AcquireResult acq = Start(cache, spec);
  PublishAll(cache, spec, spec.prompt, acq);
  REQUIRE(cache.Release(spec.id, true).ok());
}

void WaitFor(const std::function<bool()>& done) {
  for (int i = 0; i < 10000 && !done(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  REQUIRE(done());
}

TEST_CASE("The data mover keeps a reserve free on its own thread; requests take it and copy nothing",
          "[core][demotion][mover]") {
  FakeClock clock;
  CacheOptions o = SmallOptions(16);
  o.demote_reserve = 0.25;  // 4 of 16 blocks
  auto cache = MakeCache(o, &clock);
  ThreadSink sink(std::this_thread::get_id());
  cache->SetEvictionSink(&sink);
  DemotionMover mover(cache.get());
  for (int r = 0; r < 4; ++r) Cycle(*cache, "fill" + std::to_string(r), 1000 * (r + 1), 4);  // 16 cached
  // The last fill left no block free: the mover demotes four, the oldest, on its thread.
  // (demoted() counts a batch once its copies are done, just after its blocks come free.)
  WaitFor([&] { return cache->Report().pools[0].free_blocks == 4 && mover.demoted() == 4; });
  CHECK(cache->Report().pools[0].cached_blocks == 12);
  // A request for four blocks takes the free ones: no eviction, no copy on this thread.
  const int64_t main_before = sink.on_main_.load();
  Cycle(*cache, "next", 9000, 4);
  CHECK(sink.on_main_.load() == main_before);
  WaitFor([&] { return cache->Report().pools[0].free_blocks == 4 && mover.demoted() == 8; });
  CHECK(sink.elsewhere_.load() == 8);
  CHECK(sink.on_main_.load() == 0);
  // The first-filled prefix was demoted first (eviction order): its blocks are gone from G1.
  CHECK(cache->PeekPrefixLen(Spec("p", Seq(1000, 16)).ns, Seq(1000, 16)).value() == 0);
  CHECK(cache->PeekPrefixLen(Spec("p", Seq(4000, 16)).ns, Seq(4000, 16)).value() == 12);
  REQUIRE(cache->CheckInvariantsForTesting().ok());
  cache->SetEvictionSink(nullptr);
}

TEST_CASE("A slow eviction sink delays neither an unrelated request nor the engine's readers",
          "[core][demotion][mover]") {
  FakeClock clock;
  CacheOptions o = SmallOptions(16);
  o.demote_reserve = 0.25;
  auto cache = MakeCache(o, &clock);
  ThreadSink sink(std::this_thread::get_id());
  sink.block_first_ = true;  // the mover's first copy waits until this thread says so
  cache->SetEvictionSink(&sink);
  auto mover = std::make_unique<DemotionMover>(cache.get());
  for (int r = 0; r < 4; ++r) Cycle(*cache, "fill" + std::to_string(r), 1000 * (r + 1), 4);
  REQUIRE(sink.entered_.WaitForNotificationWithTimeout(absl::Seconds(30)));
  // The mover is stuck inside a copy. Everything else goes on: reports, lookups, and whole
  // requests (which evict, and copy, on this thread).
  const CacheReport r = cache->Report();
  CHECK(r.live_requests == 0);
  CHECK(cache->PeekPrefixLen(Spec("p", Seq(4000, 16)).ns, Seq(4000, 16)).value() == 12);
  Cycle(*cache, "unrelated", 20000, 4);
  Cycle(*cache, "another", 30000, 2);
  CHECK(sink.on_main_.load() > 0);
  sink.release_.Notify();  // had any of the above waited for the copy, it would never get here
  CHECK_FALSE(sink.timed_out_.load());
  mover.reset();
  REQUIRE(cache->CheckInvariantsForTesting().ok());
  cache->SetEvictionSink(nullptr);
}

TEST_CASE("demote_reserve is validated", "[core][mover]") {
  CacheOptions o = SmallOptions(16);
  o.demote_reserve = 0.6;
  auto bad = KvCache::Create(o, SystemClock::Get());
  REQUIRE(bad.status().code() == absl::StatusCode::kInvalidArgument);
  REQUIRE(bad.status().message().find("demote_reserve") != absl::string_view::npos);
  o.demote_reserve = -0.1;
  REQUIRE_FALSE(KvCache::Create(o, SystemClock::Get()).ok());
}

}  // namespace
}  // namespace kvd
