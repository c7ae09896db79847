// The two-round-trip protocol against the real daemon: Start waits for admission inside the
// daemon, first come first served per pool, until the deadline; a caller that gives up, a worker
// that detaches and a drain while waiting leave nothing admitted. End publishes the first N
// blocks over the tokens the daemon already holds and releases, all or nothing.
#include <atomic>
#include <thread>

#include <catch2/catch.hpp>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "client/client.h"
#include "kvd/v1/kvd.grpc.pb.h"
#include "tests/integration/harness.h"
#include "tests/integration/raw_attachment.h"

namespace kvd {
namespace {

using namespace kvd::testing;

// 8 blocks of 4 tokens: the whole budget.
constexpr int kCapacity = 8;

std::unique_ptr<v1::Kvd::Stub> NewStub(const DaemonProcess& d) {
  return v1::Kvd::NewStub(grpc::CreateChannel(d.target(), grpc::InsecureChannelCredentials()));
}

v1::StartRequest StartOf(const std::string& worker, const std::string& id, int blocks, Token first = 1,
                         int64_t max_wait_ms = 10000) {
  v1::StartRequest req;
  v1::AdmitRequest* a = req.mutable_admit();
  a->set_worker_id(worker);
  a->set_request_id(id);
  a->mutable_namespace_()->set_pool("default");
  for (int t = 0; t < blocks * 4; ++t) a->add_prompt(first + t);
  req.set_max_wait_ms(max_wait_ms);
  return req;
}

grpc::Status Start(v1::Kvd::Stub& stub, const v1::StartRequest& req, v1::StartResponse* resp,
                   grpc::ClientContext* ctx = nullptr) {
  grpc::ClientContext own;
  return stub.Start(ctx != nullptr ? ctx : &own, req, resp);
}

grpc::Status End(v1::Kvd::Stub& stub, const std::string& worker, const std::string& id, int publish_blocks,
                 std::vector<Token> more = {}, v1::EndResponse* resp = nullptr) {
  grpc::ClientContext ctx;
  v1::EndRequest req;
  req.set_worker_id(worker);
  req.set_request_id(id);
  req.set_publish_blocks(publish_blocks);
  for (Token t : more) req.add_more_tokens(t);
  req.set_completed(true);
  v1::EndResponse ignored;
  return stub.End(&ctx, req, resp != nullptr ? resp : &ignored);
}

v1::ReportResponse Report(v1::Kvd::Stub& stub) {
  grpc::ClientContext ctx;
  v1::ReportResponse r;
  REQUIRE(stub.Report(&ctx, v1::ReportRequest(), &r).ok());
  return r;
}

// A daemon whose pool holds `capacity` 4-token blocks, and one worker attached by hand.
struct Node {
  explicit Node(int capacity) : d(SmallPoolConfig(capacity)), stub(NewStub(d)), w(AttachByHand(*stub)),
                                worker(w->attached.worker_id()) {}
  DaemonProcess d;
  std::unique_ptr<v1::Kvd::Stub> stub;
  std::unique_ptr<RawAttachment> w;
  std::string worker;
};

// Polls Report until `n` Start calls wait (at most 10 s).
void AwaitWaiting(v1::Kvd::Stub& stub, int64_t n) {
  for (int i = 0; i < 1000 && Report(stub).admission_waiting() != n; ++i) absl::SleepFor(absl::Milliseconds(10));
  REQUIRE(Report(stub).admission_waiting() == n);
}

TEST_CASE("Start waits inside the daemon, first come first served per pool", "[integration][start]") {
  Node node(kCapacity);
  auto& stub = node.stub;
  const std::string& worker = node.worker;

  v1::StartResponse holder;
  REQUIRE(Start(*stub, StartOf(worker, "holder", 6), &holder).ok());
  CHECK_FALSE(holder.waited());
  CHECK(holder.acquired().blocks_size() == 6);

  // "big" needs 6 blocks and waits; "small" needs 1, which would fit now, but queues behind it.
  std::vector<std::string> order;
  absl::Mutex order_mu;
  v1::StartResponse big, small;
  grpc::Status big_status, small_status;
  std::thread t1([&] {
    big_status = Start(*stub, StartOf(worker, "big", 6, 100), &big);
    absl::MutexLock lock(&order_mu);
    order.push_back("big");
  });
  AwaitWaiting(*stub, 1);
  std::thread t2([&] {
    small_status = Start(*stub, StartOf(worker, "small", 1, 200), &small);
    absl::MutexLock lock(&order_mu);
    order.push_back("small");
  });
  AwaitWaiting(*stub, 2);
  CHECK(Report(*stub).live_requests() == 1);

  REQUIRE(End(*stub, worker, "holder", 0).ok());  // room for both, in order
  t1.join();
  t2.join();
  INFO(big_status.error_message() << " / " << small_status.error_message());
  REQUIRE(big_status.ok());
  REQUIRE(small_status.ok());
  CHECK(big.waited());
  CHECK(big.waited_us() > 0);
  CHECK(small.waited());  // it fit on arrival, yet waited its turn
  CHECK(big.acquired().blocks_size() == 6);
  CHECK(small.acquired().blocks_size() == 1);
  CHECK(Report(*stub).admission_waiting() == 0);
  CHECK(Report(*stub).live_requests() == 2);
}

TEST_CASE("A Start that waits past its bound, is abandoned, or outlives its worker leaves nothing",
          "[integration][start]") {
  Node node(kCapacity);
  auto& stub = node.stub;
  const std::string& worker = node.worker;
  v1::StartResponse resp;
  REQUIRE(Start(*stub, StartOf(worker, "holder", 8), &resp).ok());

  SECTION("the wait bound passes") {
    const grpc::Status s = Start(*stub, StartOf(worker, "late", 2, 50, /*max_wait_ms=*/200), &resp);
    CHECK(s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
    CHECK(s.error_message().find("not admitted within") != std::string::npos);
  }
  SECTION("the call's own deadline passes first") {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(200));
    const grpc::Status s = Start(*stub, StartOf(worker, "late", 2, 50), &resp, &ctx);
    CHECK(s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED);
  }
  SECTION("the caller cancels") {
    grpc::ClientContext ctx;
    grpc::Status s;
    std::thread t([&] { s = Start(*stub, StartOf(worker, "late", 2, 50), &resp, &ctx); });
    AwaitWaiting(*stub, 1);
    ctx.TryCancel();
    t.join();
    CHECK(s.error_code() == grpc::StatusCode::CANCELLED);
  }
  SECTION("its worker detaches while it waits, then room appears") {
    auto other = AttachByHand(*stub);
    grpc::Status s;
    v1::StartResponse late;
    std::thread t([&] { s = Start(*stub, StartOf(other->attached.worker_id(), "orphan", 2, 50), &late); });
    AwaitWaiting(*stub, 1);
    other.reset();  // the attachment ends: the worker is gone
    for (int i = 0; i < 500 && Report(*stub).attached_workers() != 1; ++i) absl::SleepFor(absl::Milliseconds(10));
    REQUIRE(End(*stub, worker, "holder", 0).ok());
    t.join();
    INFO(s.error_message());
    CHECK(s.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
    CHECK(Report(*stub).live_requests() == 0);
    return;
  }
  SECTION("the daemon drains") {
    grpc::Status s;
    std::thread t([&] { s = Start(*stub, StartOf(worker, "late", 2, 50), &resp); });
    AwaitWaiting(*stub, 1);
    grpc::ClientContext ctx;
    v1::DrainResponse drained;
    REQUIRE(stub->Drain(&ctx, v1::DrainRequest(), &drained).ok());
    t.join();
    CHECK(s.error_code() == grpc::StatusCode::UNAVAILABLE);
  }
  // Whatever ended the wait: nothing waits, only the holder is live, and the room it frees is
  // there for the next request (none was leaked).
  for (int i = 0; i < 100 && Report(*stub).admission_waiting() != 0; ++i) absl::SleepFor(absl::Milliseconds(10));
  CHECK(Report(*stub).admission_waiting() == 0);
  CHECK(Report(*stub).live_requests() == 1);
  REQUIRE(End(*stub, worker, "holder", 0).ok());
  CHECK(Report(*stub).reserved_bytes() == 0);
}

TEST_CASE("Start refuses bad input and gives back an admission whose Acquire fails", "[integration][start]") {
  Node node(kCapacity);
  auto& stub = node.stub;
  const std::string& worker = node.worker;
  v1::StartResponse resp;

  v1::StartRequest negative = StartOf(worker, "r", 1);
  negative.set_max_wait_ms(-1);
  CHECK(Start(*stub, negative, &resp).error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  v1::StartRequest empty = StartOf(worker, "r", 0);
  CHECK(Start(*stub, empty, &resp).error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  v1::StartRequest nopool = StartOf(worker, "r", 1);
  nopool.mutable_admit()->mutable_namespace_()->set_pool("llama-405b");
  CHECK(Start(*stub, nopool, &resp).error_code() == grpc::StatusCode::NOT_FOUND);
  CHECK(Start(*stub, StartOf("w-forged", "r", 1), &resp).error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  v1::StartRequest huge = StartOf(worker, "r", 1);
  huge.mutable_admit()->set_max_new_tokens(std::numeric_limits<int64_t>::max());
  CHECK(Start(*stub, huge, &resp).error_code() == grpc::StatusCode::OUT_OF_RANGE);

  // Admitted, then Acquire fails (a resume whose prompt does not continue the checkpoint):
  // nothing stays admitted, and the right resume then succeeds.
  v1::StartRequest first = StartOf(worker, "ck", 2);
  first.mutable_admit()->set_max_new_tokens(4);
  REQUIRE(Start(*stub, first, &resp).ok());
  {
    grpc::ClientContext ctx;
    v1::CheckpointRequest ck;
    ck.set_worker_id(worker);
    ck.set_request_id("ck");
    for (Token t = 1; t <= 8; ++t) ck.add_tokens(t);
    ck.set_engine_state("s");
    v1::CheckpointResponse done;
    REQUIRE(stub->Checkpoint(&ctx, ck, &done).ok());
    grpc::ClientContext rctx;
    v1::ReleaseRequest rel;
    rel.set_worker_id(worker);
    rel.set_request_id("ck");
    rel.set_completed(false);  // interrupted: the checkpoint stays for a resume
    v1::ReleaseResponse released;
    REQUIRE(stub->Release(&rctx, rel, &released).ok());
  }
  const int64_t reserved = Report(*stub).reserved_bytes();  // the orphaned checkpoint's blocks
  v1::StartRequest wrong = StartOf(worker, "ck", 2, 50);
  wrong.mutable_admit()->set_resume_from("ck");
  const grpc::Status s = Start(*stub, wrong, &resp);
  CHECK(s.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  CHECK(Report(*stub).live_requests() == 0);
  CHECK(Report(*stub).reserved_bytes() == reserved);
  v1::StartRequest right = StartOf(worker, "ck", 2);
  right.mutable_admit()->set_resume_from("ck");
  REQUIRE(Start(*stub, right, &resp).ok());  // the id was given back
  CHECK(resp.acquired().resumed());
}

TEST_CASE("End publishes the first N blocks from the tokens the daemon holds, all or nothing",
          "[integration][start]") {
  Node node(64);
  auto& stub = node.stub;
  const std::string& worker = node.worker;
  v1::StartResponse resp;
  v1::StartRequest req = StartOf(worker, "first", 3);  // 12 tokens
  req.mutable_admit()->set_max_new_tokens(4);
  REQUIRE(Start(*stub, req, &resp).ok());
  {
    grpc::ClientContext ctx;
    v1::ExtendRequest ext;
    ext.set_worker_id(worker);
    ext.set_request_id("first");
    ext.set_additional_tokens(4);  // a fourth block for decode
    v1::ExtendResponse extended;
    REQUIRE(stub->Extend(&ctx, ext, &extended).ok());
  }

  // Bad input changes nothing: the request stays live and publishable.
  CHECK(End(*stub, worker, "first", -1).error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK(End(*stub, worker, "first", 5).error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK(End(*stub, worker, "first", 4).error_code() == grpc::StatusCode::INVALID_ARGUMENT);  // decode tokens unknown
  CHECK(End(*stub, worker, "first", 4, {1, 2, 3, 4, 5}).error_code() ==
        grpc::StatusCode::INVALID_ARGUMENT);  // past the positions
  auto other = AttachByHand(*stub);
  CHECK(End(*stub, other->attached.worker_id(), "first", 3).error_code() == grpc::StatusCode::PERMISSION_DENIED);
  CHECK(Report(*stub).live_requests() == 1);
  CHECK(Report(*stub).published_blocks() == 0);

  v1::EndResponse ended;
  REQUIRE(End(*stub, worker, "first", 4, {900, 901, 902, 903}, &ended).ok());
  CHECK(ended.kept() == 4);
  CHECK(Report(*stub).live_requests() == 0);
  CHECK(End(*stub, worker, "first", 0).error_code() == grpc::StatusCode::NOT_FOUND);  // ended once

  // The next request reuses the prompt and the decoded block (capped to leave one token).
  v1::StartRequest again = StartOf(worker, "second", 3);
  for (Token t : {900, 901, 902, 903, 904}) again.mutable_admit()->add_prompt(t);
  REQUIRE(Start(*stub, again, &resp).ok());
  CHECK(resp.acquired().cached_tokens() == 16);
}

TEST_CASE("The C++ client's Start and End take two round trips", "[integration][start]") {
  DaemonProcess d(SmallPoolConfig(kCapacity));
  auto c = client::Client::Connect({.target = d.target(), .worker_name = "fast"});
  REQUIRE(c.ok());
  RequestSpec spec;
  spec.id = RequestId("a");
  spec.ns.pool = "default";
  for (Token t = 1; t <= 8; ++t) spec.prompt.push_back(t);
  auto a = (*c)->Start(spec);
  REQUIRE(a.ok());
  spec.id = RequestId("b");
  for (Token t = 9; t <= 28; ++t) spec.prompt.push_back(t);  // 7 blocks: no room while a lives
  auto refused = (*c)->Start(spec, absl::Milliseconds(100));
  CHECK(absl::IsDeadlineExceeded(refused.status()));
  auto ended = (*a)->End(/*publish_blocks=*/2, {}, /*completed=*/true);
  REQUIRE(ended.ok());
  CHECK(ended->kept == 2);
  auto b = (*c)->Start(spec);
  REQUIRE(b.ok());
  CHECK((*b)->cached_tokens() == 8);
}

}  // namespace
}  // namespace kvd
