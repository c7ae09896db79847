// No block changes hands while its old owner can still write it (docs/security.md, "Leases and
// fencing"). A worker writes its prompt's KV slowly on a second thread (a long prefill, a GPU
// stream) while kvd is taken over, fails over, or while the worker itself is stopped past its
// lease; another tenant's worker then takes blocks and publishes, and a third reads that prompt
// back checking every byte. Before fences, the new worker was given the writer's blocks (the
// allocator hands out the lowest free indices first) and the reader saw the writer's bytes.
#include <signal.h>

#include <algorithm>
#include <set>

#include <catch2/catch.hpp>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kvd/v1/kvd.grpc.pb.h"
#include "tests/integration/fence_fixture.h"
#include "tests/integration/harness.h"
#include "tests/integration/raw_attachment.h"

namespace kvd {
namespace {

using namespace kvd::testing;

// 64 tokens (16 blocks) at 40 ms a token: about 2.6 s of writes after WRITING.
std::vector<std::string> SlowWriter(const std::string& target) {
  return {"--target=" + target, "--id=writer", "--prompt-range=0:64", "--async-writer-us=40000",
          "--salt=tenant-a"};
}

TEST_CASE("An asynchronous writer across --takeover: nothing it may still write goes to another tenant",
          "[integration][fences][handoff]") {
  DaemonProcess d(SmallPoolConfig(64));
  WorkerProcess a(SlowWriter(d.target()));
  REQUIRE(a.WaitForLine("WRITING", absl::Seconds(20)).ok());
  absl::SleepFor(absl::Milliseconds(300));
  REQUIRE(d.TakeOver());
  AnotherTenantReadsBackExactly(d.target());
}

// The careless engine of kvd-hardening-4: its writer thread waits while Client::MayWrite() is
// false and writes on once it is true again, it registers no quiesce hook and no write fence.
// Before: its client re-attached saying `quiesced` anyway, kvd lifted the pid's fences and the
// other tenant's blocks were overwritten (every byte). Now the client cannot vouch for it, so kvd
// keeps the attachment's blocks fenced for the lease TTL.
TEST_CASE("A writer gated on the client's lease alone, with no quiesce hook, across --takeover: its blocks stay fenced",
          "[integration][fences][handoff]") {
  DaemonProcess d(SmallPoolConfig(64));
  std::vector<std::string> args = SlowWriter(d.target());
  args.push_back("--careless-writer");
  WorkerProcess a(args);
  REQUIRE(a.WaitForLine("WRITING", absl::Seconds(20)).ok());
  absl::SleepFor(absl::Milliseconds(300));
  REQUIRE(d.TakeOver());
  AnotherTenantReadsBackExactly(d.target());
}

v1::StartRequest StartOf(const std::string& worker, const std::string& id, int blocks, Token first) {
  v1::StartRequest req;
  v1::AdmitRequest* a = req.mutable_admit();
  a->set_worker_id(worker);
  a->set_request_id(id);
  a->mutable_namespace_()->set_pool("default");
  for (int t = 0; t < blocks * 4; ++t) a->add_prompt(first + t);
  req.set_max_wait_ms(5000);
  return req;
}

std::set<uint32_t> StartBlocks(v1::Kvd::Stub& stub, const v1::StartRequest& req) {
  grpc::ClientContext ctx;
  v1::StartResponse resp;
  const grpc::Status s = stub.Start(&ctx, req, &resp);
  INFO(s.error_message());
  REQUIRE(s.ok());
  return {resp.acquired().blocks().begin(), resp.acquired().blocks().end()};
}

// The C++ client cancels its stream when kvd's acks are late, and a TCP connection can break,
// while the worker's writes are in flight (it quiesces only after it notices). Before: kvd
// released the worker's requests at once and the next start was given their blocks.
TEST_CASE("An attach stream that breaks keeps its worker's blocks fenced until it re-attaches quiesced",
          "[integration][fences]") {
  DaemonProcess d(SmallPoolConfig(16));
  auto stub = v1::Kvd::NewStub(grpc::CreateChannel(d.target(), grpc::InsecureChannelCredentials()));
  auto lost = AttachByHand(*stub);
  const std::string lost_id = lost->attached.worker_id();
  const std::set<uint32_t> held = StartBlocks(*stub, StartOf(lost_id, "held", 8, 1));
  lost->Break();
  absl::SleepFor(absl::Milliseconds(500));

  auto other = AttachByHand(*stub);
  const std::set<uint32_t> got = StartBlocks(*stub, StartOf(other->attached.worker_id(), "other", 8, 1000));
  REQUIRE(std::none_of(got.begin(), got.end(), [&held](uint32_t b) { return held.contains(b); }));
  {
    grpc::ClientContext ctx;
    v1::ReleaseRequest rel;
    rel.set_worker_id(other->attached.worker_id());
    rel.set_request_id("other");
    rel.set_completed(true);
    v1::ReleaseResponse ignored;
    REQUIRE(stub->Release(&ctx, rel, &ignored).ok());
  }
  // Another attachment of the same process vouches for nothing of the lost one.
  auto fresh = AttachByHand(*stub, "", getpid(), "", /*quiesced=*/true);
  v1::StartRequest whole = StartOf(fresh->attached.worker_id(), "whole", 16, 2000);
  whole.set_max_wait_ms(300);
  {
    grpc::ClientContext ctx;
    v1::StartResponse resp;
    REQUIRE_FALSE(stub->Start(&ctx, whole, &resp).ok());
  }
  // The lost attachment's re-attach, quiesced, hands its blocks on at once.
  auto back = AttachByHand(*stub, "", getpid(), lost_id, /*quiesced=*/true);
  whole.mutable_admit()->set_worker_id(back->attached.worker_id());
  whole.set_max_wait_ms(5000);
  REQUIRE(StartBlocks(*stub, whole).size() == 16);
}

TEST_CASE("An asynchronous writer across a failed takeover: the resumed kvd fences what it cannot vouch for",
          "[integration][fences][handoff]") {
  DaemonProcess d(SmallPoolConfig(64, "lease_ttl_s: 3\n"));
  WorkerProcess a(SlowWriter(d.target()));
  REQUIRE(a.WaitForLine("WRITING", absl::Seconds(20)).ok());
  absl::SleepFor(absl::Milliseconds(300));
  // The successor dies serving: the old kvd resumes on its memory with an empty index.
  setenv("KVD_TEST_HANDOFF_FAULT", "before-done", 1);
  const bool took_over = d.TakeOver();
  unsetenv("KVD_TEST_HANDOFF_FAULT");
  REQUIRE_FALSE(took_over);
  AnotherTenantReadsBackExactly(d.target());
  REQUIRE(d.Log().find("fenced for the lease TTL") != std::string::npos);
}

TEST_CASE("A writer stopped past its lease writes nothing when it resumes", "[integration][fences]") {
  DaemonProcess d(SmallPoolConfig(64, "lease_ttl_s: 4\n"));
  WorkerProcess a(SlowWriter(d.target()));
  REQUIRE(a.WaitForLine("WRITING", absl::Seconds(20)).ok());
  absl::SleepFor(absl::Milliseconds(200));
  a.Signal(SIGSTOP);
  // Its lease lapses (4 s) and kvd releases its request: the blocks are free again, and another
  // tenant is given them.
  absl::SleepFor(absl::Seconds(6));
  ProcessResult b = RunWorker({"--target=" + d.target(), "--id=b", "--prompt-range=5000:64", "--salt=tenant-b"});
  INFO(b.out);
  REQUIRE(b.exit_code == 0);
  // The writer wakes with its writer thread mid-prompt: it must notice the lease is gone first.
  a.Signal(SIGCONT);
  absl::SleepFor(absl::Seconds(3));
  ProcessResult reader = RunWorker({"--target=" + d.target(), "--id=reader", "--prompt-range=5000:64",
                                    "--salt=tenant-b"});
  INFO(reader.out);
  REQUIRE(JsonInt(reader.out, "cached_tokens") == 60);
  REQUIRE(JsonInt(reader.out, "mismatches") == 0);
}

}  // namespace
}  // namespace kvd
