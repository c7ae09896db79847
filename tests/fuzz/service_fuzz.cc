// libFuzzer target: arbitrary bytes as request messages into the real gRPC service. One daemon
// runs in-process (host backend, a small pool, host and disk tiers) on a temporary Unix socket,
// with one attached worker. Each input is a sequence of calls: a byte picks the RPC, the next
// bytes are parsed as its request message (whatever protobuf makes of them), and with another
// byte the request's worker_id is set to the attached worker so that calls get past that check.
// After every input the daemon must still answer Ping and the cache's invariant check must pass.
#include <fuzzer/FuzzedDataProvider.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include <google/protobuf/stubs/logging.h>

#include "kvd/v1/kvd.grpc.pb.h"
#include "server/daemon.h"
#include "tests/util/small_pool.h"
#include "spdlog/spdlog.h"

namespace {

using namespace kvd;

struct World {
  std::unique_ptr<Daemon> daemon;
  std::unique_ptr<v1::Kvd::Stub> stub;
  grpc::ClientContext attach_ctx;
  std::unique_ptr<grpc::ClientReaderWriter<v1::AttachRequest, v1::AttachResponse>> attach;
  std::string worker_id;
};

World* Start() {
  spdlog::set_level(spdlog::level::off);
  google::protobuf::SetLogHandler(nullptr);  // invalid UTF-8 in string fields is expected here
  char tmpl[] = "/tmp/kvd-fuzz-svc-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) std::abort();
  const std::string dir = tmpl;
  Options o;
  o.server.listen = "unix://" + dir + "/kvd.sock";
  o.server.metrics_listen = "";
  o.server.max_message_bytes = 1 << 20;
  const PoolGeometry g = testing::SmallPool();
  o.cache.pools.push_back(g);
  o.tiers.host_bytes = 16 * g.block_bytes_all_shards();
  o.tiers.disk_dir = dir + "/disk";
  o.tiers.segment_bytes = 4096;
  auto* w = new World;
  auto d = Daemon::Start(o);
  if (!d.ok()) {
    std::fprintf(stderr, "daemon: %s\n", d.status().ToString().c_str());
    std::abort();
  }
  w->daemon = std::move(*d);
  w->stub = v1::Kvd::NewStub(grpc::CreateChannel(w->daemon->grpc_address(), grpc::InsecureChannelCredentials()));
  w->attach = w->stub->Attach(&w->attach_ctx);
  v1::AttachRequest hello;
  hello.mutable_hello()->set_pid(getpid());
  v1::AttachResponse resp;
  if (!w->attach->Write(hello) || !w->attach->Read(&resp)) std::abort();
  w->worker_id = resp.attached().worker_id();
  return w;
}

// Parses `bytes` into `msg`, optionally pointing its worker_id at the attached worker.
void Fill(google::protobuf::Message* msg, const std::string& bytes, bool own_worker, const std::string& worker) {
  msg->ParsePartialFromString(bytes);
  const auto* field = msg->GetDescriptor()->FindFieldByName("worker_id");
  if (field != nullptr && own_worker) msg->GetReflection()->SetString(msg, field, worker);
}

template <typename Req, typename Resp>
void Call(World& w, const std::string& bytes, bool own,
          grpc::Status (v1::Kvd::Stub::*method)(grpc::ClientContext*, const Req&, Resp*)) {
  Req req;
  Fill(&req, bytes, own, w.worker_id);
  Resp resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  (void)((*w.stub).*method)(&ctx, req, &resp);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static World* w = Start();
  FuzzedDataProvider in(data, size);
  using S = v1::Kvd::Stub;
  for (int calls = 0; calls < 16 && in.remaining_bytes() > 0; ++calls) {
    const int rpc = in.ConsumeIntegralInRange<int>(0, 18);
    const bool own = in.ConsumeBool();
    const std::string bytes = in.ConsumeRandomLengthString(512);
    switch (rpc) {
      case 0: Call(*w, bytes, own, &S::Admit); break;
      case 1: Call(*w, bytes, own, &S::Fits); break;
      case 2: Call(*w, bytes, own, &S::Acquire); break;
      case 3: Call(*w, bytes, own, &S::Extend); break;
      case 4: Call(*w, bytes, own, &S::Publish); break;
      case 5: Call(*w, bytes, own, &S::Keeps); break;
      case 6: Call(*w, bytes, own, &S::Release); break;
      case 7: Call(*w, bytes, own, &S::Checkpoint); break;
      case 8: Call(*w, bytes, own, &S::PeekPrefixLen); break;
      case 9: Call(*w, bytes, own, &S::CloseSession); break;
      case 10: Call(*w, bytes, own, &S::GetSession); break;
      case 11: Call(*w, bytes, own, &S::Gc); break;
      case 12: Call(*w, bytes, own, &S::GetHandle); break;
      case 13: Call(*w, bytes, own, &S::Prefetch); break;
      case 14: Call(*w, bytes, own, &S::ReleasePrefetch); break;
      case 15: Call(*w, bytes, own, &S::PutObject); break;
      case 16: Call(*w, bytes, own, &S::GetObject); break;
      case 17: Call(*w, bytes, own, &S::DeleteObject); break;
      case 18: Call(*w, bytes, own, &S::Boundary); break;
    }
  }
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  v1::PingResponse pong;
  if (!w->stub->Ping(&ctx, v1::PingRequest(), &pong).ok()) {
    std::fprintf(stderr, "the daemon stopped answering\n");
    std::abort();
  }
  if (absl::Status s = w->daemon->cache()->CheckInvariantsForTesting(); !s.ok()) {
    std::fprintf(stderr, "invariant broken: %s\n", s.ToString().c_str());
    std::abort();
  }
  return 0;
}
