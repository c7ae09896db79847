#include "client/client.h"
#include "client/client_impl.h"
#include "proto/vocab/default_paths.h"


#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <optional>
#include <thread>
#include <utility>

#include <grpcpp/grpcpp.h>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/notification.h"
#include "client/slab_maps.h"
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

absl::Status Client::Impl::Dial(absl::Duration timeout) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // a fresh connection, not a shared one
  auto channel = grpc::CreateCustomChannel(options.target, grpc::InsecureChannelCredentials(), args);
  if (!channel->WaitForConnected(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(timeout))) {
    return absl::UnavailableError(absl::StrCat("cannot reach kvd at ", options.target));
  }
  absl::MutexLock lock(&stub_mu);
  stub_ = v1::Kvd::NewStub(channel);
  return absl::OkStatus();
}

absl::StatusOr<v1::Attached> Client::Impl::OpenStream(
    std::unique_ptr<grpc::ClientContext>* ctx,
    std::unique_ptr<grpc::ClientReaderWriter<v1::AttachRequest, v1::AttachResponse>>* stream) {
  *ctx = std::make_unique<grpc::ClientContext>();
  {
    absl::MutexLock lock(&stream_mu);
    if (stop.HasBeenNotified()) return absl::CancelledError("the client is closing");
    opening_ctx = ctx->get();
  }
  *stream = stub()->Attach(ctx->get());
  v1::AttachResponse resp;
  const int64_t sent = SteadyNs();
  const bool answered = (*stream)->Write(hello) && (*stream)->Read(&resp) && resp.has_attached();
  {
    absl::MutexLock lock(&stream_mu);
    opening_ctx = nullptr;
  }
  if (!answered) {
    grpc::Status s = (*stream)->Finish();
    return s.ok() ? absl::UnavailableError("kvd closed the attach stream") : FromGrpcStatus(s);
  }
  hello_sent_ns = sent;
  return resp.attached();
}

absl::StatusOr<std::unique_ptr<SlabMaps>> Client::Impl::ListAndMap(const v1::Attached& a) {
  KVD_ASSIGN_OR_RETURN(v1::ListPoolsResponse listed,
                       Call<v1::ListPoolsResponse>([&](grpc::ClientContext* ctx, v1::ListPoolsResponse* r) {
                         return stub()->ListPools(ctx, v1::ListPoolsRequest(), r);
                       }));
  if (options.map_slabs && a.backend() == "cuda") {
    // Opening a CUDA IPC handle is expensive: when kvd kept the same memory, keep the mapping.
    absl::MutexLock lock(&mu);
    if (maps != nullptr && maps->identities() == SlabMaps::CudaIdentities(listed, options.shard)) {
      return SlabMaps::Open(listed, nullptr, options.shard);  // geometry only: memory kept
    }
  }
  return SlabMaps::Open(listed, options.map_slabs ? &a : nullptr, options.shard);
}

void Client::Impl::Supervise() {
  struct Done {
    absl::Notification* n;
    ~Done() { n->Notify(); }
  } done{&supervisor_done};
  for (;;) {
    // Only this thread replaces the stream (Reattach), so reading it outside the lock is safe;
    // a read may run beside the heartbeat's writes.
    grpc::ClientReaderWriter<v1::AttachRequest, v1::AttachResponse>* stream = nullptr;
    {
      absl::MutexLock lock(&stream_mu);
      stream = attach.get();
    }
    v1::AttachResponse resp;
    while (stream->Read(&resp)) {
      if (resp.has_heartbeat_ack()) OnAck(resp.heartbeat_ack().seq());
    }
    may_write_until_ns.store(0, std::memory_order_release);
    if (stop.HasBeenNotified()) return;
    {
      absl::MutexLock lock(&mu);
      attached = false;
      detached_reason = "kvd went away or the lease could not be renewed; reconnecting";
    }
    // Nothing from this attachment is written once kvd may hand its blocks on: quiesce before
    // re-attaching. The hello names the lost attachment, and says `quiesced` only when the engine
    // vouched for its own writes: kvd then hands on at once what it fenced for that attachment.
    Quiesce();
    hello.mutable_hello()->set_previous_worker_id(Worker().value());
    hello.mutable_hello()->set_quiesced(Vouches());
    absl::Duration backoff = absl::Milliseconds(50);
    for (;;) {
      absl::Status s = Reattach();
      if (s.ok()) break;
      {
        absl::MutexLock lock(&mu);
        detached_reason = absl::StrCat("kvd restarting; re-attaching failed: ", s.message());
      }
      if (stop.WaitForNotificationWithTimeout(backoff)) return;
      backoff = std::min(backoff * 2, absl::Seconds(2));
    }
  }
}

