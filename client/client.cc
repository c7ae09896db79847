#include "client/client.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <thread>
#include <utility>

#include <grpcpp/grpcpp.h>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/notification.h"
#include "gpu/fd_passing.h"
#include "gpu/host_arena.h"
#if KVD_HAVE_CUDA
#include "gpu/cuda_block_copier.h"
#include "gpu/cuda_device.h"
#include "gpu/cuda_ipc_event.h"
#include "gpu/cuda_slab_import.h"
#endif
#include "kvd/v1/kvd.grpc.pb.h"
#include "proto/convert.h"
#include "proto/grpc_status.h"
#include "proto/vocab/status_macros.h"

namespace kvd::client {

struct Client::Impl {
  ClientOptions options;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Kvd::Stub> stub;
  WorkerId worker;
  std::string backend;
  std::vector<PoolView> pools;
  std::vector<MappedSlab> mappings;
#if KVD_HAVE_CUDA
  std::vector<ImportedCudaSlab> cuda_slabs;  // opened once, kept for the client's life
  std::optional<InterprocessEvent> own_event;
  absl::Mutex events_mu;
  absl::flat_hash_map<std::string, std::unique_ptr<InterprocessEvent>> peer_events
      ABSL_GUARDED_BY(events_mu);  // opened once per handle
#endif

  // Host-synchronized publish (docs/api.md): what must have finished before a Publish, Keeps, End
  // or Checkpoint is sent. Taken (and cleared) by AwaitWrites.
  absl::Mutex fences_mu;
  std::vector<std::function<absl::Status()>> fences ABSL_GUARDED_BY(fences_mu);
  bool event_recorded ABSL_GUARDED_BY(fences_mu) = false;

  // Runs every pending fence and, when the worker recorded its interprocess event since the last
  // publish, synchronizes it: the bytes a publish names are in memory before kvd hears of it.
  absl::Status AwaitWrites() {
    std::vector<std::function<absl::Status()>> pending;
    bool sync_event = false;
    {
      absl::MutexLock lock(&fences_mu);
      pending.swap(fences);
      sync_event = std::exchange(event_recorded, false);
    }
    absl::Status status;
    for (auto& wait : pending) status.Update(wait());
#if KVD_HAVE_CUDA
    if (sync_event && own_event.has_value()) status.Update(own_event->Synchronize());
#endif
    if (!status.ok()) {
      return absl::Status(status.code(), absl::StrCat("the engine's writes did not complete, so "
                                                      "nothing was published: ", status.message()));
    }
    return absl::OkStatus();
  }

  grpc::ClientContext attach_ctx;
  std::unique_ptr<grpc::ClientReaderWriter<v1::AttachRequest, v1::AttachResponse>> attach;
  absl::Notification stop;
  std::thread heartbeat;

  template <typename Resp, typename Fn>
  absl::StatusOr<Resp> Call(Fn&& fn, absl::Duration timeout = absl::Seconds(30)) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
    Resp resp;
    grpc::Status s = fn(&ctx, &resp);
    if (!s.ok()) return FromGrpcStatus(s);
    return resp;
  }

  absl::Status AttachAndMap(const v1::Attached& attached);
  absl::Status OpenCudaSlabs(const v1::ListPoolsResponse& listed);
  void Heartbeat() {
    const absl::Duration period = options.heartbeat_period;
    while (!stop.WaitForNotificationWithTimeout(period)) {
      v1::AttachRequest beat;
      beat.mutable_heartbeat();
      if (!attach->Write(beat)) return;  // the daemon ended the attachment
    }
  }
};

