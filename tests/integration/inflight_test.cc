// Prefixes in flight through the C++ client (kvd-reuse-2 item 2; docs/api.md, "Prefixes in
// flight"): Client::Start with wait_in_flight and a step's start with it, against a real kvd. The
// wider attack (holders killed or preempted, waiters killed, bounds, tenants, mutual waits, the
// batch engine) is tests/python/test_inflight.py.
#include <thread>

#include <catch2/catch.hpp>

#include <grpcpp/grpcpp.h>

#include "client/client.h"
#include "client/step.h"
#include "kvd/v1/kvd.grpc.pb.h"
#include "tests/integration/harness.h"

namespace kvd {
namespace {

using namespace kvd::testing;

std::vector<Token> Concat(std::vector<Token> a, const std::vector<Token>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// Starts waiting for blocks in flight now (Report.in_flight_waiting), polled until `want`.
bool WaitersReach(const DaemonProcess& d, int64_t want) {
  auto stub = v1::Kvd::NewStub(grpc::CreateChannel(d.target(), grpc::InsecureChannelCredentials()));
  for (int i = 0; i < 1000; ++i) {
    grpc::ClientContext ctx;
    v1::ReportResponse r;
    if (stub->Report(&ctx, v1::ReportRequest(), &r).ok() && r.in_flight_waiting() == want) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

TEST_CASE("The C++ client waits for a prefix in flight, per request and in a step", "[integration][inflight]") {
  DaemonProcess d(SmallPoolConfig(128));
  auto a = client::Client::Connect({.target = d.target(), .worker_name = "a"});
  auto b = client::Client::Connect({.target = d.target(), .worker_name = "b"});
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  const bool in_step = GENERATE(false, true);
  const Token base = in_step ? 5000 : 1000;
  const std::vector<Token> pa = Concat(Range(base, 16), Range(base + 100, 5));
  const std::vector<Token> pb = Concat(Range(base, 16), Range(base + 200, 5));
  auto holder = (*a)->Start(PoolRequest("a1", pa));
  REQUIRE(holder.ok());
  REQUIRE_FALSE((*holder)->in_flight().has_value());

  if (!in_step) {
    absl::StatusOr<std::unique_ptr<client::KvRequest>> waiter;
    std::thread t([&] { waiter = (*b)->Start(PoolRequest("b1", pb), absl::Seconds(10), "", absl::Seconds(10)); });
    REQUIRE(WaitersReach(d, 1));
    REQUIRE((*holder)->Publish(pa).ok());
    t.join();
    REQUIRE(waiter.ok());
    REQUIRE((*waiter)->in_flight_seen().has_value());
    CHECK((*waiter)->in_flight_seen()->request_id == RequestId("a1"));
    CHECK((*waiter)->in_flight_seen()->blocks == 4);
    CHECK((*waiter)->in_flight_wait() == v1::IN_FLIGHT_PUBLISHED);
    CHECK((*waiter)->cached_tokens() == 16);
    CHECK_FALSE((*waiter)->in_flight().has_value());
    REQUIRE((*waiter)->Release(true).ok());
  } else {
    client::StepRequest req;
    client::StepBatch first;
    first.Start(&req, PoolRequest("b1", pb), absl::Seconds(10), absl::Seconds(10));
    auto answer = (*b)->Step(first);
    REQUIRE(answer.ok());
    REQUIRE(answer->items[0].status.ok());
    REQUIRE(req.waiting);
    REQUIRE(req.in_flight.has_value());
    CHECK(req.in_flight->request_id == RequestId("a1"));
    CHECK(req.in_flight->blocks == 4);
    REQUIRE((*holder)->Publish(pa).ok());
    for (int i = 0; i < 500 && req.waiting; ++i) {  // sent again until answered
      client::StepBatch again;
      again.Start(&req, PoolRequest("b1", pb), absl::Seconds(10), absl::Seconds(10));
      REQUIRE((*b)->Step(again).ok());
      if (req.waiting) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    REQUIRE(req.live);
    CHECK(req.in_flight_wait == v1::IN_FLIGHT_PUBLISHED);
    CHECK(req.acquired.cached_tokens == 16);
    client::StepBatch end;
    end.End(&req, 0, {}, true);
    REQUIRE((*b)->Step(end).ok());
  }
  REQUIRE((*holder)->Release(true).ok());
  REQUIRE(WaitersReach(d, 0));
}

}  // namespace
}  // namespace kvd
