// AdmissionQueue's bounds: one worker (process) cannot make the daemon hold more than
// kMaxWaitersPerWorker waiting Starts; the next is answered RESOURCE_EXHAUSTED at once, naming the
// bound, and other workers still queue. Close answers every wait.
#include <atomic>

#include <catch2/catch.hpp>

#include "absl/strings/match.h"
#include "server/core/kv_cache.h"
#include "server/rpc/admission_queue.h"
#include "tests/unit/core/test_util.h"

namespace kvd {
namespace {

using namespace kvd::testing;

TEST_CASE("A worker's waiting Starts are bounded; past the bound RESOURCE_EXHAUSTED at once", "[server][admission]") {
  FakeClock clock;
  auto cache = MakeCache(SmallOptions(4), &clock);
  Start(*cache, Spec("full", Seq(0, 16)));  // every block reserved: the rest wait
  AdmissionQueue queue(cache.get());
  std::atomic<int> answered{0};
  std::atomic<int> unavailable{0};
  const absl::Time later = absl::Now() + absl::Hours(1);
  const auto wait = [&](const std::string& id, const std::string& worker, absl::StatusOr<AdmitResult>* out) {
    RequestSpec s = Spec(id, Seq(100, 4));
    s.owner = WorkerId(worker);
    queue.Admit(std::move(s), later, nullptr, [&, out](absl::StatusOr<AdmitResult> r, absl::Duration) {
      if (out != nullptr) *out = r;
      if (absl::IsUnavailable(r.status())) ++unavailable;
      ++answered;
    });
  };
  for (int64_t i = 0; i < AdmissionQueue::kMaxWaitersPerWorker; ++i) wait("w" + std::to_string(i), "greedy", nullptr);
  REQUIRE(queue.waiting() == AdmissionQueue::kMaxWaitersPerWorker);
  REQUIRE(answered == 0);
  absl::StatusOr<AdmitResult> refused = AdmitResult{};
  wait("one-more", "greedy", &refused);
  REQUIRE(answered == 1);
  REQUIRE(absl::IsResourceExhausted(refused.status()));
  REQUIRE(absl::StrContains(refused.status().message(), "at most 1024"));
  wait("other", "modest", nullptr);  // another worker still queues
  REQUIRE(queue.waiting() == AdmissionQueue::kMaxWaitersPerWorker + 1);
  queue.Close();
  REQUIRE(answered == AdmissionQueue::kMaxWaitersPerWorker + 2);
  REQUIRE(unavailable == AdmissionQueue::kMaxWaitersPerWorker + 1);
}

}  // namespace
}  // namespace kvd