absl::Status Client::Impl::AttachAndMap(const v1::Attached& attached) {
  auto listed = Call<v1::ListPoolsResponse>([&](grpc::ClientContext* ctx, v1::ListPoolsResponse* r) {
    return stub->ListPools(ctx, v1::ListPoolsRequest(), r);
  });
  if (!listed.ok()) return listed.status();
  for (const v1::PoolInfo& p : listed->pools()) {
    PoolView view;
    view.id = p.pool_id();
    view.geometry = GeometryFromProto(p);
    view.layout = SlabLayout(view.geometry);
    view.shard_base.assign(p.slabs_size(), nullptr);
    for (const v1::SlabInfo& s : p.slabs()) {
      view.slab_bytes.push_back(s.size_bytes());
      view.shard_device.push_back(s.device());
    }
    pools.push_back(std::move(view));
  }
  if (!options.map_slabs) return absl::OkStatus();
  if (backend == "cuda") return OpenCudaSlabs(*listed);
  if (backend != "host") {
    return absl::FailedPreconditionError(
        absl::StrCat("kvd serves backend '", backend, "', unknown to this client"));
  }

  KVD_ASSIGN_OR_RETURN(UniqueFd sock, ConnectUnix(attached.side_socket()));
  KVD_RETURN_IF_ERROR(SendMessage(sock.get(), attached.slab_token(), {}));
  KVD_ASSIGN_OR_RETURN(ReceivedMessage hello, ReceiveMessage(sock.get(), 4096, 0));
  if (absl::StartsWith(hello.payload, "ERR ")) {
    return absl::PermissionDeniedError(absl::StrCat("side socket refused: ", hello.payload.substr(4)));
  }
  int64_t count = 0;
  absl::string_view greeting = hello.payload;
  if (!absl::ConsumePrefix(&greeting, "OK ") || !absl::SimpleAtoi(greeting, &count)) {
    return absl::InternalError("side socket: malformed greeting");
  }
  for (int64_t i = 0; i < count; ++i) {
    KVD_ASSIGN_OR_RETURN(ReceivedMessage m, ReceiveMessage(sock.get(), 256, 1));
    std::vector<std::string> parts = absl::StrSplit(m.payload, ' ');
    uint32_t pool = 0, shard = 0;
    int64_t size = 0;
    if (parts.size() != 3 || m.fds.size() != 1 || !absl::SimpleAtoi(parts[0], &pool) ||
        !absl::SimpleAtoi(parts[1], &shard) || !absl::SimpleAtoi(parts[2], &size) ||
        pool >= pools.size() || shard >= pools[pool].shard_base.size()) {
      return absl::InternalError(absl::StrCat("side socket: malformed slab message '", m.payload, "'"));
    }
    if (options.shard >= 0 && static_cast<int32_t>(shard) != options.shard) continue;
    KVD_ASSIGN_OR_RETURN(MappedSlab slab, MappedSlab::Map(std::move(m.fds[0]), size));
    pools[pool].shard_base[shard] = slab.data();
    mappings.push_back(std::move(slab));
  }
  return absl::OkStatus();
}

