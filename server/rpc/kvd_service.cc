#include "server/rpc/kvd_service.h"

#include "server/build_info.h"

#include <unistd.h>

#include <chrono>

#include "absl/strings/str_cat.h"
#include "proto/convert.h"
#include "server/obs/process_stats.h"
#include "server/rpc/ended_writers.h"
#include "proto/grpc_status.h"
#include "proto/vocab/status_macros.h"
#include "server/obs/log_safe.h"
#include "server/rpc/kvd_service_unary.h"
#include "spdlog/spdlog.h"

namespace kvd {
namespace {

absl::Status Draining() {
  return absl::UnavailableError("kvd is draining: no new work is admitted");
}

absl::Status RequireId(absl::string_view what, const std::string& value) {
  if (value.empty()) return absl::InvalidArgumentError(absl::StrCat(what, " is required"));
  return absl::OkStatus();
}

}  // namespace

KvdService::KvdService(KvCache* cache, AttachmentRegistry* workers, const DeviceArena* arena,
                       Metrics* metrics, std::string side_socket, absl::Duration lease_ttl,
                       TierStore* tiers, PeerPuller* puller)
    : cache_(cache),
      tiers_(tiers),
      puller_(puller),
      workers_(workers),
      arena_(arena),
      metrics_(metrics),
      side_socket_(std::move(side_socket)),
      lease_ttl_(lease_ttl),
      admission_(std::make_unique<AdmissionQueue>(cache)),
      inflight_(std::make_unique<InflightWaits>(cache)) {
  cache_->SetInflightWake([waits = inflight_.get()] { waits->Poke(); });
}

KvdService::~KvdService() {
  cache_->SetInflightWake(nullptr);  // the cache may outlive the waits
}

absl::Status KvdService::CheckInflightWait(int64_t wait_ms) const {
  if (wait_ms < 0 || wait_ms > absl::ToInt64Milliseconds(InflightWaits::kMaxWait)) {
    return absl::InvalidArgumentError(absl::StrCat("wait_for_in_flight_ms must be between 0 and ",
                                                   absl::ToInt64Milliseconds(InflightWaits::kMaxWait), ", not ",
                                                   wait_ms));
  }
  return absl::OkStatus();
}

std::optional<InFlightInfo> KvdService::InFlightToWait(const RequestSpec& spec, int64_t wait_ms) const {
  if (wait_ms <= 0 || !spec.resume_from.empty()) return std::nullopt;
  absl::StatusOr<std::optional<InFlightInfo>> ahead = cache_->InFlightAhead(spec.ns, spec.prompt);
  if (!ahead.ok() || !ahead->has_value()) return std::nullopt;  // a bad spec fails in Admit, as without a wait
  // Never a wait on its own id: Admit refuses a live id at once (ALREADY_EXISTS), as without a wait.
  if ((*ahead)->request_id == spec.id) return std::nullopt;
  return std::move(*ahead);
}

void KvdService::WaitFor(const RequestSpec& spec, const std::string& key, InFlightInfo found, int64_t wait_ms,
                         absl::Time deadline, std::function<absl::Status()> cancelled, InFlightThen then) {
  auto still_wanted = [this, owner = spec.owner, id = spec.id, key, cancelled = std::move(cancelled)]() -> absl::Status {
    KVD_RETURN_IF_ERROR(cancelled());
    if (!workers_->Check(owner, key).ok()) {
      return absl::FailedPreconditionError(absl::StrCat("worker ", owner.value(), " detached while request '",
                                                        id.value(), "' waited for blocks in flight"));
    }
    return absl::OkStatus();
  };
  inflight_->Wait(spec.limit_key(), std::move(found), spec.ns, spec.prompt,
                  std::min(deadline, absl::Now() + absl::Milliseconds(wait_ms)), std::move(still_wanted),
                  std::move(then));
}

absl::StatusOr<KvdService::Caller> KvdService::Identify(const std::string& grpc_peer) const {
  Caller caller;
  if (peers_ == nullptr) {
    // TCP (or an in-process channel): whoever passed the transport's security is an operator.
    caller.key = grpc_peer;
    caller.role = Role::kOperator;
    return caller;
  }
  std::optional<PeerCredentials> peer = peers_->PeerOf(grpc_peer);
  if (!peer.has_value()) return absl::PermissionDeniedError("kvd cannot tell who is calling");
  return IdentifyPeer(*peer);
}

absl::StatusOr<KvdService::Caller> KvdService::IdentifyPeer(const PeerCredentials& peer) const {
  if (policy_ != nullptr) KVD_RETURN_IF_ERROR(policy_->Check(peer));
  Caller caller;
  caller.key = absl::StrCat("pid:", peer.pid);
  caller.creds = peer;
  caller.role = peer.uid == 0 || peer.uid == ::geteuid() ? Role::kOperator : Role::kWorker;
  return caller;
}

absl::Status KvdService::Authorize(const grpc::CallbackServerContext* ctx, absl::string_view method) const {
  KVD_ASSIGN_OR_RETURN(Caller caller, Identify(ctx));
  if (RequiredRole(method) == Role::kOperator && caller.role != Role::kOperator) {
    return absl::PermissionDeniedError(absl::StrCat(
        method, " is for operators (root or kvd's own user); uid ", caller.creds ? caller.creds->uid : 0,
        " may call the worker RPCs only"));
  }
  return absl::OkStatus();
}

absl::StatusOr<KvdService::Caller> KvdService::CheckWorker(const grpc::CallbackServerContext* ctx,
                                                          const std::string& worker_id,
                                                          const std::string& request_id) const {
  KVD_ASSIGN_OR_RETURN(Caller caller, Identify(ctx));
  KVD_RETURN_IF_ERROR(CheckWorker(caller, worker_id));
  if (!request_id.empty()) KVD_RETURN_IF_ERROR(cache_->CheckOwner(RequestId(request_id), WorkerId(worker_id)));
  return caller;
}

absl::Status KvdService::CheckWorker(const Caller& caller, const std::string& worker_id) const {
  KVD_RETURN_IF_ERROR(RequireId("worker_id", worker_id));
  return workers_->Check(WorkerId(worker_id), caller.key);
}

void KvdService::StartDraining(bool final) {
  if (final) final_drain_ = true;
  if (draining_.exchange(true)) return;
  spdlog::info("draining: no new work is admitted");
  admission_->Close(Draining());
  inflight_->Close(Draining());
  if (on_serving_) on_serving_(false);
}

absl::Status KvdService::StopDraining() {
  if (final_drain_) {
    return absl::FailedPreconditionError("kvd is shutting down (SIGTERM): its drain cannot be undone");
  }
  if (!draining_) return absl::OkStatus();
  admission_->Reopen();
  inflight_->Reopen();
  draining_ = false;
  spdlog::info("drain undone: admitting again");
  if (on_serving_) on_serving_(true);
  return absl::OkStatus();
}

void KvdService::LiftFences(const WorkerId& attachment, uint32_t pid) {
  if (const int64_t n = cache_->LiftFences(attachment, pid); n > 0) {
    spdlog::info("worker {} (pid {}) re-attached quiesced: {} fenced block(s) handed on", attachment.value(), pid, n);
    admission_->Poke();
  }
}

void KvdService::PokeAdmission() { admission_->Poke(); }

void KvdService::WorkerGone(const WorkerId& worker, absl::string_view why) {
  if (handing_off_) {
    spdlog::info("worker {}: {} during a handoff; what it holds is fenced for it", worker.value(), std::string(why));
    return;
  }
  workers_->Remove(worker);
  ForgetSteps(worker);
  if (tiers_ != nullptr) tiers_->ReleasePrefetchesOf(worker);
  const int64_t released = cache_->ReleaseWorker(worker);
  admission_->Poke();
  spdlog::info("worker {} gone ({}): released {} requests as interrupted", worker.value(), std::string(why),
               released);
}

void KvdService::WorkerLost(const WorkerId& worker, uint32_t pid) {
  if (handing_off_) {
    WorkerGone(worker, "attach stream broke");
    return;
  }
  // A process that has ended writes nothing more: what it held is released as after a clean
  // detach. Only a pid the kernel vouched for (a Unix socket's peer) is looked at; a zombie
  // counts as gone, a pid reused since counts as alive (fenced: the safe side).
  if (pid != 0 && ProcessGone(static_cast<pid_t>(pid))) {
    WorkerGone(worker, "attach stream broke; its process has ended");
    return;
  }
  if (!workers_->Remove(worker)) return;  // its lease lapsed first: released then
  ForgetSteps(worker);
  if (tiers_ != nullptr) tiers_->ReleasePrefetchesOf(worker);
  const int64_t ended = cache_->FenceWorker(worker, pid, lease_ttl_);
  spdlog::info("worker {} lost its attach stream: {} request(s) ended; what it held is fenced for it for up to {}",
               worker.value(), ended, absl::FormatDuration(lease_ttl_));
}

grpc::ServerUnaryReactor* KvdService::ListPools(grpc::CallbackServerContext* ctx,
                                                const v1::ListPoolsRequest*,
                                                v1::ListPoolsResponse* resp) {
  return Unary(ctx, "ListPools", [&] {
    const auto& pools = cache_->pools();
    for (PoolId id = 0; id < pools.size(); ++id) {
      v1::PoolInfo* info = resp->add_pools();
      ToProto(id, pools[id], info);
      for (const SlabDescriptor& s : arena_->slabs()) {
        if (s.pool != id) continue;
        v1::SlabInfo* slab = info->add_slabs();
        slab->set_shard(s.shard);
        slab->set_device(s.device);
        slab->set_size_bytes(s.size_bytes);
        slab->set_cuda_ipc_handle(s.cuda_ipc_handle);
        slab->set_device_uuid(s.device_uuid);
        slab->set_device_pci_bus_id(s.device_pci_bus_id);
        if (s.device >= 0) slab->set_allocator(s.cuda_vmm ? "vmm" : "ipc");
        slab->set_memory_id(s.memory_id);
      }
    }
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* KvdService::Admit(grpc::CallbackServerContext* ctx,
                                            const v1::AdmitRequest* req, v1::AdmitResponse* resp) {
  return Unary(ctx, "Admit", [&]() -> absl::Status {
    if (draining()) return Draining();
    KVD_ASSIGN_OR_RETURN(Caller caller, CheckWorker(ctx, req->worker_id(), ""));
    RequestSpec spec = SpecFromProto(*req);
    spec.principal = WorkerId(caller.key);  // limits count per process, however often it attached
    if (!spec.resume_from.empty()) LiftFencesOfEndedWriters(*cache_);  // as WaitOwnerGone ends
    absl::StatusOr<AdmitResult> r = cache_->Admit(spec);
    if (absl::IsAlreadyExists(r.status()) && !spec.resume_from.empty()) r = AdmitAfterOwnerGone(ctx, spec);
    KVD_RETURN_IF_ERROR(r.status());
    ToProto(*r, resp);
    return absl::OkStatus();
  });
}

absl::StatusOr<AdmitResult> KvdService::AdmitAfterOwnerGone(const grpc::CallbackServerContext* ctx,
                                                            const RequestSpec& spec) {
  WaitOwnerGone(ctx, spec);
  absl::StatusOr<AdmitResult> r = cache_->Admit(spec);
  if (absl::IsAlreadyExists(r.status()) && absl::IsPermissionDenied(cache_->CheckOwner(spec.id, spec.owner))) {
    return absl::AlreadyExistsError(absl::StrCat(r.status().message(), " under another worker, still after waiting up to ",
                                                 absl::FormatDuration(kResumeWait), " for it to end"));
  }
  return r;
}

void KvdService::WaitOwnerGone(const grpc::CallbackServerContext* ctx, const RequestSpec& spec) {
  // Only a request live under another worker is worth waiting for; the caller's own is its bug.
  if (absl::IsPermissionDenied(cache_->CheckOwner(spec.id, spec.owner))) {
    if (resume_waiters_.fetch_add(1) < kMaxResumeWaiters) {
      absl::Time deadline = absl::Now() + kResumeWait;
      if (ctx->deadline() != std::chrono::system_clock::time_point::max()) {
        deadline = std::min(deadline, absl::FromChrono(ctx->deadline()));
      }
      while (absl::IsPermissionDenied(cache_->CheckOwner(spec.id, spec.owner)) && absl::Now() < deadline &&
             !ctx->IsCancelled() && !draining()) {
        absl::SleepFor(absl::Milliseconds(5));
      }
    }
    resume_waiters_.fetch_sub(1);
  }
  // The checkpoint's tail block is the resume's only once no writer may still write it: the fences
  // of writers whose process has ended are lifted now, not at the reaper's next look.
  LiftFencesOfEndedWriters(*cache_);
}

grpc::ServerUnaryReactor* KvdService::Fits(grpc::CallbackServerContext* ctx,
                                           const v1::AdmitRequest* req, v1::AdmitResponse* resp) {
  return Unary(ctx, "Fits", [&]() -> absl::Status {
    if (draining()) return Draining();
    KVD_ASSIGN_OR_RETURN(AdmitResult r, cache_->Fits(SpecFromProto(*req)));
    ToProto(r, resp);
    return absl::OkStatus();
  });
}

absl::Status KvdService::CheckPeer(const std::string& peer) const {
  if (peer.empty()) return absl::OkStatus();
  if (puller_ == nullptr) {
    return absl::FailedPreconditionError(
        "this kvd pulls from no peer: its config has no transfer section (docs/transfer.md)");
  }
  return puller_->CheckPeer(peer);
}

void KvdService::AcquireThen(const RequestId& id, v1::AcquireResponse* resp,
                             std::function<void(absl::Status)> done, const std::string& peer,
                             std::function<void(InFlightInfo)> defer, bool units_in_g1) {
  if (tiers_ != nullptr && !units_in_g1) {
    // A hybrid pool's units below G1 come back as whole units before the lookup, which then
    // serves them by docs/hybrid.md §2.6 as any cached unit (off this thread; the answer waits).
    absl::StatusOr<RequestSpec> spec = cache_->SpecOf(id);
    if (spec.ok() && spec->resume_from.empty() &&
        tiers_->InstallUnits(*spec, [this, id, resp, done, peer, defer]() { AcquireThen(id, resp, done, peer, defer, true); })) {
      return;
    }
  }
  absl::StatusOr<AcquireResult> r = cache_->Acquire(id, defer ? OnInFlight::kDefer : OnInFlight::kCompute);
  if (!r.ok()) return done(r.status());
  if (r->deferred) return defer(std::move(*r->in_flight));
  for (const WorkerId& w : r->publishers) {
    if (std::string e = workers_->EventHandle(w); !e.empty()) r->publisher_events.push_back(std::move(e));
  }
  ToProto(*r, resp);
  if (!peer.empty() && puller_ != nullptr && !r->resumed) {
    // After the lower tiers (if any) promoted what they hold: the peer is asked for the rest.
    done = [this, id, peer, resp, done = std::move(done)](absl::Status s) mutable {
      if (!s.ok()) return done(s);
      PullThen(id, peer, resp, std::move(done));
    };
  }
  if (tiers_ == nullptr) return done(absl::OkStatus());
  // Lower tiers may hold more of the prefix: the answer waits (off this thread) until those
  // blocks are copied into the request's table and published.
  absl::StatusOr<RequestSpec> spec = cache_->SpecOf(id);
  if (!spec.ok()) return done(absl::OkStatus());
  auto finish = std::make_shared<std::function<void(absl::Status)>>(std::move(done));
  const bool promoting = tiers_->Promote(id, *spec, *r, [resp, id, finish](absl::StatusOr<int64_t> cached) {
    // The request is acquired whatever the promotion did: a failed promotion leaves it as
    // Acquire served it from the device tier, so the answer is that (never an error that would
    // tell the worker nothing was acquired).
    if (cached.ok()) {
      resp->set_cached_tokens(*cached);
    } else {
      spdlog::warn("promotion for request {} failed: {}; served from the device tier only",
                   LogSafe(id.value()), LogSafe(cached.status().ToString(), 256));
    }
    (*finish)(absl::OkStatus());
  });
  if (!promoting) (*finish)(absl::OkStatus());
}

void KvdService::PullThen(const RequestId& id, const std::string& peer, v1::AcquireResponse* resp,
                          std::function<void(absl::Status)> done) {
  absl::StatusOr<RequestSpec> spec = cache_->SpecOf(id);
  if (!spec.ok()) return done(absl::OkStatus());
  std::vector<BlockIndex> table(resp->blocks().begin(), resp->blocks().end());
  auto finish = std::make_shared<std::function<void(absl::Status)>>(std::move(done));
  // A failed pull leaves the request as the local lookup served it: the answer is that.
  const bool pulling = puller_->Pull(peer, id, *spec, resp->pool_id(), resp->cached_tokens(), std::move(table),
                                     [this, id, resp, finish](absl::StatusOr<int64_t> cached) {
                                       if (cached.ok() && *cached > resp->cached_tokens() && resp->group_tables_size() > 0) {
                                         // A hybrid pool's pulled unit moved every group's table to the new hit.
                                         absl::StatusOr<std::vector<GroupTable>> tables = cache_->GroupTablesOf(id);
                                         if (tables.ok()) {
                                           resp->clear_group_tables();
                                           for (const GroupTable& t : *tables) ToProto(t, resp->add_group_tables());
                                           resp->set_full_hit_tokens(std::max(resp->full_hit_tokens(), *cached));
                                         }
                                       }
                                       if (cached.ok()) resp->set_cached_tokens(*cached);
                                       (*finish)(absl::OkStatus());
                                     });
  if (!pulling) (*finish)(absl::OkStatus());
}

grpc::ServerUnaryReactor* KvdService::Acquire(grpc::CallbackServerContext* ctx,
                                              const v1::AcquireRequest* req,
                                              v1::AcquireResponse* resp) {
  const auto start = std::chrono::steady_clock::now();
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  absl::Status status = Authorize(ctx, "Acquire");
  if (status.ok()) status = CheckWorker(ctx, req->worker_id(), req->request_id()).status();
  if (!status.ok()) {
    FinishRpc(reactor, "Acquire", start, status);
    return reactor;
  }
  AcquireThen(RequestId(req->request_id()), resp,
              [this, reactor, start](absl::Status s) { FinishRpc(reactor, "Acquire", start, s); });
  return reactor;
}

struct KvdService::StartCall {
  grpc::CallbackServerContext* ctx;
  grpc::ServerUnaryReactor* reactor;
  v1::StartResponse* resp;
  std::chrono::steady_clock::time_point start;
  absl::Time deadline;
  RequestSpec spec;
  std::string key;  // the caller
  std::string peer;
  int64_t wait_ms = 0;
};

grpc::ServerUnaryReactor* KvdService::Start(grpc::CallbackServerContext* ctx, const v1::StartRequest* req,
                                            v1::StartResponse* resp) {
  const auto start = std::chrono::steady_clock::now();
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  absl::StatusOr<Caller> caller = [&]() -> absl::StatusOr<Caller> {
    KVD_RETURN_IF_ERROR(Authorize(ctx, "Start"));
    if (draining()) return Draining();
    if (req->max_wait_ms() < 0 || req->max_wait_ms() > absl::ToInt64Milliseconds(kMaxStartWait)) {
      return absl::InvalidArgumentError(absl::StrCat("max_wait_ms must be between 0 and ",
                                                     absl::ToInt64Milliseconds(kMaxStartWait), ", not ",
                                                     req->max_wait_ms()));
    }
    KVD_RETURN_IF_ERROR(CheckInflightWait(req->wait_for_in_flight_ms()));
    KVD_RETURN_IF_ERROR(CheckPeer(req->peer()));
    return CheckWorker(ctx, req->admit().worker_id(), "");
  }();
  if (!caller.ok()) {
    FinishRpc(reactor, "Start", start, caller.status());
    return reactor;
  }
  RequestSpec spec = SpecFromProto(req->admit());
  spec.principal = WorkerId(caller->key);
  // The request may still be live under a worker that just died (WaitOwnerGone returns at once
  // unless another worker holds it).
  if (!spec.resume_from.empty()) WaitOwnerGone(ctx, spec);
  absl::Time deadline =
      absl::Now() + (req->max_wait_ms() > 0 ? absl::Milliseconds(req->max_wait_ms()) : kDefaultStartWait);
  if (ctx->deadline() != std::chrono::system_clock::time_point::max()) {
    deadline = std::min(deadline, absl::FromChrono(ctx->deadline()));
  }
  const int64_t wait_ms = req->wait_for_in_flight_ms();
  auto call = std::make_shared<StartCall>(
      StartCall{ctx, reactor, resp, start, deadline, std::move(spec), caller->key, req->peer(), wait_ms});
  // Blocks in flight first (docs/architecture.md, "Prefixes in flight"): the start waits holding
  // nothing, then queues for admission as any start. One that found none may still find some at
  // its acquire (a start of the same prefix admitted with it acquired first): it waits then.
  const bool may_defer = wait_ms > 0 && call->spec.resume_from.empty();
  if (std::optional<InFlightInfo> found = InFlightToWait(call->spec, wait_ms)) {
    StartWait(std::move(call), std::move(*found));
  } else {
    StartAdmit(std::move(call), may_defer);
  }
  return reactor;
}

void KvdService::StartWait(std::shared_ptr<StartCall> call, InFlightInfo found) {
  ToProto(found, call->resp->mutable_in_flight());
  const RequestSpec& spec = call->spec;
  WaitFor(
      spec, call->key, std::move(found), call->wait_ms, call->deadline,
      [ctx = call->ctx]() -> absl::Status {
        return ctx->IsCancelled() ? absl::CancelledError("the caller gave up waiting") : absl::OkStatus();
      },
      [this, call](absl::StatusOr<InflightWaits::Outcome> outcome, absl::Duration waited) {
        v1::StartResponse* resp = call->resp;
        resp->set_in_flight_waited_us(resp->in_flight_waited_us() + absl::ToInt64Microseconds(waited));
        if (!outcome.ok()) return FinishRpc(call->reactor, "Start", call->start, outcome.status());
        resp->set_in_flight_wait(static_cast<v1::InFlightWait>(*outcome));
        StartAdmit(call, /*may_defer=*/false);
      });
}

void KvdService::StartAdmit(std::shared_ptr<StartCall> call, bool may_defer) {
  const RequestId id = call->spec.id;
  const WorkerId worker = call->spec.owner;
  admission_->Admit(
      call->spec, call->deadline, [ctx = call->ctx] { return ctx->IsCancelled(); },
      [this, call, id, worker, may_defer](absl::StatusOr<AdmitResult> admitted, absl::Duration waited) {
        v1::StartResponse* resp = call->resp;
        grpc::ServerUnaryReactor* reactor = call->reactor;
        const auto start = call->start;
        resp->set_waited(resp->waited() || waited > absl::ZeroDuration());
        resp->set_waited_us(resp->waited_us() + absl::ToInt64Microseconds(waited));
        // Per admission (not per poll; a start that deferred to blocks in flight is admitted
        // twice): how long it waited, and how the wait ended.
        // Labels name configured pools only: a request's made-up pool name must not mint series.
        if (cache_->FindPool(call->spec.ns.pool).ok()) {
          metrics_->ObserveAdmissionWait(call->spec.ns.pool,
                                         admitted.ok() ? "admitted" : absl::StatusCodeToString(admitted.status().code()),
                                         absl::ToDoubleSeconds(waited));
        }
        if (!admitted.ok()) return FinishRpc(reactor, "Start", start, admitted.status());
        // The worker may have detached while it waited; its requests were released then, but
        // not this one, admitted after: give it back.
        if (absl::Status attached = workers_->Check(worker, call->key); !attached.ok()) {
          (void)cache_->Release(id, /*completed=*/false);
          admission_->Poke();
          return FinishRpc(reactor, "Start", start,
                           absl::FailedPreconditionError(absl::StrCat(
                               "worker ", worker.value(), " detached while request '", id.value(),
                               "' waited for admission")));
        }
        std::function<void(InFlightInfo)> defer;
        if (may_defer) {
          defer = [this, call, id](InFlightInfo found) {
            // Another start of this prefix acquired first: the reservation goes back (a waiter
            // holds nothing), and it waits as if it had found them before admission.
            (void)cache_->Release(id, /*completed=*/false);
            admission_->Poke();
            StartWait(call, std::move(found));
          };
        }
        AcquireThen(
            id, resp->mutable_acquired(),
            [this, reactor, start, id](absl::Status s) {
              if (!s.ok()) {  // admitted but not acquired: the reservation goes back (Client::Start does the same)
                (void)cache_->Release(id, /*completed=*/false);
                admission_->Poke();
              }
              FinishRpc(reactor, "Start", start, s);
            },
            call->peer, std::move(defer));
      });
}

grpc::ServerUnaryReactor* KvdService::End(grpc::CallbackServerContext* ctx, const v1::EndRequest* req,
                                          v1::EndResponse* resp) {
  return Unary(ctx, "End", [&]() -> absl::Status {
    KVD_RETURN_IF_ERROR(CheckWorker(ctx, req->worker_id(), req->request_id()).status());
    const std::vector<Token> more = TokensFromProto(req->more_tokens());
    KVD_ASSIGN_OR_RETURN(PublishResult r, cache_->End(RequestId(req->request_id()), req->publish_blocks(), more,
                                                      req->completed(), FromProto(req->state_checkpoints())));
    for (CheckpointOutcome o : r.checkpoint_outcomes) {
      resp->add_checkpoint_outcomes(static_cast<v1::CheckpointOutcome>(o));
    }
    admission_->Poke();
    for (PublishOutcome o : r.outcomes) {
      switch (o) {
        case PublishOutcome::kKept: resp->set_kept(resp->kept() + 1); break;
        case PublishOutcome::kAlreadyCached: resp->set_already_cached(resp->already_cached() + 1); break;
        case PublishOutcome::kDuplicate: resp->set_duplicates(resp->duplicates() + 1); break;
        case PublishOutcome::kNoParent: resp->set_no_parent(resp->no_parent() + 1); break;
      }
    }
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* KvdService::Extend(grpc::CallbackServerContext* ctx,
                                             const v1::ExtendRequest* req,
                                             v1::ExtendResponse* resp) {
  return Unary(ctx, "Extend", [&]() -> absl::Status {
    KVD_RETURN_IF_ERROR(CheckWorker(ctx, req->worker_id(), req->request_id()).status());
    KVD_ASSIGN_OR_RETURN(std::vector<BlockIndex> blocks,
                         cache_->Extend(RequestId(req->request_id()), req->additional_tokens()));
    resp->mutable_new_blocks()->Add(blocks.begin(), blocks.end());
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* KvdService::PublishOrKeeps(grpc::CallbackServerContext* ctx,
                                                     const char* method,
                                                     const v1::PublishRequest* req,
                                                     v1::PublishResponse* resp, bool dry_run) {
  return Unary(ctx, method, [&]() -> absl::Status {
    KVD_RETURN_IF_ERROR(CheckWorker(ctx, req->worker_id(), req->request_id()).status());
    const RequestId id(req->request_id());
    const std::vector<Token> tokens = TokensFromProto(req->tokens());
    const std::vector<BlockIndex> blocks(req->blocks().begin(), req->blocks().end());
    KVD_ASSIGN_OR_RETURN(PublishResult r, dry_run ? cache_->Keeps(id, tokens, blocks)
                                                  : cache_->Publish(id, tokens, blocks,
                                                                    FromProto(req->state_checkpoints())));
    ToProto(r, resp);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* KvdService::Publish(grpc::CallbackServerContext* ctx,
                                              const v1::PublishRequest* req,
                                              v1::PublishResponse* resp) {
  return PublishOrKeeps(ctx, "Publish", req, resp, /*dry_run=*/false);
}

grpc::ServerUnaryReactor* KvdService::Keeps(grpc::CallbackServerContext* ctx,
                                            const v1::PublishRequest* req,
                                            v1::PublishResponse* resp) {
  return PublishOrKeeps(ctx, "Keeps", req, resp, /*dry_run=*/true);
}

grpc::ServerUnaryReactor* KvdService::Release(grpc::CallbackServerContext* ctx,
                                              const v1::ReleaseRequest* req,
                                              v1::ReleaseResponse*) {
  return Unary(ctx, "Release", [&]() -> absl::Status {
    KVD_RETURN_IF_ERROR(CheckWorker(ctx, req->worker_id(), req->request_id()).status());
    KVD_RETURN_IF_ERROR(cache_->Release(RequestId(req->request_id()), req->completed()));
    admission_->Poke();
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* KvdService::Checkpoint(grpc::CallbackServerContext* ctx,
                                                 const v1::CheckpointRequest* req,
                                                 v1::CheckpointResponse* resp) {
  return Unary(ctx, "Checkpoint", [&]() -> absl::Status {
    KVD_RETURN_IF_ERROR(CheckWorker(ctx, req->worker_id(), req->request_id()).status());
    std::vector<int64_t> fresh;
    KVD_RETURN_IF_ERROR(cache_->Checkpoint(RequestId(req->request_id()), TokensFromProto(req->tokens()),
                                           req->engine_state(), FromProto(req->state_checkpoints()), &fresh));
    resp->mutable_fresh_slots()->Add(fresh.begin(), fresh.end());
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* KvdService::PeekPrefixLen(grpc::CallbackServerContext* ctx,
                                                    const v1::PeekPrefixLenRequest* req,
                                                    v1::PeekPrefixLenResponse* resp) {
  return Unary(ctx, "PeekPrefixLen", [&]() -> absl::Status {
    const Namespace ns = FromProto(req->namespace_());
    const std::vector<Token> tokens = TokensFromProto(req->tokens());
    KVD_ASSIGN_OR_RETURN(int64_t n, cache_->PeekPrefixLen(ns, tokens));
    // A hybrid pool's units below G1 come back before a start's lookup: what they add counts too.
    if (tiers_ != nullptr) n = std::max(n, tiers_->PeekUnits(ns, tokens));
    resp->set_cached_tokens(n);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* KvdService::CloseSession(grpc::CallbackServerContext* ctx,
                                                   const v1::CloseSessionRequest* req,
                                                   v1::CloseSessionResponse*) {
  return Unary(ctx, "CloseSession", [&]() -> absl::Status {
    KVD_RETURN_IF_ERROR(RequireId("session_id", req->session_id()));
    return cache_->CloseSession(SessionId(req->session_id()));
  });
}

grpc::ServerUnaryReactor* KvdService::GetSession(grpc::CallbackServerContext* ctx,
                                                 const v1::GetSessionRequest* req,
                                                 v1::SessionInfo* resp) {
  return Unary(ctx, "GetSession", [&]() -> absl::Status {
    KVD_RETURN_IF_ERROR(RequireId("session_id", req->session_id()));
    KVD_ASSIGN_OR_RETURN(SessionInfo info, cache_->GetSession(SessionId(req->session_id())));
    ToProto(info, resp);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* KvdService::ListSessions(grpc::CallbackServerContext* ctx,
                                                   const v1::ListSessionsRequest*,
                                                   v1::ListSessionsResponse* resp) {
  return Unary(ctx, "ListSessions", [&] {
    for (const SessionInfo& s : cache_->ListSessions()) ToProto(s, resp->add_sessions());
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* KvdService::Drain(grpc::CallbackServerContext* ctx,
                                            const v1::DrainRequest* req, v1::DrainResponse* resp) {
  return Unary(ctx, "Drain", [&] {
    if (req->resume()) {
      KVD_RETURN_IF_ERROR(StopDraining());
    } else {
      StartDraining();
    }
    resp->set_live_requests(cache_->Report().live_requests);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* KvdService::Boundary(grpc::CallbackServerContext* ctx,
                                               const v1::BoundaryRequest*,
                                               v1::BoundaryResponse* resp) {
  return Unary(ctx, "Boundary", [&] {
    resp->set_evicted_blocks(cache_->Boundary());
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* KvdService::Gc(grpc::CallbackServerContext* ctx,
                                         const v1::GcRequest* req, v1::GcResponse* resp) {
  return Unary(ctx, "Gc", [&]() -> absl::Status {
    if (req->max_idle_ms() < 0) return absl::InvalidArgumentError("max_idle_ms must be >= 0");
    GcStats s = cache_->Gc(absl::Milliseconds(req->max_idle_ms()));
    admission_->Poke();
    resp->set_blocks_freed(s.blocks_freed);
    resp->set_bytes_freed(s.bytes_freed);
    resp->set_checkpoints_dropped(s.checkpoints_dropped);
    resp->set_sessions_expired(s.sessions_expired);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* KvdService::Report(grpc::CallbackServerContext* ctx,
                                             const v1::ReportRequest*, v1::ReportResponse* resp) {
  return Unary(ctx, "Report", [&] {
    ToProto(cache_->Report(), resp);
    resp->set_attached_workers(workers_->size());
    resp->set_admission_waiting(admission_->waiting());
    resp->set_in_flight_blocks(cache_->inflight_blocks());
    resp->set_in_flight_waiting(inflight_->waiting());
    resp->set_build(absl::StrCat(BuildInfo(), ", backend ", arena_->backend()));
    resp->set_draining(draining());
    if (tiers_ != nullptr) ToProto(tiers_->Stats(), resp->mutable_tiers());
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* KvdService::ListHandles(grpc::CallbackServerContext* ctx,
                                                  const v1::ListHandlesRequest*,
                                                  v1::ListHandlesResponse* resp) {
  return Unary(ctx, "ListHandles", [&] {
    for (const HandleInfo& h : cache_->ListHandles()) ToProto(h, resp->add_handles());
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* KvdService::GetHandle(grpc::CallbackServerContext* ctx,
                                                const v1::GetHandleRequest* req, v1::Handle* resp) {
  return Unary(ctx, "GetHandle", [&]() -> absl::Status {
    KVD_RETURN_IF_ERROR(RequireId("request_id", req->request_id()));
    KVD_ASSIGN_OR_RETURN(HandleInfo h, cache_->GetHandle(RequestId(req->request_id())));
    ToProto(h, resp);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* KvdService::Ping(grpc::CallbackServerContext* ctx,
                                           const v1::PingRequest*, v1::PingResponse*) {
  return Unary(ctx, "Ping", [] { return absl::OkStatus(); });
}

}  // namespace kvd