absl::Status Client::Impl::Reattach() {
  KVD_RETURN_IF_ERROR(Dial(absl::Seconds(1)));
  std::unique_ptr<grpc::ClientContext> ctx;
  std::unique_ptr<grpc::ClientReaderWriter<v1::AttachRequest, v1::AttachResponse>> stream;
  KVD_ASSIGN_OR_RETURN(v1::Attached a, OpenStream(&ctx, &stream));
  auto fresh = ListAndMap(a);
  if (fresh.ok() && a.backend() != backend) {
    fresh = absl::FailedPreconditionError(absl::StrCat("kvd came back with backend '", a.backend(),
                                                       "', not '", backend, "'"));
  }
  std::unique_ptr<SlabMaps> old;
  bool moved = false;
  if (fresh.ok()) {
    absl::MutexLock lock(&mu);
    if (!maps->SameGeometryAs(**fresh)) {
      fresh = absl::FailedPreconditionError(
          "kvd came back with different pools; this client keeps its pools for its life: connect anew");
    } else if (!(*fresh)->identities().empty() && (*fresh)->identities() != maps->identities()) {
      old = maps->Adopt(std::move(*fresh));
      moved = true;
    }
  }
  if (!fresh.ok()) {
    ctx->TryCancel();
    (void)stream->Finish();
    return fresh.status();
  }
  {
    absl::MutexLock lock(&stream_mu);
    (void)attach->Finish();  // the old stream ended already
    attach_ctx = std::move(ctx);
    attach = std::move(stream);
  }
  // The engine's KV tensors moved: say so before any new request can start, then let the old
  // mappings go.
  if (moved && options.on_remap) options.on_remap();
  old.reset();
  if (a.lease_ttl_ms() > 0) lease_ttl = absl::Milliseconds(a.lease_ttl_ms());
  absl::MutexLock lock(&mu);
  worker = WorkerId(a.worker_id());
  ++epoch;
  attached = true;
  detached_reason.clear();
  // The new attachment's lease, renewed no earlier than the hello's sending, for its epoch only.
  write_epoch.store(epoch, std::memory_order_release);
  may_write_until_ns.store(hello_sent_ns + absl::ToInt64Nanoseconds(lease_ttl / 2), std::memory_order_release);
  attached_cv.SignalAll();
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const ClientOptions& options) {
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  if (impl->options.target.empty()) impl->options.target = DefaultTarget();
  KVD_RETURN_IF_ERROR(impl->Dial(options.connect_timeout));
  impl->hello.mutable_hello()->set_worker_name(options.worker_name);
  impl->hello.mutable_hello()->set_pid(getpid());
  // A first attach lifts nothing: fences are the attachments' that held the blocks (Supervise).
  impl->hello.mutable_hello()->set_quiesced(false);
  if (options.ipc_event_device >= 0) {
#if KVD_HAVE_CUDA
    KVD_ASSIGN_OR_RETURN(InterprocessEvent event, InterprocessEvent::Create(options.ipc_event_device));
    impl->hello.mutable_hello()->set_cuda_event_handle(event.handle());
    impl->own_event.emplace(std::move(event));
#else
    return absl::FailedPreconditionError("ipc_event_device needs a client built with CUDA");
#endif
  }
  std::unique_ptr<grpc::ClientContext> ctx;
  std::unique_ptr<grpc::ClientReaderWriter<v1::AttachRequest, v1::AttachResponse>> stream;
  KVD_ASSIGN_OR_RETURN(v1::Attached attached, impl->OpenStream(&ctx, &stream));
  impl->backend = attached.backend();
  // Beat at least four times per lease, whatever the options say: writes stop half a lease after
  // the last acknowledged beat, and a lapsed lease releases every request this worker holds.
  if (const int64_t lease_ms = attached.lease_ttl_ms(); lease_ms > 0) {
    impl->options.heartbeat_period = std::min(impl->options.heartbeat_period, absl::Milliseconds(lease_ms) / 4);
    impl->lease_ttl = absl::Milliseconds(lease_ms);
  }
  impl->may_write_until_ns.store(impl->hello_sent_ns + absl::ToInt64Nanoseconds(impl->lease_ttl / 2));
  auto maps = impl->ListAndMap(attached);
  if (!maps.ok()) {
    ctx->TryCancel();
    (void)stream->Finish();
    return maps.status();
  }
  {
    absl::MutexLock lock(&impl->mu);
    impl->worker = WorkerId(attached.worker_id());
    impl->maps = std::move(*maps);
  }
  {
    absl::MutexLock lock(&impl->stream_mu);
    impl->attach_ctx = std::move(ctx);
    impl->attach = std::move(stream);
  }
  Impl* raw = impl.get();
  impl->heartbeat = std::thread([raw] { raw->Heartbeat(); });
  impl->supervisor = std::thread([raw] { raw->Supervise(); });
  return std::unique_ptr<Client>(new Client(std::move(impl)));
}