absl::Status Client::Impl::OpenCudaSlabs(const v1::ListPoolsResponse& listed) {
#if KVD_HAVE_CUDA
  // The daemon's ordinals are not this process's (a pod granted one GPU sees it as device 0):
  // each slab names its device by UUID and PCI bus id, resolved here.
  KVD_ASSIGN_OR_RETURN(std::vector<DeviceIdentity> visible, ListCudaDevices());
  for (const v1::PoolInfo& p : listed.pools()) {
    for (const v1::SlabInfo& s : p.slabs()) {
      if (options.shard >= 0 && static_cast<int32_t>(s.shard()) != options.shard) continue;
      KVD_ASSIGN_OR_RETURN(int device,
                           ResolveDevice(visible, s.device_uuid(), s.device_pci_bus_id(), s.device()));
      KVD_ASSIGN_OR_RETURN(ImportedCudaSlab slab,
                           ImportedCudaSlab::Open(device, s.cuda_ipc_handle(), s.size_bytes()));
      pools[p.pool_id()].shard_base[s.shard()] = slab.data();
      pools[p.pool_id()].shard_device[s.shard()] = device;
      cuda_slabs.push_back(std::move(slab));
    }
  }
  return absl::OkStatus();
#else
  return absl::FailedPreconditionError(
      "kvd serves CUDA memory but this client was built without CUDA; rebuild with the toolkit");
#endif
}

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const ClientOptions& options) {
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  impl->channel = grpc::CreateCustomChannel(options.target, grpc::InsecureChannelCredentials(), args);
  if (!impl->channel->WaitForConnected(std::chrono::system_clock::now() +
                                       absl::ToChronoMilliseconds(options.connect_timeout))) {
    return absl::UnavailableError(absl::StrCat("cannot reach kvd at ", options.target));
  }
  impl->stub = v1::Kvd::NewStub(impl->channel);
  impl->attach = impl->stub->Attach(&impl->attach_ctx);
  v1::AttachRequest hello;
  hello.mutable_hello()->set_worker_name(options.worker_name);
  hello.mutable_hello()->set_pid(getpid());
  if (options.ipc_event_device >= 0) {
#if KVD_HAVE_CUDA
    KVD_ASSIGN_OR_RETURN(InterprocessEvent event, InterprocessEvent::Create(options.ipc_event_device));
    hello.mutable_hello()->set_cuda_event_handle(event.handle());
    impl->own_event.emplace(std::move(event));
#else
    return absl::FailedPreconditionError("ipc_event_device needs a client built with CUDA");
#endif
  }
  v1::AttachResponse resp;
  if (!impl->attach->Write(hello) || !impl->attach->Read(&resp) || !resp.has_attached()) {
    grpc::Status s = impl->attach->Finish();
    return s.ok() ? absl::UnavailableError("kvd closed the attach stream") : FromGrpcStatus(s);
  }
  impl->worker = WorkerId(resp.attached().worker_id());
  impl->backend = resp.attached().backend();
  // Beat at least three times per lease, whatever the options say: a lapsed lease releases every
  // request this worker holds.
  if (const int64_t lease_ms = resp.attached().lease_ttl_ms(); lease_ms > 0) {
    impl->options.heartbeat_period = std::min(impl->options.heartbeat_period, absl::Milliseconds(lease_ms) / 3);
  }
  if (absl::Status s = impl->AttachAndMap(resp.attached()); !s.ok()) {
    impl->attach_ctx.TryCancel();
    return s;
  }
  Impl* raw = impl.get();
  impl->heartbeat = std::thread([raw] { raw->Heartbeat(); });
  return std::unique_ptr<Client>(new Client(std::move(impl)));
}

Client::Client(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Client::~Client() {
  impl_->stop.Notify();
  if (impl_->heartbeat.joinable()) impl_->heartbeat.join();
  impl_->attach->WritesDone();
  impl_->attach->Finish();
}

const WorkerId& Client::worker_id() const { return impl_->worker; }
const std::string& Client::backend() const { return impl_->backend; }
const std::vector<PoolView>& Client::pools() const { return impl_->pools; }

absl::StatusOr<const PoolView*> Client::FindPool(absl::string_view name) const {
  for (const PoolView& p : impl_->pools) {
    if (p.geometry.name == name) return &p;
  }
  return absl::NotFoundError(absl::StrCat("unknown pool '", name, "'"));
}

absl::StatusOr<uint8_t*> Client::LayerPointer(PoolId pool, BlockIndex block, int32_t layer,
                                              uint32_t shard) const {
  if (pool >= impl_->pools.size()) return absl::NotFoundError(absl::StrCat("unknown pool ", pool));
  const PoolView& p = impl_->pools[pool];
  if (shard >= p.shard_base.size() || p.shard_base[shard] == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat("shard ", shard, " of pool ", pool, " is not mapped"));
  }
  KVD_ASSIGN_OR_RETURN(int64_t offset, p.layout.Offset(block, layer));
  return p.shard_base[shard] + offset;
}

namespace {

absl::Status CopyLayerBytes(bool device, void* dst, const void* src, int64_t n) {
  if (!device) {
    std::memcpy(dst, src, static_cast<size_t>(n));
    return absl::OkStatus();
  }
#if KVD_HAVE_CUDA
  return CudaCopy(dst, src, n);
#else
  return absl::FailedPreconditionError("device copy without CUDA support");
#endif
}

}  // namespace

