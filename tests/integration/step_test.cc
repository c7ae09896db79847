// Steps (kvd.proto "Step", client/step.h) against a real kvd: a batch per step with block credit,
// bad input from a hand-made client, a worker killed holding credit, a start waiting in the queue,
// and a kvd restart under a stepping client.
#include <signal.h>

#include <algorithm>
#include <future>
#include <set>

#include <catch2/catch.hpp>

#include <grpcpp/grpcpp.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "client/client.h"
#include "kvd/v1/kvd.grpc.pb.h"
#include "tests/integration/harness.h"
#include "tests/integration/raw_attachment.h"

namespace kvd {
namespace {

using namespace kvd::testing;
using client::Client;

std::unique_ptr<Client> ConnectTo(const DaemonProcess& d, int64_t credit = 128) {
  auto c = Client::Connect({.target = d.target(), .worker_name = "test", .step_credit_blocks = credit});
  INFO(c.status().ToString());
  REQUIRE(c.ok());
  return std::move(*c);
}

// Waits until kvd holds nothing for any request or credit (a worker's exit is noticed async).
CacheReport WaitIdle(Client& observer) {
  CacheReport r;
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  do {
    r = *observer.Report();
    if (r.live_requests == 0 && r.reserved_bytes == 0) break;
    absl::SleepFor(absl::Milliseconds(50));
  } while (absl::Now() < deadline);
  return r;
}

TEST_CASE("A batch decodes through steps on credit, and another worker reuses it bit-exact", "[integration][step]") {
  DaemonProcess d(SmallPoolConfig(512));
  const std::vector<std::string> common = {"--target=" + d.target(), "--batch=8", "--prompt-len=21", "--shared=8",
                                           "--gen=40"};
  std::vector<std::string> a_args = common;
  a_args.push_back("--id=a");
  ProcessResult a = RunProcess(StepWorkerBinary(), a_args);
  INFO(a.out);
  REQUIRE(a.exit_code == 0);
  REQUIRE(JsonInt(a.out, "mismatches") == 0);
  // 1 start + 1 publish + 40 decode + 1 end steps; decode crosses a block every 4 positions for
  // 8 requests, and credit covers it: far fewer round trips than steps.
  REQUIRE(JsonInt(a.out, "steps") == 43);
  REQUIRE(JsonInt(a.out, "round_trips") <= 20);

  std::vector<std::string> b_args = common;
  b_args.push_back("--id=b");
  ProcessResult b = RunProcess(StepWorkerBinary(), b_args);
  INFO(b.out);
  REQUIRE(b.exit_code == 0);
  // A computed the 8 prompts side by side: the first to publish cached its whole chain (20 tokens:
  // one is left to compute); the others duplicated the shared 8 tokens and their chains continue
  // under the cached ones (kvd-reuse-2; before, they stopped there: 20 + 7 * 8).
  REQUIRE(JsonInt(b.out, "cached_tokens") == 8 * 20);
  REQUIRE(JsonInt(b.out, "verified_bytes") == 8 * 20 * 2 * 16);
  REQUIRE(JsonInt(b.out, "mismatches") == 0);

  auto observer = ConnectTo(d);
  const CacheReport r = WaitIdle(*observer);
  REQUIRE(r.live_requests == 0);
  REQUIRE(r.reserved_bytes == 0);  // the credit went back with each worker
}

TEST_CASE("A stepping worker preempts a request and resumes it from its checkpoint, bytes verified", "[integration][step]") {
  DaemonProcess d(SmallPoolConfig(512));
  ProcessResult w = RunProcess(StepWorkerBinary(), {"--target=" + d.target(), "--batch=4", "--prompt-len=10",
                                                    "--gen=20", "--preempt-at=7", "--id=p"});
  INFO(w.out);
  REQUIRE(w.exit_code == 0);
  REQUIRE(JsonInt(w.out, "resumed") == 1);
  REQUIRE(JsonInt(w.out, "mismatches") == 0);
  REQUIRE(JsonInt(w.out, "verified_bytes") >= 17 * 2 * 16 / 2);  // the resumed KV, read back
  REQUIRE(JsonInt(w.out, "kept_blocks") > 0);
}

TEST_CASE("A stepping worker SIGKILLed holding requests and credit gives everything back", "[integration][step]") {
  DaemonProcess d(SmallPoolConfig(512), {"--lease-ttl=4"});
  auto observer = ConnectTo(d);
  WorkerProcess w({"--target=" + d.target(), "--batch=6", "--prompt-len=10", "--gen=30", "--hang-after-steps=5"},
                  StepWorkerBinary());
  auto line = w.WaitForLine("STEPPING", absl::Seconds(15));
  INFO(line.status().ToString());
  REQUIRE(line.ok());
  const CacheReport holding = *observer->Report();
  REQUIRE(holding.live_requests == 6);
  REQUIRE(holding.reserved_bytes > 0);
  w.Kill(SIGKILL);
  const CacheReport r = WaitIdle(*observer);
  REQUIRE(r.live_requests == 0);
  REQUIRE(r.reserved_bytes == 0);
  REQUIRE(r.pools[0].owned_blocks == 0);
  REQUIRE(r.pools[0].free_blocks + r.pools[0].cached_blocks == 512);
}

// A raw step, as a careless or hostile client sends it.
struct RawStepper {
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Kvd::Stub> stub;
  std::unique_ptr<RawAttachment> attachment;
  uint64_t seq = 0;
  explicit RawStepper(const DaemonProcess& d)
      : channel(grpc::CreateChannel(d.target(), grpc::InsecureChannelCredentials())),
        stub(v1::Kvd::NewStub(channel)),
        attachment(AttachByHand(*stub)) {}
  const std::string& worker() const { return attachment->attached.worker_id(); }
  grpc::Status Send(v1::StepRequest req, v1::StepResponse* resp) {
    req.set_worker_id(worker());
    grpc::ClientContext ctx;
    return stub->Step(&ctx, req, resp);
  }
  v1::StepItem* Start(v1::StepRequest* req, const std::string& id, int prompt_len, int max_new = 8) {
    v1::StepItem* item = req->add_items();
    item->set_request_id(id);
    v1::AdmitRequest* admit = item->mutable_start()->mutable_admit();
    admit->mutable_namespace_()->set_pool("default");
    for (int t = 0; t < prompt_len; ++t) admit->add_prompt(static_cast<uint32_t>(7000 + t));
    admit->set_max_new_tokens(max_new);
    return item;
  }
};

int64_t HandleTokens(Client& observer, const std::string& id) {
  auto h = observer.GetHandle(RequestId(id));
  REQUIRE(h.ok());
  return h->num_tokens;
}

TEST_CASE("Bad steps get a clear status, per item or for the step, and change nothing", "[integration][step]") {
  DaemonProcess d(SmallPoolConfig(64));
  auto observer = ConnectTo(d);
  RawStepper raw(d);
  v1::StepRequest first;
  first.set_seq(1);
  raw.Start(&first, "r", 10);
  first.add_credit()->set_pool("default");
  first.mutable_credit(0)->set_blocks(4);
  v1::StepResponse resp;
  REQUIRE(raw.Send(first, &resp).ok());
  REQUIRE(resp.results(0).code() == 0);
  REQUIRE(resp.results(0).acquired().blocks_size() == 3);
  REQUIRE(resp.credit_size() == 1);
  REQUIRE(resp.credit(0).blocks_size() == 4);
  const uint32_t credit_block = resp.credit(0).blocks(0);
  REQUIRE(HandleTokens(*observer, "r") == 10);

  SECTION("a retry of the last step is answered from the record, applied once; an older seq is refused") {
    v1::StepRequest grow;
    grow.set_seq(2);
    v1::StepItem* g = grow.add_items();
    g->set_request_id("r");
    g->mutable_grow()->set_tokens(3);
    g->mutable_grow()->add_credit_blocks(credit_block);
    v1::StepResponse once, again;
    REQUIRE(raw.Send(grow, &once).ok());
    REQUIRE(once.results(0).code() == 0);
    REQUIRE(raw.Send(grow, &again).ok());
    REQUIRE(again.replayed());
    REQUIRE(again.results(0).blocks(0) == credit_block);
    REQUIRE(HandleTokens(*observer, "r") == 13);
    v1::StepRequest old = grow;
    old.set_seq(1);
    grpc::Status s = raw.Send(old, &again);
    REQUIRE(s.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    REQUIRE_THAT(s.error_message(), Catch::Contains("goes backwards"));
    REQUIRE(HandleTokens(*observer, "r") == 13);

    // The credit block is the request's now: naming it again is refused for that item alone.
    v1::StepRequest twice;
    twice.set_seq(3);
    v1::StepItem* t = twice.add_items();
    t->set_request_id("r");
    t->mutable_grow()->set_tokens(4);
    t->mutable_grow()->add_credit_blocks(credit_block);
    v1::StepItem* ok = twice.add_items();
    ok->set_request_id("r");
    ok->mutable_grow()->set_tokens(1);
    REQUIRE(raw.Send(twice, &resp).ok());
    REQUIRE(resp.results(0).code() == grpc::StatusCode::INVALID_ARGUMENT);
    REQUIRE_THAT(resp.results(0).message(), Catch::Contains("not in this worker's credit"));
    REQUIRE(resp.results(1).code() == 0);
    REQUIRE(HandleTokens(*observer, "r") == 14);
  }
  SECTION("per item: a start twice, an unknown request, no operation, a publish past the table, growth past max_model_len") {
    v1::StepRequest bad;
    bad.set_seq(2);
    raw.Start(&bad, "n", 4);
    raw.Start(&bad, "n", 4);
    v1::StepItem* unknown = bad.add_items();
    unknown->set_request_id("nobody");
    unknown->mutable_grow()->set_tokens(1);
    bad.add_items()->set_request_id("r");
    v1::StepItem* pub = bad.add_items();
    pub->set_request_id("r");
    pub->mutable_publish()->set_num_blocks(9);
    v1::StepItem* huge = bad.add_items();
    huge->set_request_id("r");
    huge->mutable_grow()->set_tokens(1000);
    REQUIRE(raw.Send(bad, &resp).ok());
    REQUIRE(resp.results(0).code() == 0);
    REQUIRE(resp.results(1).code() == grpc::StatusCode::INVALID_ARGUMENT);
    REQUIRE_THAT(resp.results(1).message(), Catch::Contains("appears already in item 0"));
    REQUIRE(resp.results(2).code() == grpc::StatusCode::NOT_FOUND);
    REQUIRE(resp.results(3).code() == grpc::StatusCode::INVALID_ARGUMENT);
    REQUIRE_THAT(resp.results(3).message(), Catch::Contains("no operation"));
    REQUIRE(resp.results(4).code() == grpc::StatusCode::INVALID_ARGUMENT);
    REQUIRE(resp.results(5).code() == grpc::StatusCode::OUT_OF_RANGE);
    REQUIRE(HandleTokens(*observer, "r") == 10);
  }
  SECTION("whole step: seq 0, 100,000 items, credit for an unknown pool; nothing applied") {
    v1::StepRequest zero;
    raw.Start(&zero, "z", 4);
    grpc::Status s = raw.Send(zero, &resp);
    REQUIRE(s.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    REQUIRE_THAT(s.error_message(), Catch::Contains("seq"));

    v1::StepRequest many;
    many.set_seq(2);
    for (int i = 0; i < 100000; ++i) {
      v1::StepItem* item = many.add_items();
      item->set_request_id("r");
      item->mutable_grow()->set_tokens(0);
    }
    s = raw.Send(many, &resp);
    REQUIRE(s.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    REQUIRE_THAT(s.error_message(), Catch::Contains("100000 items"));

    v1::StepRequest pool;
    pool.set_seq(2);
    v1::StepItem* g = pool.add_items();
    g->set_request_id("r");
    g->mutable_grow()->set_tokens(2);
    pool.add_credit()->set_pool("no-such-pool");
    s = raw.Send(pool, &resp);
    REQUIRE(s.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    REQUIRE_THAT(s.error_message(), Catch::Contains("no-such-pool"));
    REQUIRE(HandleTokens(*observer, "r") == 10);
    REQUIRE(observer->Report()->live_requests == 1);
  }
  SECTION("another worker's request and id are refused") {
    RawStepper other(d);
    v1::StepRequest theirs;
    theirs.set_seq(1);
    v1::StepItem* g = theirs.add_items();
    g->set_request_id("r");
    g->mutable_grow()->set_tokens(4);
    REQUIRE(other.Send(theirs, &resp).ok());
    REQUIRE(resp.results(0).code() == grpc::StatusCode::PERMISSION_DENIED);
    REQUIRE(HandleTokens(*observer, "r") == 10);
  }
  // Whatever happened, the worker's going gives everything back.
  raw.attachment.reset();
  const CacheReport r = WaitIdle(*observer);
  REQUIRE(r.live_requests == 0);
  REQUIRE(r.reserved_bytes == 0);
}

TEST_CASE("A start that does not fit waits in its pool's queue and keeps its place across steps", "[integration][step]") {
  DaemonProcess d(SmallPoolConfig(16));
  auto holder = ConnectTo(d);
  auto stepper = ConnectTo(d, /*credit=*/0);
  auto late = ConnectTo(d);
  RequestSpec big;
  big.id = RequestId("big");
  big.ns.pool = "default";
  big.prompt = std::vector<Token>(44, 5);  // 11 of 16 blocks
  auto held = holder->Start(big);
  REQUIRE(held.ok());

  client::StepRequest waiting;
  RequestSpec mid = big;
  mid.id = RequestId("mid");
  mid.prompt = std::vector<Token>(32, 6);  // 8 blocks: waits
  client::StepBatch batch;
  batch.Start(&waiting, mid, absl::Seconds(20));
  auto answer = stepper->Step(batch);
  REQUIRE(answer.ok());
  REQUIRE(answer->items[0].status.ok());
  REQUIRE(answer->items[0].waiting);
  REQUIRE(waiting.waiting);

  // A later start that would fit on its own (2 blocks) queues behind the waiting one.
  RequestSpec small = big;
  small.id = RequestId("small");
  small.prompt = std::vector<Token>(8, 7);
  auto small_started = std::async(std::launch::async, [&] { return late->Start(small, absl::Seconds(20)); });
  REQUIRE(small_started.wait_for(std::chrono::milliseconds(500)) == std::future_status::timeout);

  REQUIRE((*held)->Release(true).ok());
  // The waiting start is admitted in the queue; the next step sending it again acquires it.
  absl::StatusOr<client::StepAnswer> again;
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  do {
    absl::SleepFor(absl::Milliseconds(50));
    client::StepBatch retry;
    retry.Start(&waiting, mid, absl::Seconds(20));
    again = stepper->Step(retry);
    REQUIRE(again.ok());
  } while (again->items[0].waiting && absl::Now() < deadline);
  REQUIRE(again->items[0].status.ok());
  REQUIRE(waiting.live);
  REQUIRE(waiting.blocks.size() == 8);
  auto small_req = small_started.get();
  REQUIRE(small_req.ok());

  SECTION("ending a waiting start withdraws it from the queue") {
    client::StepRequest never;
    RequestSpec huge = big;
    huge.id = RequestId("huge");
    huge.prompt = std::vector<Token>(40, 9);  // 10 blocks: does not fit beside mid and small
    client::StepBatch b;
    b.Start(&never, huge, absl::Seconds(20));
    REQUIRE(stepper->Step(b)->items[0].waiting);
    client::StepBatch withdraw;
    withdraw.End(&never, 0, {}, false);
    withdraw.End(&waiting, 0, {}, true);  // room for huge now, but it was withdrawn
    auto w = stepper->Step(withdraw);
    REQUIRE(w.ok());
    REQUIRE(w->items[0].status.ok());
    REQUIRE(w->items[1].status.ok());
    absl::SleepFor(absl::Milliseconds(300));
    REQUIRE(absl::IsNotFound(holder->GetHandle(RequestId("huge")).status()));
    REQUIRE(holder->Report()->live_requests == 1);  // small
  }
}

// Issue 40, items 1 and 5, against the real daemon with a hand-made (careless) client: under
// critical pressure kvd used to give a worker's credit back to the free list at its next step,
// and the next start (another worker's) was handed those blocks while the worker could still be
// writing them. Now kvd asks for them back and waits for the worker to name them.
TEST_CASE("Credit is asked back under pressure, never taken: nobody else is given a worker's credit",
          "[integration][step]") {
  DaemonProcess d(SmallPoolConfig(64));
  auto observer = ConnectTo(d);
  RawStepper careless(d);
  RawStepper hog(d);
  auto credit_step = [&](uint64_t seq, std::vector<uint32_t> returned, v1::StepResponse* resp) {
    v1::StepRequest req;
    req.set_seq(seq);
    v1::CreditWant* c = req.add_credit();
    c->set_pool("default");
    c->set_blocks(8);
    c->mutable_returned()->Add(returned.begin(), returned.end());
    grpc::Status s = careless.Send(req, resp);
    INFO(s.error_message());
    REQUIRE(s.ok());
  };
  v1::StepResponse resp;
  credit_step(1, {}, &resp);
  REQUIRE(resp.credit_size() == 1);
  const std::vector<uint32_t> credit(resp.credit(0).blocks().begin(), resp.credit(0).blocks().end());
  REQUIRE(credit.size() == 8);  // an eighth of the pool

  // Another worker takes 53 of the 56 blocks left: critical pressure.
  v1::StepRequest big;
  big.set_seq(1);
  hog.Start(&big, "big", 180, /*max_new=*/20);
  hog.Start(&big, "big2", 12, /*max_new=*/0);
  v1::StepResponse big_resp;
  REQUIRE(hog.Send(big, &big_resp).ok());
  REQUIRE(big_resp.results(0).code() == 0);
  REQUIRE(big_resp.results(1).code() == 0);

  // The careless worker's next step asks for its usual credit and returns nothing.
  credit_step(2, {}, &resp);
  REQUIRE(resp.credit_size() == 1);
  std::vector<uint32_t> held(resp.credit(0).blocks().begin(), resp.credit(0).blocks().end());
  std::sort(held.begin(), held.end());
  std::vector<uint32_t> sorted = credit;
  std::sort(sorted.begin(), sorted.end());
  REQUIRE(held == sorted);
  REQUIRE(resp.credit(0).wanted() == 8);

  // Whatever another worker starts now gets none of them.
  v1::StepRequest small;
  small.set_seq(2);
  hog.Start(&small, "small", 12, /*max_new=*/0);
  v1::StepResponse small_resp;
  REQUIRE(hog.Send(small, &small_resp).ok());
  REQUIRE(small_resp.results(0).code() == 0);
  for (uint32_t b : small_resp.results(0).acquired().blocks()) {
    INFO("block " << b);
    REQUIRE(std::find(credit.begin(), credit.end(), b) == credit.end());
  }

  // Returned by name, they go back at once (a name it does not hold is skipped).
  const int64_t reserved = observer->Report()->reserved_bytes;
  std::vector<uint32_t> back = credit;
  back.push_back(small_resp.results(0).acquired().blocks(0));
  credit_step(3, back, &resp);
  REQUIRE(resp.credit_size() == 0);
  REQUIRE(observer->Report()->reserved_bytes < reserved);
  REQUIRE(HandleTokens(*observer, "small") == 12);
}

TEST_CASE("A waiting start sent again with another spec is refused; credit is asked back while starts wait",
          "[integration][step]") {
  DaemonProcess d(SmallPoolConfig(64));
  RawStepper worker(d);
  RawStepper hog(d);
  v1::StepRequest first;
  first.set_seq(1);
  first.add_credit()->set_pool("default");
  first.mutable_credit(0)->set_blocks(8);
  v1::StepResponse resp;
  REQUIRE(worker.Send(first, &resp).ok());
  REQUIRE(resp.credit(0).blocks_size() == 8);
  v1::StepRequest big;
  big.set_seq(1);
  hog.Start(&big, "big", 160, /*max_new=*/0);  // 40 blocks: 16 left
  REQUIRE(hog.Send(big, &resp).ok());
  REQUIRE(resp.results(0).code() == 0);

  v1::StepRequest wait;
  wait.set_seq(2);
  worker.Start(&wait, "w", 80, /*max_new=*/0)->mutable_start()->set_max_wait_ms(20000);  // 20 blocks
  wait.add_credit()->set_pool("default");
  wait.mutable_credit(0)->set_blocks(8);
  REQUIRE(worker.Send(wait, &resp).ok());
  REQUIRE(resp.results(0).code() == 0);
  REQUIRE(resp.results(0).waiting());

  // Sent again as it was: still waiting, and the worker's idle credit is asked back for it.
  wait.set_seq(3);
  REQUIRE(worker.Send(wait, &resp).ok());
  REQUIRE(resp.results(0).code() == 0);
  REQUIRE(resp.results(0).waiting());
  REQUIRE(resp.credit_size() == 1);
  REQUIRE(resp.credit(0).wanted() == resp.credit(0).blocks_size());
  const std::vector<uint32_t> idle(resp.credit(0).blocks().begin(), resp.credit(0).blocks().end());

  // Sent again asking for something else: refused, naming why; the first keeps its place.
  v1::StepRequest other;
  other.set_seq(4);
  worker.Start(&other, "w", 84, /*max_new=*/0)->mutable_start()->set_max_wait_ms(20000);
  REQUIRE(worker.Send(other, &resp).ok());
  REQUIRE(resp.results(0).code() == grpc::StatusCode::FAILED_PRECONDITION);
  REQUIRE_THAT(resp.results(0).message(), Catch::Contains("waiting with another start"));

  // The worker gives its credit back; the hog ends: the first spec is admitted (20 blocks).
  v1::StepRequest give;
  give.set_seq(5);
  give.add_credit()->set_pool("default");
  give.mutable_credit(0)->mutable_returned()->Add(idle.begin(), idle.end());
  REQUIRE(worker.Send(give, &resp).ok());
  REQUIRE(resp.credit_size() == 0);
  v1::StepRequest end;
  end.set_seq(2);
  v1::StepItem* e = end.add_items();
  e->set_request_id("big");
  e->mutable_end()->set_completed(true);
  REQUIRE(hog.Send(end, &resp).ok());
  REQUIRE(resp.results(0).code() == 0);
  uint64_t seq = 6;
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  do {
    wait.set_seq(seq++);
    REQUIRE(worker.Send(wait, &resp).ok());
  } while (resp.results(0).waiting() && absl::Now() < deadline);
  REQUIRE(resp.results(0).code() == 0);
  REQUIRE(resp.results(0).acquired().blocks_size() == 20);
}

TEST_CASE("A kvd restart under a stepping client: its requests fail as restarted, credit starts over", "[integration][step]") {
  DaemonProcess d(SmallPoolConfig(128));
  auto c = ConnectTo(d, 16);
  client::StepRequest r;
  RequestSpec spec;
  spec.id = RequestId("r");
  spec.ns.pool = "default";
  spec.prompt = std::vector<Token>(10, 3);
  spec.max_new_tokens = 32;
  client::StepBatch b;
  b.Start(&r, spec);
  REQUIRE(c->Step(b)->items[0].status.ok());
  REQUIRE(c->StepCredit(0) == 16);

  REQUIRE(d.Restart());
  REQUIRE(c->WaitAttached(absl::Seconds(10)).ok());
  client::StepBatch grow;
  grow.Grow(&r, 1);
  auto a = c->Step(grow);
  REQUIRE(a.ok());
  REQUIRE(client::IsKvdRestarted(a->items[0].status));
  REQUIRE(c->StepCredit(0) == 0);

  client::StepRequest fresh;
  spec.id = RequestId("fresh");
  client::StepBatch start;
  start.Start(&fresh, spec);
  auto s = c->Step(start);
  REQUIRE(s.ok());
  REQUIRE(s->items[0].status.ok());
  REQUIRE(c->StepCredit(0) == 16);
}

TEST_CASE("Across --takeover, a stopped stepping worker's credit and tables are fenced: nobody else is given them",
          "[integration][step][handoff]") {
  DaemonProcess d(SmallPoolConfig(64, "lease_ttl_s: 5\n"));
  // Requests of 8 tokens, 8 blocks of credit (an eighth of the pool), hung mid-decode.
  WorkerProcess w({"--target=" + d.target(), "--batch=2", "--prompt-len=8", "--gen=30", "--hang-after-steps=2",
                   "--step-credit=8"},
                  StepWorkerBinary());
  auto line = w.WaitForLine("STEPPING", absl::Seconds(15));
  INFO(line.status().ToString());
  REQUIRE(line.ok());
  std::set<uint32_t> mine;
  for (absl::string_view b : absl::StrSplit(line->substr(line->find("writable=") + 9), ',', absl::SkipEmpty())) {
    uint32_t n = 0;
    REQUIRE(absl::SimpleAtoi(absl::StripAsciiWhitespace(b), &n));
    mine.insert(n);
  }
  REQUIRE(mine.size() >= 2 + 4);  // a decode block per table, and what is left of the credit
  // Stopped, it can neither write nor quiesce and re-attach (which would hand its blocks on at
  // once): they stay fenced for the lease TTL.
  w.Signal(SIGSTOP);
  REQUIRE(d.TakeOver());
  // Other processes now take whatever the successor hands out: none of it is the hung worker's.
  for (int i = 0; i < 6; ++i) {
    ProcessResult other = RunWorker({"--target=" + d.target(), absl::StrCat("--id=o", i),
                                     absl::StrCat("--prompt-range=", 9000 + 100 * i, ":24"), "--gen=2"});
    INFO(other.out);
    REQUIRE(other.exit_code == 0);
    const std::string list = other.out.substr(other.out.find("\"blocks\": [") + 11);
    for (absl::string_view b : absl::StrSplit(list.substr(0, list.find(']')), ',', absl::SkipEmpty())) {
      uint32_t n = 0;
      REQUIRE(absl::SimpleAtoi(absl::StripAsciiWhitespace(b), &n));
      INFO("block " << n);
      REQUIRE_FALSE(mine.contains(n));
    }
  }
  w.Kill(SIGKILL);
}

TEST_CASE("The C++ client's typed calls: prefetch, objects, sessions, peek", "[integration][step]") {
  TempDir disk;
  DaemonProcess d(SmallPoolConfig(64, "tiers:\n  host_bytes: 1048576\n  disk_dir: " + disk.path() + "\n"));
  auto c = ConnectTo(d);
  Namespace ns;
  ns.pool = "default";
  REQUIRE(c->PutObject(ns, "vision/x", "pixels").ok());
  REQUIRE(*c->GetObject(ns, "vision/x") == "pixels");
  REQUIRE(c->DeleteObject(ns, "vision/x").ok());
  REQUIRE(absl::IsNotFound(c->GetObject(ns, "vision/x").status()));
  REQUIRE(absl::IsInvalidArgument(c->PutObject(ns, "", "x")));  // bad input named, nothing stored

  RequestSpec spec;
  spec.id = RequestId("s");
  spec.ns = ns;
  spec.prompt = std::vector<Token>(12, 4);
  spec.session = SessionId("conv-1");
  auto r = c->Start(spec);
  REQUIRE(r.ok());
  REQUIRE((*r)->End(3, {}, true).ok());
  auto sessions = c->ListSessions();
  REQUIRE(sessions.ok());
  REQUIRE(sessions->size() == 1);
  REQUIRE((*sessions)[0].id == SessionId("conv-1"));
  REQUIRE(*c->PeekPrefixLen(ns, std::vector<Token>(13, 4)) == 12);

  std::vector<Token> prompt(12, 4);
  auto p = c->Prefetch(ns, prompt);
  REQUIRE(p.ok());
  REQUIRE(c->ReleasePrefetch(p->handle).ok());
  REQUIRE(absl::IsNotFound(c->ReleasePrefetch(p->handle)));  // released twice: named
}

}  // namespace
}  // namespace kvd