Client::Client(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Client::~Client() {
  impl_->stop.Notify();
  {
    // Ends the attachment: kvd releases, as interrupted, whatever this worker still holds, and
    // closes the stream, which ends the supervisor's read. Cancelling covers a kvd that is gone,
    // and a re-attach under way.
    absl::MutexLock lock(&impl_->stream_mu);
    (void)impl_->attach->WritesDone();
    if (impl_->opening_ctx != nullptr) impl_->opening_ctx->TryCancel();
  }
  // A half-close is an ending kvd can tell from a broken stream (which it fences): give kvd a
  // moment to close the stream itself before cancelling it.
  (void)impl_->supervisor_done.WaitForNotificationWithTimeout(absl::Seconds(2));
  {
    absl::MutexLock lock(&impl_->stream_mu);
    impl_->attach_ctx->TryCancel();
  }
  if (impl_->supervisor.joinable()) impl_->supervisor.join();
  if (impl_->heartbeat.joinable()) impl_->heartbeat.join();
  {
    absl::MutexLock lock(&impl_->steps.mu);
    impl_->steps.stop_reporter = true;
    impl_->steps.cv.SignalAll();
  }
  if (impl_->steps.reporter.joinable()) impl_->steps.reporter.join();
  absl::MutexLock lock(&impl_->stream_mu);
  (void)impl_->attach->Finish();
}

WorkerId Client::worker_id() const { return impl_->Worker(); }
const std::string& Client::backend() const { return impl_->backend; }
const std::vector<PoolView>& Client::pools() const {
  absl::MutexLock lock(&impl_->mu);
  return impl_->maps->pools();
}

bool Client::attached() const {
  absl::MutexLock lock(&impl_->mu);
  return impl_->attached;
}

absl::Status Client::WaitAttached(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  absl::MutexLock lock(&impl_->mu);
  while (!impl_->attached) {
    if (impl_->attached_cv.WaitWithDeadline(&impl_->mu, deadline)) break;
  }
  if (impl_->attached) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat("not attached to kvd at ", impl_->options.target, ": ",
                                             impl_->detached_reason));
}

int64_t Client::epoch() const { return impl_->Epoch(); }

bool Client::MayWrite() const { return impl_->MayWrite(); }

bool Client::MayWrite(int64_t epoch) const { return impl_->MayWriteFor(epoch); }

absl::Status Client::LostIfRestarted(const absl::Status& status, int64_t epoch, const RequestId& id) {
  if (status.ok()) return status;
  // kvd going away fails calls with UNAVAILABLE (CANCELLED when a handoff shut its server down
  // mid-call; or, once back, says the old worker is not attached) a moment before the supervisor
  // sees the attach stream end: give it that moment.
  const bool maybe_gone = status.code() == absl::StatusCode::kUnavailable ||
                          status.code() == absl::StatusCode::kCancelled ||
                          (status.code() == absl::StatusCode::kFailedPrecondition &&
                           absl::StrContains(status.message(), "not attached"));
  absl::MutexLock lock(&impl_->mu);
  if (maybe_gone && impl_->attached && impl_->epoch == epoch) {
    impl_->attached_cv.WaitWithTimeout(&impl_->mu, absl::Milliseconds(500));
  }
  if (impl_->epoch != epoch || !impl_->attached) return KvdRestartedError(id);
  return status;
}

absl::StatusOr<const PoolView*> Client::FindPool(absl::string_view name) const {
  for (const PoolView& p : pools()) {
    if (p.geometry.name == name) return &p;
  }
  std::vector<absl::string_view> names;
  for (const PoolView& p : pools()) names.push_back(p.geometry.name);
  return absl::NotFoundError(
      absl::StrCat("unknown pool '", name, "' (kvd has: ", absl::StrJoin(names, ", "), ")"));
}