absl::Status Client::WriteLayer(PoolId pool, BlockIndex block, int32_t layer, int64_t offset,
                                const void* src, int64_t n, uint32_t shard) const {
  KVD_ASSIGN_OR_RETURN(uint8_t* base, LayerPointer(pool, block, layer, shard));
  if (offset < 0 || n < 0 || offset + n > impl_->pools[pool].layout.layer_block_bytes()) {
    return absl::OutOfRangeError("write past the layer block");
  }
  return CopyLayerBytes(impl_->backend == "cuda", base + offset, src, n);
}

absl::Status Client::ReadLayer(PoolId pool, BlockIndex block, int32_t layer, int64_t offset,
                               void* dst, int64_t n, uint32_t shard) const {
  KVD_ASSIGN_OR_RETURN(uint8_t* base, LayerPointer(pool, block, layer, shard));
  if (offset < 0 || n < 0 || offset + n > impl_->pools[pool].layout.layer_block_bytes()) {
    return absl::OutOfRangeError("read past the layer block");
  }
  return CopyLayerBytes(impl_->backend == "cuda", dst, base + offset, n);
}

absl::Status Client::RecordWrites(void* stream) {
#if KVD_HAVE_CUDA
  if (!impl_->own_event.has_value()) {
    return absl::FailedPreconditionError("no interprocess event: set ClientOptions::ipc_event_device");
  }
  KVD_RETURN_IF_ERROR(impl_->own_event->Record(stream));
  absl::MutexLock lock(&impl_->fences_mu);
  impl_->event_recorded = true;
  return absl::OkStatus();
#else
  return absl::FailedPreconditionError("interprocess events need a client built with CUDA");
#endif
}

void Client::AddWriteFence(std::function<absl::Status()> wait) {
  absl::MutexLock lock(&impl_->fences_mu);
  impl_->fences.push_back(std::move(wait));
}

absl::Status Client::WaitForPublishers(const KvRequest& request, void* stream) {
#if KVD_HAVE_CUDA
  const int device = impl_->options.ipc_event_device >= 0 ? impl_->options.ipc_event_device : 0;
  for (const std::string& handle : request.publisher_events()) {
    InterprocessEvent* event = nullptr;
    {
      absl::MutexLock lock(&impl_->events_mu);
      auto& slot = impl_->peer_events[handle];
      if (slot == nullptr) {
        KVD_ASSIGN_OR_RETURN(InterprocessEvent opened, InterprocessEvent::Open(device, handle));
        slot = std::make_unique<InterprocessEvent>(std::move(opened));
      }
      event = slot.get();
    }
    KVD_RETURN_IF_ERROR(event->StreamWait(stream));
  }
  return absl::OkStatus();
#else
  if (request.publisher_events().empty()) return absl::OkStatus();
  return absl::FailedPreconditionError("interprocess events need a client built with CUDA");
#endif
}

absl::StatusOr<AdmitResult> Client::Admit(RequestSpec spec) {
  spec.owner = impl_->worker;
  v1::AdmitRequest req;
  ToProto(spec, &req);
  KVD_ASSIGN_OR_RETURN(v1::AdmitResponse r, impl_->Call<v1::AdmitResponse>([&](auto* ctx, auto* resp) {
    return impl_->stub->Admit(ctx, req, resp);
  }));
  return FromProto(r);
}

absl::StatusOr<AdmitResult> Client::Fits(RequestSpec spec) {
  spec.owner = impl_->worker;
  v1::AdmitRequest req;
  ToProto(spec, &req);
  KVD_ASSIGN_OR_RETURN(v1::AdmitResponse r, impl_->Call<v1::AdmitResponse>([&](auto* ctx, auto* resp) {
    return impl_->stub->Fits(ctx, req, resp);
  }));
  return FromProto(r);
}

absl::StatusOr<AcquireResult> Client::Acquire(const RequestId& id) {
  v1::AcquireRequest req;
  req.set_worker_id(impl_->worker.value());
  req.set_request_id(id.value());
  KVD_ASSIGN_OR_RETURN(v1::AcquireResponse r, impl_->Call<v1::AcquireResponse>([&](auto* ctx, auto* resp) {
    return impl_->stub->Acquire(ctx, req, resp);
  }));
  return FromProto(r);
}

