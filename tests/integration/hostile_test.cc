// The real daemon driven the way a careless or hostile client would: stalled and dripping peers
// on the side socket, idle and excess connections, wire values near INT64_MAX, worker ids used by
// another process, forged pids, control characters and megabyte names, salts read back. Each case
// checks that the daemon answers with a clear status, keeps serving, and changes nothing.
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <limits>
#include <thread>

#include <catch2/catch.hpp>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gpu/fd_passing.h"
#include "kvd/v1/kvd.grpc.pb.h"
#include "tests/integration/harness.h"
#include "tests/integration/raw_attachment.h"

namespace kvd {
namespace {

using namespace kvd::testing;

std::unique_ptr<v1::Kvd::Stub> NewStub(const DaemonProcess& d) {
  return v1::Kvd::NewStub(grpc::CreateChannel(d.target(), grpc::InsecureChannelCredentials()));
}

// Waits (at most `limit`) for the peer to close `fd`: true on EOF or reset, false on a timeout.
bool ClosedByPeer(int fd, absl::Duration limit) {
  const timeval tv{static_cast<time_t>(absl::ToInt64Seconds(limit)), 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  char buf[256];
  for (;;) {
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n == 0) return true;
    if (n < 0) return errno == ECONNRESET || errno == EPIPE;
  }
}

// An Admit of tokens [start, start + n) in the default pool.
v1::AdmitRequest AdmitOf(const std::string& worker, const std::string& id, Token start, int n,
                         int64_t max_new = 0) {
  v1::AdmitRequest req;
  req.set_worker_id(worker);
  req.set_request_id(id);
  req.mutable_namespace_()->set_pool("default");
  for (int t = 0; t < n; ++t) req.add_prompt(start + t);
  req.set_max_new_tokens(max_new);
  return req;
}

grpc::Status Admit(v1::Kvd::Stub& stub, const v1::AdmitRequest& req, v1::AdmitResponse* resp = nullptr) {
  grpc::ClientContext ctx;
  v1::AdmitResponse ignored;
  return stub.Admit(&ctx, req, resp != nullptr ? resp : &ignored);
}

// Admits and acquires `req`; REQUIREs both.
void Start(v1::Kvd::Stub& stub, const v1::AdmitRequest& req) {
  v1::AdmitResponse admitted;
  REQUIRE(Admit(stub, req, &admitted).ok());
  REQUIRE(admitted.admitted());
  grpc::ClientContext ctx;
  v1::AcquireRequest acq;
  acq.set_worker_id(req.worker_id());
  acq.set_request_id(req.request_id());
  v1::AcquireResponse resp;
  REQUIRE(stub.Acquire(&ctx, acq, &resp).ok());
}

grpc::Status Ping(v1::Kvd::Stub& stub) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
  v1::PingResponse resp;
  return stub.Ping(&ctx, v1::PingRequest(), &resp);
}

TEST_CASE("The side socket serves workers while other peers stall or drip bytes", "[integration][hostile]") {
  DaemonProcess d(SmallPoolConfig());
  std::vector<UniqueFd> silent;
  for (int i = 0; i < 5; ++i) {
    auto fd = ConnectUnix(d.side_socket());
    REQUIRE(fd.ok());
    silent.push_back(std::move(*fd));
  }
  auto drip = ConnectUnix(d.side_socket());
  REQUIRE(drip.ok());
  std::atomic<bool> stop{false};
  std::thread dripper([&] {  // a byte every 200 ms: never idle long enough for a per-read timeout
    while (!stop.load()) {
      const char b = 0;
      if (send(drip->get(), &b, 1, MSG_NOSIGNAL) != 1) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
  });
  ProcessResult worker = RunWorker({"--target=" + d.target(), "--id=w", "--prompt-range=0:9"});
  INFO(worker.out);
  REQUIRE(worker.exit_code == 0);
  REQUIRE(JsonInt(worker.out, "mismatches") == 0);
  // Each stalled connection is closed by the daemon at its deadline, the dripping one too.
  for (UniqueFd& fd : silent) REQUIRE(ClosedByPeer(fd.get(), absl::Seconds(30)));
  REQUIRE(ClosedByPeer(drip->get(), absl::Seconds(30)));
  stop = true;
  dripper.join();
}

TEST_CASE("Idle gRPC connections are closed; descriptors run out and come back", "[integration][hostile]") {
  // Few descriptors for the daemon: set the soft limit for the child only, around its start.
  rlimit old{};
  REQUIRE(getrlimit(RLIMIT_NOFILE, &old) == 0);
  rlimit low = old;
  low.rlim_cur = 256;
  REQUIRE(setrlimit(RLIMIT_NOFILE, &low) == 0);
  std::unique_ptr<DaemonProcess> d;
  try {
    d = std::make_unique<DaemonProcess>(SmallPoolConfig(64, "max_connection_idle_s: 2\n"));
  } catch (...) {
    setrlimit(RLIMIT_NOFILE, &old);
    throw;
  }
  REQUIRE(setrlimit(RLIMIT_NOFILE, &old) == 0);
  const std::string sock = d->target().substr(7);
  // A connection that never sends a byte is closed once idle.
  {
    auto idle = ConnectUnix(sock);
    REQUIRE(idle.ok());
    REQUIRE(ClosedByPeer(idle->get(), absl::Seconds(30)));
  }
  // More connections than the daemon has descriptors: it sheds what it cannot hold, never spins
  // or stops, and serves again once they are gone.
  {
    std::vector<UniqueFd> flood;
    for (int i = 0; i < 400; ++i) {
      auto fd = ConnectUnix(sock);
      if (fd.ok()) flood.push_back(std::move(*fd));
    }
    REQUIRE(flood.size() > 256);
    // Held until the daemon has met them (its backlog queues them all: SOMAXCONN).
    for (int i = 0; i < 300 && d->Log().find("out of file descriptors") == std::string::npos; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }
  auto stub = NewStub(*d);
  bool served = false;
  for (int i = 0; i < 60 && !served; ++i) {
    served = Ping(*stub).ok();
    if (!served) std::this_thread::sleep_for(std::chrono::milliseconds(500));
  }
  INFO(d->Log());
  REQUIRE(served);
  REQUIRE(d->Log().find("out of file descriptors") != std::string::npos);
  ProcessResult worker = RunWorker({"--target=" + d->target(), "--id=after", "--prompt-range=0:9"});
  INFO(worker.out);
  REQUIRE(worker.exit_code == 0);
}

TEST_CASE("Wire values near INT64_MAX are OUT_OF_RANGE and change nothing", "[integration][hostile]") {
  DaemonProcess d(SmallPoolConfig());
  auto stub = NewStub(d);
  auto me = AttachByHand(*stub);
  const std::string worker = me->attached.worker_id();
  v1::AdmitRequest admit = AdmitOf(worker, "r", 0, 9, std::numeric_limits<int64_t>::max());
  const grpc::Status huge = Admit(*stub, admit);
  REQUIRE(huge.error_code() == grpc::StatusCode::OUT_OF_RANGE);
  REQUIRE(huge.error_message().find("max_new_tokens") != std::string::npos);
  admit.set_max_new_tokens(4);
  Start(*stub, admit);
  for (int64_t more : {std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::max() - 8}) {
    grpc::ClientContext ctx;
    v1::ExtendRequest ext;
    ext.set_worker_id(worker);
    ext.set_request_id("r");
    ext.set_additional_tokens(more);
    v1::ExtendResponse resp;
    REQUIRE(stub->Extend(&ctx, ext, &resp).error_code() == grpc::StatusCode::OUT_OF_RANGE);
  }
  grpc::ClientContext ctx;
  v1::GetHandleRequest get;
  get.set_request_id("r");
  v1::Handle h;
  REQUIRE(stub->GetHandle(&ctx, get, &h).ok());
  REQUIRE(h.num_tokens() == 9);
  // The request's own checkpoint still works.
  grpc::ClientContext cctx;
  v1::CheckpointRequest ck;
  ck.set_worker_id(worker);
  ck.set_request_id("r");
  for (int t = 0; t < 9; ++t) ck.add_tokens(t);
  v1::CheckpointResponse cresp;
  REQUIRE(stub->Checkpoint(&cctx, ck, &cresp).ok());
}

TEST_CASE("A worker id acts only for the process that attached it", "[integration][hostile]") {
  DaemonProcess d(SmallPoolConfig(64, "max_requests_per_worker: 1\n"));
  WorkerProcess victim({"--target", d.target(), "--id", "victim", "--prompt-range", "0:9", "--gen", "8",
                        "--checkpoint-every", "2", "--hang-after-checkpoint"});
  REQUIRE(victim.WaitForLine("CHECKPOINTED", absl::Seconds(20)).ok());
  auto stub = NewStub(d);
  std::string victim_worker;
  {
    grpc::ClientContext ctx;
    v1::ListHandlesResponse handles;
    REQUIRE(stub->ListHandles(&ctx, v1::ListHandlesRequest(), &handles).ok());
    REQUIRE(handles.handles_size() == 1);
    victim_worker = handles.handles(0).worker_id();
  }
  // Another process presents the victim's id: refused, and the victim's request is untouched.
  {
    grpc::ClientContext ctx;
    v1::ExtendRequest ext;
    ext.set_worker_id(victim_worker);
    ext.set_request_id("victim");
    ext.set_additional_tokens(1);
    v1::ExtendResponse resp;
    const grpc::Status s = stub->Extend(&ctx, ext, &resp);
    REQUIRE(s.error_code() == grpc::StatusCode::PERMISSION_DENIED);
    REQUIRE(s.error_message().find("attached by another process") != std::string::npos);
  }
  {
    grpc::ClientContext ctx;
    v1::ReleaseRequest rel;
    rel.set_worker_id(victim_worker);
    rel.set_request_id("victim");
    v1::ReleaseResponse resp;
    REQUIRE(stub->Release(&ctx, rel, &resp).error_code() == grpc::StatusCode::PERMISSION_DENIED);
  }
  {
    grpc::ClientContext ctx;
    v1::GetHandleRequest get;
    get.set_request_id("victim");
    v1::Handle h;
    REQUIRE(stub->GetHandle(&ctx, get, &h).ok());
    REQUIRE(h.worker_id() == victim_worker);
  }
  // Attaching twice does not double the per-worker limits: they count per process.
  auto first = AttachByHand(*stub);
  auto second = AttachByHand(*stub);
  REQUIRE(Admit(*stub, AdmitOf(first->attached.worker_id(), "one", 100, 5)).ok());
  const grpc::Status again = Admit(*stub, AdmitOf(second->attached.worker_id(), "two", 200, 5));
  REQUIRE(again.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
  REQUIRE(again.error_message().find("max_requests_per_worker") != std::string::npos);
  // A hello claiming another pid is bound to the caller's real pid: its token works from here.
  auto forged = AttachByHand(*stub, "", /*pid=*/1);
  auto side = ConnectUnix(d.side_socket());
  REQUIRE(side.ok());
  REQUIRE(SendMessage(side->get(), forged->attached.slab_token(), {}).ok());
  auto reply = ReceiveMessage(side->get(), 4096, 64);
  REQUIRE(reply.ok());
  REQUIRE(reply->payload.rfind("OK ", 0) == 0);
  victim.Kill(SIGKILL);
}

TEST_CASE("Checkpoint state cannot grow the daemon past its bounds", "[integration][hostile]") {
  // 2 MiB per process (a quarter of 8 MiB); each request checkpoints 64 KiB of engine state.
  DaemonProcess d(SmallPoolConfig(512, "checkpoint_state_bytes: 8388608\n"));
  auto stub = NewStub(d);
  auto me = AttachByHand(*stub);
  const std::string worker = me->attached.worker_id();
  const std::string state(64 << 10, 's');
  int kept = 0, refused = 0;
  for (int i = 0; i < 100; ++i) {
    const std::string id = absl::StrCat("c", i);
    Start(*stub, AdmitOf(worker, id, i * 10, 4));
    grpc::ClientContext ctx;
    v1::CheckpointRequest ck;
    ck.set_worker_id(worker);
    ck.set_request_id(id);
    for (int t = 0; t < 4; ++t) ck.add_tokens(i * 10 + t);
    ck.set_engine_state(state);
    v1::CheckpointResponse resp;
    const grpc::Status s = stub->Checkpoint(&ctx, ck, &resp);
    if (s.ok()) {
      ++kept;
    } else {
      REQUIRE(s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
      REQUIRE(s.error_message().find("max_checkpoint_state_bytes_per_worker") != std::string::npos);
      ++refused;
    }
  }
  REQUIRE(kept == 31);  // 31 x (64 KiB + 16 B) fits 2 MiB; the 32nd would not
  REQUIRE(refused == 69);
  REQUIRE(Metric(d, "kvd_checkpoint_state_bytes") == 31 * ((64 << 10) + 16));
  REQUIRE(Metric(d, "process_resident_memory_bytes") > 0);
  REQUIRE(Metric(d, "process_open_fds") > 0);
  // When this kvd started, to the second (the KvdRestarting alert counts its changes).
  const double started = Metric(d, "process_start_time_seconds");
  REQUIRE(started <= absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch()) + 1);
  REQUIRE(started > absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch()) - 600);
}

TEST_CASE("Worker names are bounded and printable", "[integration][hostile]") {
  DaemonProcess d(SmallPoolConfig());
  auto stub = NewStub(d);
  for (const std::string& name : {std::string("evil\n[error] forged line"), std::string(8 << 20, 'n')}) {
    grpc::ClientContext ctx;
    auto stream = stub->Attach(&ctx);
    v1::AttachRequest hello;
    hello.mutable_hello()->set_pid(getpid());
    hello.mutable_hello()->set_worker_name(name);
    REQUIRE(stream->Write(hello));
    v1::AttachResponse resp;
    REQUIRE_FALSE(stream->Read(&resp));
    const grpc::Status s = stream->Finish();
    REQUIRE(s.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    REQUIRE(s.error_message().find("worker_name") != std::string::npos);
  }
  REQUIRE(Ping(*stub).ok());
}

TEST_CASE("Saved prefixes never give a tenant's salt back", "[integration][hostile]") {
  TempDir disk;
  DaemonProcess d(SmallPoolConfig(64, absl::StrCat("tiers:\n  disk_dir: ", disk.path(), "\n")));
  ProcessResult a = RunWorker({"--target=" + d.target(), "--id=a", "--prompt-range=0:17", "--salt=tenant-a-secret"});
  INFO(a.out);
  REQUIRE(a.exit_code == 0);
  auto stub = NewStub(d);
  {
    grpc::ClientContext ctx;
    v1::FlushResponse f;
    REQUIRE(stub->Flush(&ctx, v1::FlushRequest(), &f).ok());
    REQUIRE(f.durable());
  }
  grpc::ClientContext ctx;
  auto reader = stub->SavedPrefixes(&ctx, v1::SavedPrefixesRequest());
  v1::SavedPrefixBatch batch;
  int prefixes = 0;
  while (reader->Read(&batch)) {
    for (const v1::SavedPrefix& p : batch.prefixes()) {
      ++prefixes;
      REQUIRE(p.namespace_().cache_salt().rfind("fp:", 0) == 0);
      REQUIRE(p.namespace_().cache_salt().find("tenant-a") == std::string::npos);
    }
  }
  REQUIRE(reader->Finish().ok());
  REQUIRE(prefixes == 1);
}

}  // namespace
}  // namespace kvd