absl::StatusOr<uint8_t*> Client::LayerPointer(PoolId pool, BlockIndex block, int32_t layer,
                                              uint32_t shard) const {
  absl::ReaderMutexLock lock(&impl_->mu);
  return impl_->LayerAddress(pool, block, layer, shard, 0, 0);
}

namespace {

// `device`: the CUDA ordinal of the slab's shard, -1 for host memory.
absl::Status CopyLayerBytes(int device, void* dst, const void* src, int64_t n) {
  if (device < 0) {
    std::memcpy(dst, src, static_cast<size_t>(n));
    return absl::OkStatus();
  }
#if KVD_HAVE_CUDA
  return CudaCopy(device, dst, src, n);
#else
  return absl::FailedPreconditionError("device copy without CUDA support");
#endif
}

}  // namespace

// The copy runs under the mapping's lock: a remap (Reattach) cannot unmap the slab beneath it.
// Quiesce takes the lock exclusively after clearing the lease: a write that passed the check has
// finished before the client re-attaches.
absl::Status Client::WriteLayer(PoolId pool, BlockIndex block, int32_t layer, int64_t offset,
                                const void* src, int64_t n, uint32_t shard) const {
  return WriteLayerIn(0, pool, block, layer, offset, src, n, shard);
}

absl::Status Client::WriteLayerIn(int64_t epoch, PoolId pool, BlockIndex block, int32_t layer, int64_t offset,
                                  const void* src, int64_t n, uint32_t shard) const {
  absl::ReaderMutexLock lock(&impl_->mu);
  if (!(epoch == 0 ? impl_->MayWrite() : impl_->MayWriteFor(epoch))) {
    return absl::AbortedError(epoch != 0 && impl_->epoch != epoch
                                  ? "the request belongs to an earlier kvd attachment: its blocks are never written again"
                                  : "this worker's kvd lease is not held (lost, or being renewed): no write");
  }
  KVD_ASSIGN_OR_RETURN(uint8_t* base, impl_->LayerAddress(pool, block, layer, shard, offset, n));
  return CopyLayerBytes(impl_->ShardDevice(pool, shard), base, src, n);
}