absl::StatusOr<std::vector<BlockIndex>> Client::Extend(const RequestId& id, int64_t additional_tokens) {
  v1::ExtendRequest req;
  req.set_worker_id(impl_->worker.value());
  req.set_request_id(id.value());
  req.set_additional_tokens(additional_tokens);
  KVD_ASSIGN_OR_RETURN(v1::ExtendResponse r, impl_->Call<v1::ExtendResponse>([&](auto* ctx, auto* resp) {
    return impl_->stub->Extend(ctx, req, resp);
  }));
  return std::vector<BlockIndex>(r.new_blocks().begin(), r.new_blocks().end());
}

namespace {
v1::PublishRequest MakePublish(const WorkerId& w, const RequestId& id, absl::Span<const Token> tokens,
                               absl::Span<const BlockIndex> blocks) {
  v1::PublishRequest req;
  req.set_worker_id(w.value());
  req.set_request_id(id.value());
  req.mutable_tokens()->Add(tokens.begin(), tokens.end());
  req.mutable_blocks()->Add(blocks.begin(), blocks.end());
  return req;
}
}  // namespace

absl::StatusOr<PublishResult> Client::Publish(const RequestId& id, absl::Span<const Token> tokens,
                                              absl::Span<const BlockIndex> blocks) {
  KVD_RETURN_IF_ERROR(impl_->AwaitWrites());
  v1::PublishRequest req = MakePublish(impl_->worker, id, tokens, blocks);
  KVD_ASSIGN_OR_RETURN(v1::PublishResponse r, impl_->Call<v1::PublishResponse>([&](auto* ctx, auto* resp) {
    return impl_->stub->Publish(ctx, req, resp);
  }));
  return FromProto(r);
}

absl::StatusOr<PublishResult> Client::Keeps(const RequestId& id, absl::Span<const Token> tokens,
                                            absl::Span<const BlockIndex> blocks) {
  KVD_RETURN_IF_ERROR(impl_->AwaitWrites());
  v1::PublishRequest req = MakePublish(impl_->worker, id, tokens, blocks);
  KVD_ASSIGN_OR_RETURN(v1::PublishResponse r, impl_->Call<v1::PublishResponse>([&](auto* ctx, auto* resp) {
    return impl_->stub->Keeps(ctx, req, resp);
  }));
  return FromProto(r);
}

absl::Status Client::Checkpoint(const RequestId& id, absl::Span<const Token> tokens,
                                const std::string& engine_state) {
  KVD_RETURN_IF_ERROR(impl_->AwaitWrites());
  v1::CheckpointRequest req;
  req.set_worker_id(impl_->worker.value());
  req.set_request_id(id.value());
  req.mutable_tokens()->Add(tokens.begin(), tokens.end());
  req.set_engine_state(engine_state);
  return impl_->Call<v1::CheckpointResponse>([&](auto* ctx, auto* resp) {
    return impl_->stub->Checkpoint(ctx, req, resp);
  }).status();
}

absl::Status Client::Release(const RequestId& id, bool completed) {
  v1::ReleaseRequest req;
  req.set_worker_id(impl_->worker.value());
  req.set_request_id(id.value());
  req.set_completed(completed);
  return impl_->Call<v1::ReleaseResponse>([&](auto* ctx, auto* resp) {
    return impl_->stub->Release(ctx, req, resp);
  }).status();
}

absl::StatusOr<int64_t> Client::PeekPrefixLen(const Namespace& ns, absl::Span<const Token> tokens) {
  v1::PeekPrefixLenRequest req;
  ToProto(ns, req.mutable_namespace_());
  req.mutable_tokens()->Add(tokens.begin(), tokens.end());
  KVD_ASSIGN_OR_RETURN(v1::PeekPrefixLenResponse r, impl_->Call<v1::PeekPrefixLenResponse>([&](auto* ctx, auto* resp) {
    return impl_->stub->PeekPrefixLen(ctx, req, resp);
  }));
  return r.cached_tokens();
}

