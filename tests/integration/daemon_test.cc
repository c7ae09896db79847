// Integration tests: a real kvd process, real example-worker processes and an in-test client,
// all on a temporary Unix socket.
#include <signal.h>
#include <sys/stat.h>

#include <catch2/catch.hpp>

#include <grpcpp/grpcpp.h>

#include "client/client.h"
#include "gpu/fd_passing.h"
#include "kvd/v1/kvd.grpc.pb.h"
#include "tests/integration/harness.h"
#include "tests/integration/raw_attachment.h"

namespace kvd {
namespace {

using namespace kvd::testing;
using client::Client;

std::unique_ptr<Client> ConnectTo(const DaemonProcess& d, bool map = true) {
  auto c = Client::Connect({.target = d.target(), .worker_name = "test", .map_slabs = map});
  INFO(c.status().ToString());
  REQUIRE(c.ok());
  return std::move(*c);
}

std::vector<std::string> WorkerArgs(const DaemonProcess& d, std::vector<std::string> more) {
  std::vector<std::string> args = {"--target=" + d.target()};
  args.insert(args.end(), more.begin(), more.end());
  return args;
}

TEST_CASE("Two workers share a prefix through their own mappings", "[integration]") {
  DaemonProcess d(SmallPoolConfig());
  // Both sockets admit only the daemon's user and group.
  for (const std::string& path : {d.target().substr(7), d.side_socket()}) {
    struct stat st {};
    REQUIRE(stat(path.c_str(), &st) == 0);
    REQUIRE((st.st_mode & 0777) == 0660);
  }
  ProcessResult a = RunWorker(WorkerArgs(d, {"--id=a", "--prompt-range=0:22", "--gen=6"}));
  INFO(a.out);
  REQUIRE(a.exit_code == 0);
  REQUIRE(JsonInt(a.out, "cached_tokens") == 0);
  REQUIRE(JsonInt(a.out, "written_bytes") > 0);

  // B shares A's first 20 tokens (5 blocks) and then diverges.
  ProcessResult b = RunWorker(WorkerArgs(d, {"--id=b", "--prompt-range=0:20", "--prompt=900,901,902,903,904", "--gen=3"}));
  INFO(b.out);
  REQUIRE(b.exit_code == 0);
  REQUIRE(JsonInt(b.out, "cached_tokens") == 20);
  REQUIRE(JsonInt(b.out, "verified_bytes") == 20 * 2 * 16);
  REQUIRE(JsonInt(b.out, "mismatches") == 0);

  // C replays A's exact tokens: every byte A wrote is still A's (B's blocks did not disturb it).
  ProcessResult c = RunWorker(WorkerArgs(d, {"--id=c", "--prompt-range=0:22", "--gen=6"}));
  INFO(c.out);
  REQUIRE(c.exit_code == 0);
  REQUIRE(JsonInt(c.out, "cached_tokens") == 20);
  REQUIRE(JsonInt(c.out, "mismatches") == 0);
  REQUIRE(JsonInt(c.out, "tokens") == 28);
}

TEST_CASE("A killed worker's requests are released and its generation resumes elsewhere", "[integration]") {
  DaemonProcess d(SmallPoolConfig(64), {"--lease-ttl=4"});
  auto observer = ConnectTo(d, false);
  WorkerProcess victim(WorkerArgs(
      d, {"--id=gen", "--prompt-range=100:10", "--gen=20", "--checkpoint-every=5", "--hang-after-checkpoint"}));
  auto line = victim.WaitForLine("CHECKPOINTED", absl::Seconds(10));
  INFO(line.status().ToString());
  REQUIRE(line.ok());
  REQUIRE(observer->Report()->live_requests == 1);
  victim.Kill(SIGKILL);

  // Within a few seconds (its 4 s lease at the latest, with margin) the daemon has released the
  // dead worker's request.
  CacheReport r;
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  do {
    absl::SleepFor(absl::Milliseconds(20));
    r = *observer->Report();
  } while (r.live_requests != 0 && absl::Now() < deadline);
  REQUIRE(r.live_requests == 0);
  REQUIRE(r.orphaned_checkpoints == 1);
  REQUIRE(r.reserved_bytes == r.checkpoint_bytes);  // only the checkpoint still holds budget
  const PoolReport& pool = r.pools[0];
  // 15 tokens checkpointed = 2 published prompt blocks + 2 written but unpublished blocks, which
  // the checkpoint pins for the resume; nothing else of the dead worker's stays allocated.
  REQUIRE(pool.owned_blocks == 2);
  REQUIRE(pool.free_blocks + pool.cached_blocks + pool.owned_blocks == pool.capacity_blocks);
  // Its published prompt blocks are still reusable.
  REQUIRE(*observer->PeekPrefixLen(Namespace{.pool = "default"}, Range(100, 10)) == 8);
  // Kill() has reaped the process, so the whole checkpoint comes back, tail block included, even
  // when kvd fenced that block as the stream broke because it could not yet tell the process had
  // ended: the resume lifts the fences of writers that are gone (server/rpc/ended_writers.h).
  // Before, such a resume right away took 12 of the 15 tokens (seen once in CI). Another worker
  // resumes the interrupted generation from the checkpoint, verifying its KV.
  ProcessResult resumed = RunWorker(WorkerArgs(d, {"--id=gen2", "--resume-from=gen", "--prompt-range=100:10", "--gen=20"}));
  INFO(resumed.out);
  REQUIRE(resumed.exit_code == 0);
  REQUIRE(JsonBool(resumed.out, "resumed"));
  REQUIRE(JsonInt(resumed.out, "cached_tokens") == 15);
  REQUIRE(JsonInt(resumed.out, "verified_bytes") == 15 * 2 * 16);
  REQUIRE(JsonInt(resumed.out, "tokens") == 30);
  r = *observer->Report();
  REQUIRE(r.orphaned_checkpoints == 0);
  REQUIRE(r.pools[0].owned_blocks == 0);
  REQUIRE(r.reserved_bytes == 0);
}

TEST_CASE("Bad input gets a clear status, changes nothing, and the daemon keeps serving", "[integration]") {
  DaemonProcess d(SmallPoolConfig(), {"--max-message-bytes=65536"});
  auto c = ConnectTo(d);
  auto other = ConnectTo(d);
  RequestSpec ok = PoolRequest("ok", Range(0, 9), 4);
  auto req = c->Start(ok);
  REQUIRE(req.ok());
  const CacheReport before = *c->Report();
  using C = absl::StatusCode;

  RequestSpec bad = ok;
  bad.id = RequestId("x");
  bad.ns.pool = "nope";
  REQUIRE(c->Admit(bad).status().code() == C::kNotFound);
  bad = ok;
  bad.id = RequestId("x");
  bad.prompt.clear();
  REQUIRE(c->Admit(bad).status().code() == C::kInvalidArgument);
  bad.prompt = Range(0, 199);
  bad.max_new_tokens = 10;
  REQUIRE(c->Admit(bad).status().code() == C::kOutOfRange);  // past max_model_len
  REQUIRE(c->Acquire(RequestId("ghost")).status().code() == C::kNotFound);
  REQUIRE(c->CloseSession(SessionId("ghost")).code() == C::kNotFound);
  REQUIRE(c->GetHandle(RequestId("ghost")).status().code() == C::kNotFound);
  REQUIRE(c->Extend(ok.id, 500).status().code() == C::kOutOfRange);  // past the position limit
  // Blocks the request does not own.
  std::vector<BlockIndex> wrong = {(*req)->blocks()[1], (*req)->blocks()[0]};
  REQUIRE(c->Publish(ok.id, ok.prompt, wrong).status().code() == C::kInvalidArgument);
  // Another worker may not touch this worker's request.
  REQUIRE(other->Release(ok.id, true).code() == C::kPermissionDenied);
  // A message over the size limit is refused by gRPC itself.
  RequestSpec huge = ok;
  huge.id = RequestId("huge");
  huge.prompt = Range(0, 40000);
  REQUIRE(c->Admit(huge).status().code() == C::kResourceExhausted);

  const CacheReport after = *c->Report();
  REQUIRE(after.reserved_bytes == before.reserved_bytes);
  REQUIRE(after.pools[0].free_blocks == before.pools[0].free_blocks);
  REQUIRE(after.live_requests == 1);

  // A double release.
  REQUIRE((*req)->Release(true).ok());
  REQUIRE(c->Release(ok.id, true).code() == C::kNotFound);

  // Side socket: a wrong token is refused.
  {
    auto sock = ConnectUnix(d.side_socket());
    REQUIRE(sock.ok());
    REQUIRE(SendMessage(sock->get(), "not-a-token", {}).ok());
    auto reply = ReceiveMessage(sock->get(), 4096, 4);
    REQUIRE(reply.ok());
    REQUIRE(reply->payload.rfind("ERR ", 0) == 0);
    REQUIRE(reply->fds.empty());
  }
  // A reused token is refused: attach by hand, redeem once, then again.
  {
    auto channel = grpc::CreateChannel(d.target(), grpc::InsecureChannelCredentials());
    auto stub = v1::Kvd::NewStub(channel);
    auto attachment = AttachByHand(*stub);
    const std::string token = attachment->attached.slab_token();
    for (int attempt = 0; attempt < 2; ++attempt) {
      auto sock = ConnectUnix(d.side_socket());
      REQUIRE(sock.ok());
      REQUIRE(SendMessage(sock->get(), token, {}).ok());
      auto reply = ReceiveMessage(sock->get(), 4096, 4);
      REQUIRE(reply.ok());
      REQUIRE(reply->payload.rfind(attempt == 0 ? "OK " : "ERR ", 0) == 0);
    }
    // The first message of an Attach stream must be hello.
    grpc::ClientContext ctx2;
    auto bad_stream = stub->Attach(&ctx2);
    v1::AttachRequest beat;
    beat.mutable_heartbeat();
    bad_stream->Write(beat);
    bad_stream->WritesDone();
    v1::AttachResponse ignored;
    while (bad_stream->Read(&ignored)) {}
    REQUIRE(bad_stream->Finish().error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  }
  // Requests from a worker id that never attached are refused.
  {
    auto channel = grpc::CreateChannel(d.target(), grpc::InsecureChannelCredentials());
    auto stub = v1::Kvd::NewStub(channel);
    grpc::ClientContext ctx;
    v1::AdmitRequest admit;
    admit.set_worker_id("w999-1");
    admit.set_request_id("r");
    admit.mutable_namespace_()->set_pool("default");
    admit.add_prompt(1);
    v1::AdmitResponse resp;
    REQUIRE(stub->Admit(&ctx, admit, &resp).error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  }
  REQUIRE(c->Ping().ok());
  ProcessResult w = RunWorker(WorkerArgs(d, {"--id=after", "--prompt-range=0:9"}));
  REQUIRE(w.exit_code == 0);
}

TEST_CASE("SIGTERM stops admissions, lets running requests finish, and exits 0", "[integration]") {
  DaemonProcess d(SmallPoolConfig(), {"--drain-timeout=10"});
  auto c = ConnectTo(d);
  RequestSpec s = PoolRequest("running", Range(0, 9), 8);
  auto req = c->Start(s);
  REQUIRE(req.ok());
  d.Signal(SIGTERM);
  RequestSpec late = s;
  late.id = RequestId("late");
  absl::StatusCode code = absl::StatusCode::kOk;
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (absl::Now() < deadline) {
    code = c->Admit(late).status().code();
    if (code == absl::StatusCode::kUnavailable) break;
    if (code == absl::StatusCode::kOk) REQUIRE(c->Release(late.id, true).ok());
    absl::SleepFor(absl::Milliseconds(10));
  }
  REQUIRE(code == absl::StatusCode::kUnavailable);
  // The running request carries on to the end.
  REQUIRE((*req)->Extend(4).ok());
  auto tokens = Range(0, 13);
  REQUIRE((*req)->Publish(tokens).ok());
  REQUIRE((*req)->Release(true).ok());
  auto exit_code = d.WaitExit(absl::Seconds(10));
  REQUIRE(exit_code.ok());
  REQUIRE(*exit_code == 0);
}

TEST_CASE("Watchers get index events in order and can catch up or resync", "[integration]") {
  DaemonProcess d(SmallPoolConfig(64, "event_buffer: 4\n"));
  auto c = ConnectTo(d);
  auto watcher = c->WatchEvents(0);
  REQUIRE(watcher.ok());
  REQUIRE(RunWorker(WorkerArgs(d, {"--id=a", "--prompt-range=0:9"})).exit_code == 0);  // 2 stored
  auto batch = (*watcher)->Next();
  REQUIRE(batch.ok());
  std::vector<CacheEvent> seen = batch->events;
  while (seen.size() < 2) {
    auto more = (*watcher)->Next();
    REQUIRE(more.ok());
    seen.insert(seen.end(), more->events.begin(), more->events.end());
  }
  REQUIRE(seen[0].kind == CacheEventKind::kStored);
  REQUIRE(seen[0].sequence == 1);
  REQUIRE(seen[1].sequence == 2);
  REQUIRE(seen[1].has_parent);
  REQUIRE(seen[1].parent_key == seen[0].key);
  REQUIRE(seen[1].tokens == Range(4, 4));

  // A watcher reconnecting after sequence 1 gets what it missed.
  auto again = c->WatchEvents(1);
  auto missed = (*again)->Next();
  REQUIRE(missed.ok());
  REQUIRE_FALSE(missed->resync);
  REQUIRE(missed->events.front().sequence == 2);
  // Sequence 2 is inside the run the publish recorded: it comes back whole, parent included.
  REQUIRE(missed->events.front().has_parent);
  REQUIRE(missed->events.front().parent_key == seen[0].key);
  REQUIRE(missed->events.front().key == seen[1].key);
  REQUIRE(missed->events.front().tokens == Range(4, 4));

  // Past the 4-event buffer, an old position must resync.
  REQUIRE(RunWorker(WorkerArgs(d, {"--id=b", "--prompt-range=50:17"})).exit_code == 0);  // 4 more
  auto stale = c->WatchEvents(1);
  auto first = (*stale)->Next();
  REQUIRE(first.ok());
  REQUIRE(first->resync);
}

TEST_CASE("Pressure watchers get the current level, then every change", "[integration]") {
  DaemonProcess d(SmallPoolConfig(20));
  auto c = ConnectTo(d);
  auto channel = grpc::CreateChannel(d.target(), grpc::InsecureChannelCredentials());
  auto stub = v1::Kvd::NewStub(channel);
  grpc::ClientContext ctx;
  auto reader = stub->WatchPressure(&ctx, v1::WatchPressureRequest());
  v1::PressureUpdate update;
  REQUIRE(reader->Read(&update));
  REQUIRE(update.level() == "normal");
  RequestSpec s = PoolRequest("big", Range(0, 80));  // all 20 blocks of the budget
  REQUIRE(c->Admit(s)->decision == AdmitDecision::kAdmitted);
  REQUIRE(reader->Read(&update));
  REQUIRE(update.level() == "critical");
  REQUIRE(update.available_fraction() == 0.0);
  REQUIRE(c->Release(s.id, true).ok());
  REQUIRE(reader->Read(&update));
  REQUIRE(update.level() == "normal");
  ctx.TryCancel();
}

TEST_CASE("Metrics expose RPC latency, blocks by state and attached workers", "[integration]") {
  DaemonProcess d(SmallPoolConfig());
  auto c = ConnectTo(d);
  REQUIRE(RunWorker(WorkerArgs(d, {"--id=a", "--prompt-range=0:9"})).exit_code == 0);
  REQUIRE(d.metrics_port() > 0);
  auto body = HttpGet(d.metrics_port(), "/metrics");
  REQUIRE(body.ok());
  INFO(*body);
  REQUIRE(body->find("kvd_rpc_latency_seconds_count{code=\"OK\",method=\"Start\"} 1") != std::string::npos);
  REQUIRE(body->find("kvd_blocks{pool=\"default\",state=\"cached_evictable\"} 2") != std::string::npos);
  REQUIRE(body->find("kvd_attached_workers 1") != std::string::npos);
  REQUIRE(body->find("kvd_miss_tokens_total 9") != std::string::npos);
}

TEST_CASE("Readers receive the interprocess event handles of the blocks' publishers", "[integration]") {
  DaemonProcess d(SmallPoolConfig());
  auto stub = v1::Kvd::NewStub(grpc::CreateChannel(d.target(), grpc::InsecureChannelCredentials()));
  const std::string handle(64, 'E');  // opaque to the daemon; a cudaIpcEventHandle_t on GPUs
  auto attachment = AttachByHand(*stub, handle);
  const std::string writer = attachment->attached.worker_id();
  auto call = [&](auto method, const auto& req, auto* resp) {
    grpc::ClientContext ctx;
    return ((*stub).*method)(&ctx, req, resp);
  };
  v1::AdmitRequest admit;
  admit.set_worker_id(writer);
  admit.set_request_id("w");
  admit.mutable_namespace_()->set_pool("default");
  for (uint32_t t = 0; t < 9; ++t) admit.add_prompt(t);
  v1::AdmitResponse admitted;
  REQUIRE(call(&v1::Kvd::Stub::Admit, admit, &admitted).ok());
  v1::AcquireRequest acquire;
  acquire.set_worker_id(writer);
  acquire.set_request_id("w");
  v1::AcquireResponse acquired;
  REQUIRE(call(&v1::Kvd::Stub::Acquire, acquire, &acquired).ok());
  v1::PublishRequest publish;
  publish.set_worker_id(writer);
  publish.set_request_id("w");
  *publish.mutable_tokens() = admit.prompt();
  publish.add_blocks(acquired.blocks(0));
  publish.add_blocks(acquired.blocks(1));
  v1::PublishResponse published;
  REQUIRE(call(&v1::Kvd::Stub::Publish, publish, &published).ok());
  REQUIRE(published.kept() == 2);

  auto reader = ConnectTo(d);
  RequestSpec s = PoolRequest("r", Range(0, 9));
  auto req = reader->Start(s);
  REQUIRE(req.ok());
  REQUIRE((*req)->cached_tokens() == 8);
  REQUIRE((*req)->publisher_events() == std::vector<std::string>{handle});
#if !KVD_TEST_HAVE_CUDA
  REQUIRE(reader->WaitForPublishers(**req, nullptr).code() == absl::StatusCode::kFailedPrecondition);
#endif
  // An oversized handle is refused at Attach.
  grpc::ClientContext bad_ctx;
  auto bad = stub->Attach(&bad_ctx);
  v1::AttachRequest hello;
  hello.mutable_hello()->set_pid(getpid());
  hello.mutable_hello()->set_cuda_event_handle(std::string(65, 'x'));
  bad->Write(hello);
  bad->WritesDone();
  v1::AttachResponse ignored;
  while (bad->Read(&ignored)) {}
  REQUIRE(bad->Finish().error_code() == grpc::StatusCode::INVALID_ARGUMENT);
}

TEST_CASE("A worker expecting another model fingerprint is refused at Attach, naming both", "[integration]") {
  DaemonProcess d(SmallPoolConfig(64, "    model_fingerprint: llama-3.1-8b@v2\n"));
  auto stub = v1::Kvd::NewStub(grpc::CreateChannel(d.target(), grpc::InsecureChannelCredentials()));
  const auto attach = [&](const std::string& expected) {
    grpc::ClientContext ctx;
    auto stream = stub->Attach(&ctx);
    v1::AttachRequest hello;
    hello.mutable_hello()->set_pid(getpid());
    v1::PoolExpectation* e = hello.mutable_hello()->add_expect_pools();
    e->set_pool("default");
    e->set_model_fingerprint(expected);
    stream->Write(hello);
    v1::AttachResponse resp;
    if (stream->Read(&resp) && resp.has_attached()) {
      ctx.TryCancel();
      return grpc::Status::OK;
    }
    return stream->Finish();
  };
  REQUIRE(attach("llama-3.1-8b@v2").ok());
  REQUIRE(attach("").ok());  // a worker that names no model is not asked for one
  const grpc::Status refused = attach("llama-3.1-8b@v1");
  REQUIRE(refused.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  REQUIRE(refused.error_message() ==
          "pool 'default' holds KV of model_fingerprint 'llama-3.1-8b@v2', the worker expects 'llama-3.1-8b@v1'");
  REQUIRE(attach("bad fingerprint").error_code() == grpc::StatusCode::INVALID_ARGUMENT);

  // A pool that declares none cannot promise a worker its model.
  DaemonProcess plain(SmallPoolConfig());
  stub = v1::Kvd::NewStub(grpc::CreateChannel(plain.target(), grpc::InsecureChannelCredentials()));
  const grpc::Status undeclared = attach("llama-3.1-8b@v1");
  REQUIRE(undeclared.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  REQUIRE(undeclared.error_message().find("(none declared)") != std::string::npos);
}

TEST_CASE("A worker whose lease lapses is treated as dead", "[integration]") {
  DaemonProcess d(SmallPoolConfig(), {"--lease-ttl=1"});
  auto observer = ConnectTo(d, false);  // only reads: needs no live lease
  auto channel = grpc::CreateChannel(d.target(), grpc::InsecureChannelCredentials());
  auto stub = v1::Kvd::NewStub(channel);
  auto attachment = AttachByHand(*stub);
  grpc::ClientContext admit_ctx;
  v1::AdmitRequest admit;
  admit.set_worker_id(attachment->attached.worker_id());
  admit.set_request_id("silent");
  admit.mutable_namespace_()->set_pool("default");
  admit.add_prompt(1);
  v1::AdmitResponse resp;
  REQUIRE(stub->Admit(&admit_ctx, admit, &resp).ok());
  REQUIRE(resp.admitted());
  // No heartbeats: within a few lease periods the request is released.
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (absl::Now() < deadline && observer->GetHandle(RequestId("silent")).ok()) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  REQUIRE(observer->GetHandle(RequestId("silent")).status().code() == absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace kvd