absl::Status Client::ReadLayer(PoolId pool, BlockIndex block, int32_t layer, int64_t offset,
                               void* dst, int64_t n, uint32_t shard) const {
  absl::ReaderMutexLock lock(&impl_->mu);
  KVD_ASSIGN_OR_RETURN(uint8_t* base, impl_->LayerAddress(pool, block, layer, shard, offset, n));
  return CopyLayerBytes(impl_->ShardDevice(pool, shard), dst, base, n);
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
    // This worker's own blocks: CUDA refuses to open an IPC event in the process that made it.
    if (impl_->own_event.has_value() && handle == impl_->own_event->handle()) {
      KVD_RETURN_IF_ERROR(impl_->own_event->StreamWait(stream));
      continue;
    }
    std::shared_ptr<InterprocessEvent> event;
    {
      absl::MutexLock lock(&impl_->events_mu);
      auto it = impl_->peer_events.find(handle);
      if (it != impl_->peer_events.end()) event = it->second;
    }
    if (event == nullptr) {
      KVD_ASSIGN_OR_RETURN(InterprocessEvent opened, InterprocessEvent::Open(device, handle));
      event = std::make_shared<InterprocessEvent>(std::move(opened));
      absl::MutexLock lock(&impl_->events_mu);
      if (impl_->peer_events.size() >= Impl::kMaxPeerEvents) impl_->peer_events.clear();
      impl_->peer_events.emplace(handle, event);
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
  spec.owner = impl_->Worker();
  v1::AdmitRequest req;
  ToProto(spec, &req);
  KVD_ASSIGN_OR_RETURN(v1::AdmitResponse r, impl_->Call<v1::AdmitResponse>([&](auto* ctx, auto* resp) {
    return impl_->stub()->Admit(ctx, req, resp);
  }));
  return FromProto(r);
}

absl::StatusOr<AdmitResult> Client::Fits(RequestSpec spec) {
  spec.owner = impl_->Worker();
  v1::AdmitRequest req;
  ToProto(spec, &req);
  KVD_ASSIGN_OR_RETURN(v1::AdmitResponse r, impl_->Call<v1::AdmitResponse>([&](auto* ctx, auto* resp) {
    return impl_->stub()->Fits(ctx, req, resp);
  }));
  return FromProto(r);
}

absl::StatusOr<AcquireResult> Client::Acquire(const RequestId& id) {
  v1::AcquireRequest req;
  req.set_worker_id(impl_->Worker().value());
  req.set_request_id(id.value());
  KVD_ASSIGN_OR_RETURN(v1::AcquireResponse r, impl_->Call<v1::AcquireResponse>([&](auto* ctx, auto* resp) {
    return impl_->stub()->Acquire(ctx, req, resp);
  }));
  return FromProto(r);
}

absl::StatusOr<std::vector<BlockIndex>> Client::Extend(const RequestId& id, int64_t additional_tokens) {
  v1::ExtendRequest req;
  req.set_worker_id(impl_->Worker().value());
  req.set_request_id(id.value());
  req.set_additional_tokens(additional_tokens);
  KVD_ASSIGN_OR_RETURN(v1::ExtendResponse r, impl_->Call<v1::ExtendResponse>([&](auto* ctx, auto* resp) {
    return impl_->stub()->Extend(ctx, req, resp);
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
                                              absl::Span<const BlockIndex> blocks,
                                              absl::Span<const StateCheckpoint> checkpoints) {
  KVD_RETURN_IF_ERROR(impl_->AwaitWrites());
  v1::PublishRequest req = MakePublish(impl_->Worker(), id, tokens, blocks);
  ToProto(checkpoints, req.mutable_state_checkpoints());
  KVD_ASSIGN_OR_RETURN(v1::PublishResponse r, impl_->Call<v1::PublishResponse>([&](auto* ctx, auto* resp) {
    return impl_->stub()->Publish(ctx, req, resp);
  }));
  return FromProto(r);
}

absl::StatusOr<PublishResult> Client::Keeps(const RequestId& id, absl::Span<const Token> tokens,
                                            absl::Span<const BlockIndex> blocks) {
  KVD_RETURN_IF_ERROR(impl_->AwaitWrites());
  v1::PublishRequest req = MakePublish(impl_->Worker(), id, tokens, blocks);
  KVD_ASSIGN_OR_RETURN(v1::PublishResponse r, impl_->Call<v1::PublishResponse>([&](auto* ctx, auto* resp) {
    return impl_->stub()->Keeps(ctx, req, resp);
  }));
  return FromProto(r);
}

absl::Status Client::Checkpoint(const RequestId& id, absl::Span<const Token> tokens,
                                const std::string& engine_state, absl::Span<const StateCheckpoint> state,
                                std::vector<int64_t>* fresh_slots) {
  KVD_RETURN_IF_ERROR(impl_->AwaitWrites());
  v1::CheckpointRequest req;
  req.set_worker_id(impl_->Worker().value());
  req.set_request_id(id.value());
  req.mutable_tokens()->Add(tokens.begin(), tokens.end());
  req.set_engine_state(engine_state);
  ToProto(state, req.mutable_state_checkpoints());
  KVD_ASSIGN_OR_RETURN(v1::CheckpointResponse r, impl_->Call<v1::CheckpointResponse>([&](auto* ctx, auto* resp) {
    return impl_->stub()->Checkpoint(ctx, req, resp);
  }));
  if (fresh_slots != nullptr) fresh_slots->assign(r.fresh_slots().begin(), r.fresh_slots().end());
  return absl::OkStatus();
}

absl::Status Client::Release(const RequestId& id, bool completed) {
  v1::ReleaseRequest req;
  req.set_worker_id(impl_->Worker().value());
  req.set_request_id(id.value());
  req.set_completed(completed);
  return impl_->Call<v1::ReleaseResponse>([&](auto* ctx, auto* resp) {
    return impl_->stub()->Release(ctx, req, resp);
  }).status();
}

absl::StatusOr<int64_t> Client::PeekPrefixLen(const Namespace& ns, absl::Span<const Token> tokens) {
  v1::PeekPrefixLenRequest req;
  ToProto(ns, req.mutable_namespace_());
  req.mutable_tokens()->Add(tokens.begin(), tokens.end());
  KVD_ASSIGN_OR_RETURN(v1::PeekPrefixLenResponse r, impl_->Call<v1::PeekPrefixLenResponse>([&](auto* ctx, auto* resp) {
    return impl_->stub()->PeekPrefixLen(ctx, req, resp);
  }));
  return r.cached_tokens();
}

absl::Status Client::CloseSession(const SessionId& session) {
  v1::CloseSessionRequest req;
  req.set_session_id(session.value());
  return impl_->Call<v1::CloseSessionResponse>([&](auto* ctx, auto* resp) {
    return impl_->stub()->CloseSession(ctx, req, resp);
  }).status();
}

absl::StatusOr<SessionInfo> Client::GetSession(const SessionId& session) {
  v1::GetSessionRequest req;
  req.set_session_id(session.value());
  KVD_ASSIGN_OR_RETURN(v1::SessionInfo r, impl_->Call<v1::SessionInfo>([&](auto* ctx, auto* resp) {
    return impl_->stub()->GetSession(ctx, req, resp);
  }));
  return FromProto(r);
}

absl::StatusOr<GcStats> Client::Gc(absl::Duration max_idle) {
  v1::GcRequest req;
  req.set_max_idle_ms(absl::ToInt64Milliseconds(max_idle));
  KVD_ASSIGN_OR_RETURN(v1::GcResponse r, impl_->Call<v1::GcResponse>([&](auto* ctx, auto* resp) {
    return impl_->stub()->Gc(ctx, req, resp);
  }));
  return GcStats{r.blocks_freed(), r.bytes_freed(), r.checkpoints_dropped(), r.sessions_expired()};
}

absl::StatusOr<int64_t> Client::Boundary() {
  KVD_ASSIGN_OR_RETURN(v1::BoundaryResponse r, impl_->Call<v1::BoundaryResponse>([&](auto* ctx, auto* resp) {
    return impl_->stub()->Boundary(ctx, v1::BoundaryRequest(), resp);
  }));
  return r.evicted_blocks();
}

absl::StatusOr<CacheReport> Client::Report() {
  KVD_ASSIGN_OR_RETURN(v1::ReportResponse r, impl_->Call<v1::ReportResponse>([&](auto* ctx, auto* resp) {
    return impl_->stub()->Report(ctx, v1::ReportRequest(), resp);
  }));
  return FromProto(r);
}

absl::StatusOr<std::vector<HandleInfo>> Client::ListHandles() {
  KVD_ASSIGN_OR_RETURN(v1::ListHandlesResponse r, impl_->Call<v1::ListHandlesResponse>([&](auto* ctx, auto* resp) {
    return impl_->stub()->ListHandles(ctx, v1::ListHandlesRequest(), resp);
  }));
  std::vector<HandleInfo> out;
  for (const v1::Handle& h : r.handles()) out.push_back(FromProto(h));
  return out;
}

absl::StatusOr<HandleInfo> Client::GetHandle(const RequestId& id) {
  v1::GetHandleRequest req;
  req.set_request_id(id.value());
  KVD_ASSIGN_OR_RETURN(v1::Handle r, impl_->Call<v1::Handle>([&](auto* ctx, auto* resp) {
    return impl_->stub()->GetHandle(ctx, req, resp);
  }));
  return FromProto(r);
}

absl::Status Client::Ping() {
  return impl_->Call<v1::PingResponse>([&](auto* ctx, auto* resp) {
    return impl_->stub()->Ping(ctx, v1::PingRequest(), resp);
  }).status();
}

namespace {

class GrpcEventWatcher final : public EventWatcher {
 public:
  GrpcEventWatcher(std::shared_ptr<v1::Kvd::Stub> stub, uint64_t after) : stub_(std::move(stub)) {
    v1::WatchEventsRequest req;
    req.set_after_sequence(after);
    reader_ = stub_->WatchEvents(&ctx_, req);
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
  std::shared_ptr<v1::Kvd::Stub> stub_;  // keeps the channel alive
  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReader<v1::EventBatch>> reader_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<EventWatcher>> Client::WatchEvents(uint64_t after_sequence) {
  return std::make_unique<GrpcEventWatcher>(impl_->stub(), after_sequence);
}

absl::StatusOr<std::unique_ptr<KvRequest>> Client::Start(RequestSpec spec, absl::Duration wait,
                                                         const std::string& peer, absl::Duration wait_in_flight) {
  KVD_ASSIGN_OR_RETURN(const PoolView* pool, FindPool(spec.ns.pool));
  if (wait < absl::Milliseconds(1)) wait = absl::Milliseconds(1);
  const absl::Time deadline = absl::Now() + wait;
  // While kvd restarts, a new request waits (within `wait`) for the client to re-attach.
  for (;;) {
    KVD_RETURN_IF_ERROR(WaitAttached(std::max(deadline - absl::Now(), absl::ZeroDuration())));
    const int64_t epoch = impl_->Epoch();
    spec.owner = impl_->Worker();
    v1::StartRequest req;
    ToProto(spec, req.mutable_admit());
    req.set_max_wait_ms(std::max<int64_t>(1, absl::ToInt64Milliseconds(deadline - absl::Now())));
    req.set_peer(peer);
    req.set_wait_for_in_flight_ms(absl::ToInt64Milliseconds(wait_in_flight));
    // The daemon waits for admission (first come, first served) and answers RESOURCE_EXHAUSTED
    // when `wait` passes; the call's own deadline leaves room for the Acquire after it.
    absl::StatusOr<v1::StartResponse> r = impl_->Call<v1::StartResponse>(
        [&](auto* ctx, auto* resp) { return impl_->stub()->Start(ctx, req, resp); },
        (deadline - absl::Now()) + absl::Seconds(30) + wait_in_flight);
    if (r.ok()) {
      std::unique_ptr<KvRequest> out(
          new KvRequest(this, spec.id, FromProto(r->acquired()), pool->geometry.block_tokens, epoch));
      if (r->has_in_flight()) {
        v1::AcquireResponse seen;  // the wire's InFlight, read as AcquireResult's
        *seen.mutable_in_flight() = r->in_flight();
        out->in_flight_seen_ = FromProto(seen).in_flight;
      }
      out->in_flight_wait_ = static_cast<int>(r->in_flight_wait());
      return out;
    }
    if (IsKvdRestarted(LostIfRestarted(r.status(), epoch, spec.id)) && absl::Now() < deadline) {
      continue;  // kvd went away during the call: nothing of this request survived; try again
    }
    if (absl::IsResourceExhausted(r.status()) && absl::StrContains(r.status().message(), "not admitted within")) {
      return absl::DeadlineExceededError(absl::StrCat("request '", spec.id.value(), "' was not admitted within ",
                                                      absl::FormatDuration(wait), ": ", r.status().message()));
    }
    return r.status();
  }
}

absl::StatusOr<EndResult> Client::End(const RequestId& id, int64_t publish_blocks,
                                          absl::Span<const Token> more_tokens, bool completed,
                                          absl::Span<const StateCheckpoint> checkpoints) {
  if (publish_blocks != 0 || !checkpoints.empty()) KVD_RETURN_IF_ERROR(impl_->AwaitWrites());
  v1::EndRequest req;
  req.set_worker_id(impl_->Worker().value());
  req.set_request_id(id.value());
  req.set_publish_blocks(static_cast<int32_t>(std::clamp<int64_t>(publish_blocks, -1, INT32_MAX)));
  req.mutable_more_tokens()->Add(more_tokens.begin(), more_tokens.end());
  req.set_completed(completed);
  ToProto(checkpoints, req.mutable_state_checkpoints());
  KVD_ASSIGN_OR_RETURN(v1::EndResponse r, impl_->Call<v1::EndResponse>([&](auto* ctx, auto* resp) {
    return impl_->stub()->End(ctx, req, resp);
  }));
  EndResult out;
  out.kept = r.kept();
  out.already_cached = r.already_cached();
  out.duplicates = r.duplicates();
  out.no_parent = r.no_parent();
  for (int o : r.checkpoint_outcomes()) out.checkpoint_outcomes.push_back(static_cast<CheckpointOutcome>(o));
  return out;
}

absl::Status KvdRestartedError(const RequestId& id) {
  absl::Status s = absl::AbortedError(absl::StrCat(
      "kvd restarted: request '", id.value(), "' was lost with it; start it again (its last "
      "checkpoint, if kvd kept one, resumes it)"));
  s.SetPayload(kKvdRestartedPayload, absl::Cord("1"));
  return s;
}

bool IsKvdRestarted(const absl::Status& status) {
  return status.GetPayload(kKvdRestartedPayload).has_value();
}

KvRequest::~KvRequest() {
  if (!released_ && client_->epoch() == epoch_) (void)client_->Release(id_, /*completed=*/false);
}

bool KvRequest::MayWrite() const { return client_->MayWrite(epoch_); }

absl::Status KvRequest::WriteLayer(size_t position, int32_t layer, int64_t offset, const void* src, int64_t n,
                                   uint32_t shard) const {
  if (released_) return absl::FailedPreconditionError(absl::StrCat("request '", id_.value(), "' was released"));
  if (position >= state_.blocks.size()) {
    return absl::OutOfRangeError(absl::StrCat("block ", position, " of request '", id_.value(), "' (it has ",
                                              state_.blocks.size(), ")"));
  }
  return client_->WriteLayerIn(epoch_, state_.pool, state_.blocks[position], layer, offset, src, n, shard);
}

absl::Status KvRequest::Check() const {
  if (released_) return absl::FailedPreconditionError(absl::StrCat("request '", id_.value(), "' was released"));
  if (client_->epoch() != epoch_) return KvdRestartedError(id_);
  return absl::OkStatus();
}

const GroupTable* KvRequest::group_table(std::string_view name) const {
  return FindGroupTable(state_.group_tables, name);
}

absl::Status KvRequest::Extend(int64_t n, int64_t computed_tokens) {
  KVD_RETURN_IF_ERROR(Check());
  // The Extend RPC answers the flat table only: a hybrid pool's per-group tables come with a step.
  if (!state_.group_tables.empty()) return ExtendGroups(n, computed_tokens);
  absl::StatusOr<std::vector<BlockIndex>> added = client_->Extend(id_, n);
  KVD_RETURN_IF_ERROR(client_->LostIfRestarted(added.status(), epoch_, id_));
  state_.blocks.insert(state_.blocks.end(), added->begin(), added->end());
  state_.num_tokens += n;
  return absl::OkStatus();
}

absl::StatusOr<PublishResult> KvRequest::Publish(absl::Span<const Token> tokens,
                                                 absl::Span<const StateCheckpoint> checkpoints) {
  KVD_RETURN_IF_ERROR(Check());
  const size_t full = std::min(tokens.size() / block_tokens_, state_.blocks.size());
  absl::StatusOr<PublishResult> r =
      client_->Publish(id_, tokens, absl::MakeConstSpan(state_.blocks).subspan(0, full), checkpoints);
  KVD_RETURN_IF_ERROR(client_->LostIfRestarted(r.status(), epoch_, id_));
  // A kept checkpoint's slot is the pool's now: the fresh spare takes its place in the table.
  for (size_t i = 0; i < checkpoints.size() && i < r->checkpoint_outcomes.size(); ++i) {
    if (r->checkpoint_outcomes[i] != CheckpointOutcome::kKept) continue;
    const StateCheckpoint& c = checkpoints[i];
    if (c.group < 0 || c.group >= static_cast<int>(state_.group_tables.size())) continue;
    std::vector<BlockIndex>& slots = state_.group_tables[c.group].blocks;
    auto at = std::find(slots.begin(), slots.end(), c.slot);
    if (at == slots.end()) continue;
    if (i < r->fresh_slots.size() && r->fresh_slots[i] >= 0) *at = static_cast<BlockIndex>(r->fresh_slots[i]);
    else slots.erase(at);
  }
  return r;
}

absl::Status KvRequest::Checkpoint(absl::Span<const Token> tokens, const std::string& engine_state,
                                   absl::Span<const StateCheckpoint> state) {
  KVD_RETURN_IF_ERROR(Check());
  std::vector<int64_t> fresh;
  KVD_RETURN_IF_ERROR(
      client_->LostIfRestarted(client_->Checkpoint(id_, tokens, engine_state, state, &fresh), epoch_, id_));
  // Each named slot is the checkpoint's now: the fresh spare takes its place in the table.
  for (size_t i = 0; i < state.size() && i < fresh.size(); ++i) {
    const StateCheckpoint& c = state[i];
    if (c.group < 0 || c.group >= static_cast<int>(state_.group_tables.size()) || fresh[i] < 0) continue;
    std::vector<BlockIndex>& slots = state_.group_tables[c.group].blocks;
    if (auto at = std::find(slots.begin(), slots.end(), c.slot); at != slots.end()) *at = static_cast<BlockIndex>(fresh[i]);
  }
  return absl::OkStatus();
}

absl::StatusOr<EndResult> KvRequest::End(int64_t publish_blocks, absl::Span<const Token> more_tokens,
                                          bool completed, absl::Span<const StateCheckpoint> checkpoints) {
  KVD_RETURN_IF_ERROR(Check());
  absl::StatusOr<EndResult> r = client_->End(id_, publish_blocks, more_tokens, completed, checkpoints);
  KVD_RETURN_IF_ERROR(client_->LostIfRestarted(r.status(), epoch_, id_));
  released_ = true;
  return r;
}

absl::Status KvRequest::Release(bool completed) {
  KVD_RETURN_IF_ERROR(Check());
  KVD_RETURN_IF_ERROR(client_->LostIfRestarted(client_->Release(id_, completed), epoch_, id_));
  released_ = true;
  return absl::OkStatus();
}

}  // namespace kvd::client