absl::Status Client::CloseSession(const SessionId& session) {
  v1::CloseSessionRequest req;
  req.set_session_id(session.value());
  return impl_->Call<v1::CloseSessionResponse>([&](auto* ctx, auto* resp) {
    return impl_->stub->CloseSession(ctx, req, resp);
  }).status();
}

absl::StatusOr<SessionInfo> Client::GetSession(const SessionId& session) {
  v1::GetSessionRequest req;
  req.set_session_id(session.value());
  KVD_ASSIGN_OR_RETURN(v1::SessionInfo r, impl_->Call<v1::SessionInfo>([&](auto* ctx, auto* resp) {
    return impl_->stub->GetSession(ctx, req, resp);
  }));
  return FromProto(r);
}

absl::StatusOr<GcStats> Client::Gc(absl::Duration max_idle) {
  v1::GcRequest req;
  req.set_max_idle_ms(absl::ToInt64Milliseconds(max_idle));
  KVD_ASSIGN_OR_RETURN(v1::GcResponse r, impl_->Call<v1::GcResponse>([&](auto* ctx, auto* resp) {
    return impl_->stub->Gc(ctx, req, resp);
  }));
  return GcStats{r.blocks_freed(), r.bytes_freed(), r.checkpoints_dropped(), r.sessions_expired()};
}

absl::StatusOr<int64_t> Client::Boundary() {
  KVD_ASSIGN_OR_RETURN(v1::BoundaryResponse r, impl_->Call<v1::BoundaryResponse>([&](auto* ctx, auto* resp) {
    return impl_->stub->Boundary(ctx, v1::BoundaryRequest(), resp);
  }));
  return r.evicted_blocks();
}

absl::StatusOr<CacheReport> Client::Report() {
  KVD_ASSIGN_OR_RETURN(v1::ReportResponse r, impl_->Call<v1::ReportResponse>([&](auto* ctx, auto* resp) {
    return impl_->stub->Report(ctx, v1::ReportRequest(), resp);
  }));
  return FromProto(r);
}

absl::StatusOr<std::vector<HandleInfo>> Client::ListHandles() {
  KVD_ASSIGN_OR_RETURN(v1::ListHandlesResponse r, impl_->Call<v1::ListHandlesResponse>([&](auto* ctx, auto* resp) {
    return impl_->stub->ListHandles(ctx, v1::ListHandlesRequest(), resp);
  }));
  std::vector<HandleInfo> out;
  for (const v1::Handle& h : r.handles()) out.push_back(FromProto(h));
  return out;
}

absl::StatusOr<HandleInfo> Client::GetHandle(const RequestId& id) {
  v1::GetHandleRequest req;
  req.set_request_id(id.value());
  KVD_ASSIGN_OR_RETURN(v1::Handle r, impl_->Call<v1::Handle>([&](auto* ctx, auto* resp) {
    return impl_->stub->GetHandle(ctx, req, resp);
  }));
  return FromProto(r);
}

absl::Status Client::Ping() {
  return impl_->Call<v1::PingResponse>([&](auto* ctx, auto* resp) {
    return impl_->stub->Ping(ctx, v1::PingRequest(), resp);
  }).status();
}

namespace {

class GrpcEventWatcher final : public EventWatcher {
 public:
  GrpcEventWatcher(v1::Kvd::Stub* stub, uint64_t after) {
    v1::WatchEventsRequest req;
    req.set_after_sequence(after);
    reader_ = stub->WatchEvents(&ctx_, req);
  }
  ~GrpcEventWatcher() override {
    ctx_.TryCancel();
    reader_->Finish();
  }
  absl::StatusOr<Batch> Next() override {
    v1::EventBatch b;
    if (!reader_->Read(&b)) return absl::UnavailableError("event stream ended");
    Batch out;
    out.resync = b.resync();
    for (const v1::CacheEvent& e : b.events()) out.events.push_back(FromProto(e));
    return out;
  }

 private:
  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReader<v1::EventBatch>> reader_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<EventWatcher>> Client::WatchEvents(uint64_t after_sequence) {
  return std::make_unique<GrpcEventWatcher>(impl_->stub.get(), after_sequence);
}

absl::StatusOr<std::unique_ptr<KvRequest>> Client::Start(RequestSpec spec, absl::Duration wait) {
  KVD_ASSIGN_OR_RETURN(const PoolView* pool, FindPool(spec.ns.pool));
  if (wait < absl::Milliseconds(1)) wait = absl::Milliseconds(1);
  spec.owner = impl_->worker;
  v1::StartRequest req;
  ToProto(spec, req.mutable_admit());
  req.set_max_wait_ms(absl::ToInt64Milliseconds(wait));
  // The daemon waits for admission (first come, first served) and answers RESOURCE_EXHAUSTED
  // when `wait` passes; the call's own deadline leaves room for the Acquire after it.
  absl::StatusOr<v1::StartResponse> r = impl_->Call<v1::StartResponse>(
      [&](auto* ctx, auto* resp) { return impl_->stub->Start(ctx, req, resp); }, wait + absl::Seconds(30));
  if (!r.ok()) {
    if (absl::IsResourceExhausted(r.status()) && absl::StrContains(r.status().message(), "not admitted within")) {
      return absl::DeadlineExceededError(absl::StrCat("request '", spec.id.value(), "' was not admitted within ",
                                                      absl::FormatDuration(wait), ": ", r.status().message()));
    }
    return r.status();
  }
  return std::unique_ptr<KvRequest>(
      new KvRequest(this, spec.id, FromProto(r->acquired()), pool->geometry.block_tokens));
}

absl::StatusOr<EndResult> Client::End(const RequestId& id, int64_t publish_blocks,
                                          absl::Span<const Token> more_tokens, bool completed) {
  if (publish_blocks != 0) KVD_RETURN_IF_ERROR(impl_->AwaitWrites());
  v1::EndRequest req;
  req.set_worker_id(impl_->worker.value());
  req.set_request_id(id.value());
  req.set_publish_blocks(static_cast<int32_t>(std::clamp<int64_t>(publish_blocks, -1, INT32_MAX)));
  req.mutable_more_tokens()->Add(more_tokens.begin(), more_tokens.end());
  req.set_completed(completed);
  KVD_ASSIGN_OR_RETURN(v1::EndResponse r, impl_->Call<v1::EndResponse>([&](auto* ctx, auto* resp) {
    return impl_->stub->End(ctx, req, resp);
  }));
  EndResult out;
  out.kept = r.kept();
  out.already_cached = r.already_cached();
  out.duplicates = r.duplicates();
  out.no_parent = r.no_parent();
  return out;
}

KvRequest::~KvRequest() {
  if (!released_) (void)client_->Release(id_, /*completed=*/false);
}

absl::Status KvRequest::Extend(int64_t n) {
  KVD_ASSIGN_OR_RETURN(std::vector<BlockIndex> added, client_->Extend(id_, n));
  state_.blocks.insert(state_.blocks.end(), added.begin(), added.end());
  state_.num_tokens += n;
  return absl::OkStatus();
}

absl::StatusOr<PublishResult> KvRequest::Publish(absl::Span<const Token> tokens) {
  const size_t full = std::min(tokens.size() / block_tokens_, state_.blocks.size());
  return client_->Publish(id_, tokens, absl::MakeConstSpan(state_.blocks).subspan(0, full));
}

absl::Status KvRequest::Checkpoint(absl::Span<const Token> tokens, const std::string& engine_state) {
  return client_->Checkpoint(id_, tokens, engine_state);
}

absl::StatusOr<EndResult> KvRequest::End(int64_t publish_blocks, absl::Span<const Token> more_tokens,
                                          bool completed) {
  KVD_ASSIGN_OR_RETURN(EndResult r, client_->End(id_, publish_blocks, more_tokens, completed));
  released_ = true;
  return r;
}

absl::Status KvRequest::Release(bool completed) {
  KVD_RETURN_IF_ERROR(client_->Release(id_, completed));
  released_ = true;
  return absl::OkStatus();
}

}  // namespace kvd::client
