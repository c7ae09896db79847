// KvdService implements kvd.v1.Kvd with gRPC's callback API. Handlers are thin: convert the
// request, call KvCache, convert the answer; Unary() does status conversion, metrics and logging
// for every RPC in one place. Core calls never block (one short mutex), so handlers run inline on
// gRPC's threads. The streaming RPCs (Attach, WatchEvents, WatchPressure) are reactors in
// streams.cc.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "gpu/device_arena.h"
#include "kvd/v1/kvd.grpc.pb.h"
#include "server/core/kv_cache.h"
#include "server/obs/metrics.h"
#include "server/rpc/access_policy.h"
#include "server/rpc/admission_queue.h"
#include "server/rpc/inflight_waits.h"
#include "server/rpc/attachments.h"
#include "server/rpc/peer_listener.h"
#include "server/rpc/roles.h"
#include "server/store/tier_store.h"
#include "server/transfer/peer_puller.h"

namespace kvd {

class KvdService final : public v1::Kvd::CallbackService {
 public:
  // Everything is borrowed and must outlive the service (the Daemon owns it all). `tiers` is
  // null when kvd runs without lower tiers.
  KvdService(KvCache* cache, AttachmentRegistry* workers, const DeviceArena* arena,
             Metrics* metrics, std::string side_socket, absl::Duration lease_ttl,
             TierStore* tiers = nullptr, PeerPuller* puller = nullptr);
  ~KvdService() override;  // ends Start's waits (UNAVAILABLE) before anything it borrows goes

  // After this, Admit, Fits and Attach answer UNAVAILABLE; running requests continue. Calls
  // `on_drain` (set by the Daemon: health NOT_SERVING) once.
  // `final`: the daemon is shutting down (SIGTERM), and no StopDraining undoes it.
  void StartDraining(bool final = false);
  // Admits again after a drain that was not final. FAILED_PRECONDITION when it was.
  absl::Status StopDraining();
  // Called with false when a drain starts, true when one is undone (health status).
  void set_on_serving(std::function<void(bool serving)> fn) { on_serving_ = std::move(fn); }
  // On the Unix socket: every call's peer is looked up in `peers` (kvd accepted the connection
  // itself) and checked against `policy` (both borrowed). Call before serving.
  void set_access(const AccessPolicy* policy, const PeerListener* peers) {
    policy_ = policy;
    peers_ = peers;
  }
  // Who is calling.
  struct Caller {
    // Binds worker ids (AttachmentRegistry): "pid:<pid>" on the Unix socket, else the
    // transport's peer (on TCP, one connection).
    std::string key;
    std::optional<PeerCredentials> creds;  // on the Unix socket
    Role role = Role::kWorker;
  };
  // PERMISSION_DENIED when the allow-list refuses the caller or kvd cannot tell who it is.
  absl::StatusOr<Caller> Identify(const grpc::CallbackServerContext* ctx) const { return Identify(ctx->peer()); }
  // The same from ServerContext::peer() (for services other than Kvd: reflection).
  absl::StatusOr<Caller> Identify(const std::string& grpc_peer) const;
  // Identify for a Unix-socket peer known by its SO_PEERCRED (step lanes).
  absl::StatusOr<Caller> IdentifyPeer(const PeerCredentials& peer) const;
  // OK when the caller may call `method` (roles.h); PERMISSION_DENIED naming what is missing.
  absl::Status Authorize(const grpc::CallbackServerContext* ctx, absl::string_view method) const;
  bool draining() const { return draining_.load(); }
  // A worker's attachment ended (stream closed or lease lapsed): release what it held.
  // Hands on what kvd fenced for `attachment` of process `pid` (that process re-attached saying
  // the attachment quiesced) and wakes admission.
  void LiftFences(const WorkerId& attachment, uint32_t pid);
  // Wakes admission waiters (blocks came free outside a request: a fence lifted).
  void PokeAdmission();
  void WorkerGone(const WorkerId& worker, absl::string_view why);
  // A worker's attach stream broke while its lease was held: its requests end as interrupted and
  // what it held (their blocks, its credit) stays fenced for the attachment until it re-attaches
  // quiesced, process `pid` is gone, or a lease TTL has passed (KvCache::FenceWorker).
  void WorkerLost(const WorkerId& worker, uint32_t pid);
  // A handoff is under way: attach streams the server's shutdown cancels release nothing (their
  // requests and credit are ended fenced, keyed by each worker's pid: KvCache::EndAllFenced), and
  // the workers stay registered so that their pids are known.
  void BeginHandoff() { handing_off_ = true; }

  KvCache* cache() const { return cache_; }
  AttachmentRegistry* workers() const { return workers_; }
  const DeviceArena* arena() const { return arena_; }
  const std::string& side_socket() const { return side_socket_; }
  absl::Duration lease_ttl() const { return lease_ttl_; }

  grpc::ServerBidiReactor<v1::AttachRequest, v1::AttachResponse>* Attach(
      grpc::CallbackServerContext* ctx) override;
  grpc::ServerUnaryReactor* ListPools(grpc::CallbackServerContext* ctx,
                                      const v1::ListPoolsRequest* req,
                                      v1::ListPoolsResponse* resp) override;
  grpc::ServerUnaryReactor* Start(grpc::CallbackServerContext* ctx, const v1::StartRequest* req,
                                  v1::StartResponse* resp) override;
  grpc::ServerUnaryReactor* End(grpc::CallbackServerContext* ctx, const v1::EndRequest* req,
                                v1::EndResponse* resp) override;
  // step_service.cc.
  grpc::ServerUnaryReactor* Step(grpc::CallbackServerContext* ctx, const v1::StepRequest* req,
                                 v1::StepResponse* resp) override;
  // Step's work for an identified caller, from gRPC or a step lane: `done` runs once, maybe on
  // another thread, after `resp` is filled; `req` and `resp` must live until then.
  using StepDone = std::function<void(const absl::Status&)>;
  void RunStep(absl::StatusOr<Caller> caller, const v1::StepRequest& req, v1::StepResponse* resp, StepDone done);
  // Serves worker `worker_id`'s step lane on `fd` (step_lane.cc; docs/api.md) until the peer
  // closes it or breaks its framing, or `stop` is set.
  void ServeStepLane(int fd, const PeerCredentials& peer, const std::string& worker_id,
                     const std::atomic<bool>& stop);
  grpc::ServerUnaryReactor* Admit(grpc::CallbackServerContext* ctx, const v1::AdmitRequest* req,
                                  v1::AdmitResponse* resp) override;
  grpc::ServerUnaryReactor* Fits(grpc::CallbackServerContext* ctx, const v1::AdmitRequest* req,
                                 v1::AdmitResponse* resp) override;
  grpc::ServerUnaryReactor* Acquire(grpc::CallbackServerContext* ctx,
                                    const v1::AcquireRequest* req,
                                    v1::AcquireResponse* resp) override;
  grpc::ServerUnaryReactor* Extend(grpc::CallbackServerContext* ctx, const v1::ExtendRequest* req,
                                   v1::ExtendResponse* resp) override;
  grpc::ServerUnaryReactor* Publish(grpc::CallbackServerContext* ctx,
                                    const v1::PublishRequest* req,
                                    v1::PublishResponse* resp) override;
  grpc::ServerUnaryReactor* Keeps(grpc::CallbackServerContext* ctx, const v1::PublishRequest* req,
                                  v1::PublishResponse* resp) override;
  grpc::ServerUnaryReactor* Release(grpc::CallbackServerContext* ctx,
                                    const v1::ReleaseRequest* req,
                                    v1::ReleaseResponse* resp) override;
  grpc::ServerUnaryReactor* Checkpoint(grpc::CallbackServerContext* ctx,
                                       const v1::CheckpointRequest* req,
                                       v1::CheckpointResponse* resp) override;
  grpc::ServerUnaryReactor* PeekPrefixLen(grpc::CallbackServerContext* ctx,
                                          const v1::PeekPrefixLenRequest* req,
                                          v1::PeekPrefixLenResponse* resp) override;
  grpc::ServerUnaryReactor* CloseSession(grpc::CallbackServerContext* ctx,
                                         const v1::CloseSessionRequest* req,
                                         v1::CloseSessionResponse* resp) override;
  grpc::ServerUnaryReactor* GetSession(grpc::CallbackServerContext* ctx,
                                       const v1::GetSessionRequest* req,
                                       v1::SessionInfo* resp) override;
  grpc::ServerUnaryReactor* ListSessions(grpc::CallbackServerContext* ctx,
                                         const v1::ListSessionsRequest* req,
                                         v1::ListSessionsResponse* resp) override;
  grpc::ServerUnaryReactor* Drain(grpc::CallbackServerContext* ctx, const v1::DrainRequest* req,
                                  v1::DrainResponse* resp) override;
  grpc::ServerUnaryReactor* Boundary(grpc::CallbackServerContext* ctx,
                                     const v1::BoundaryRequest* req,
                                     v1::BoundaryResponse* resp) override;
  grpc::ServerUnaryReactor* Gc(grpc::CallbackServerContext* ctx, const v1::GcRequest* req,
                               v1::GcResponse* resp) override;
  grpc::ServerUnaryReactor* Report(grpc::CallbackServerContext* ctx, const v1::ReportRequest* req,
                                   v1::ReportResponse* resp) override;
  grpc::ServerUnaryReactor* ListHandles(grpc::CallbackServerContext* ctx,
                                        const v1::ListHandlesRequest* req,
                                        v1::ListHandlesResponse* resp) override;
  grpc::ServerUnaryReactor* GetHandle(grpc::CallbackServerContext* ctx,
                                      const v1::GetHandleRequest* req, v1::Handle* resp) override;
  grpc::ServerWriteReactor<v1::EventBatch>* WatchEvents(grpc::CallbackServerContext* ctx,
                                                        const v1::WatchEventsRequest* req) override;
  grpc::ServerWriteReactor<v1::PressureUpdate>* WatchPressure(
      grpc::CallbackServerContext* ctx, const v1::WatchPressureRequest* req) override;
  grpc::ServerUnaryReactor* Ping(grpc::CallbackServerContext* ctx, const v1::PingRequest* req,
                                 v1::PingResponse* resp) override;

  // Tiers: tier_service.cc.
  grpc::ServerUnaryReactor* Flush(grpc::CallbackServerContext* ctx, const v1::FlushRequest* req,
                                  v1::FlushResponse* resp) override;
  grpc::ServerUnaryReactor* Close(grpc::CallbackServerContext* ctx, const v1::CloseRequest* req,
                                  v1::CloseResponse* resp) override;
  grpc::ServerUnaryReactor* Prefetch(grpc::CallbackServerContext* ctx,
                                     const v1::PrefetchRequest* req,
                                     v1::PrefetchResponse* resp) override;
  grpc::ServerUnaryReactor* ReleasePrefetch(grpc::CallbackServerContext* ctx,
                                            const v1::ReleasePrefetchRequest* req,
                                            v1::ReleasePrefetchResponse* resp) override;
  grpc::ServerUnaryReactor* StopIdleDemotion(grpc::CallbackServerContext* ctx,
                                             const v1::StopIdleDemotionRequest* req,
                                             v1::StopIdleDemotionResponse* resp) override;
  grpc::ServerWriteReactor<v1::SavedPrefixBatch>* SavedPrefixes(
      grpc::CallbackServerContext* ctx, const v1::SavedPrefixesRequest* req) override;
  grpc::ServerUnaryReactor* PutObject(grpc::CallbackServerContext* ctx,
                                      const v1::PutObjectRequest* req,
                                      v1::PutObjectResponse* resp) override;
  grpc::ServerUnaryReactor* GetObject(grpc::CallbackServerContext* ctx,
                                      const v1::GetObjectRequest* req,
                                      v1::GetObjectResponse* resp) override;
  grpc::ServerUnaryReactor* DeleteObject(grpc::CallbackServerContext* ctx,
                                         const v1::DeleteObjectRequest* req,
                                         v1::DeleteObjectResponse* resp) override;

 private:
  // Runs `fn` (returning absl::Status), records latency and code, logs failures, finishes the call.
  template <typename Fn>
  grpc::ServerUnaryReactor* Unary(grpc::CallbackServerContext* ctx, const char* method, Fn&& fn);
  // The end of every unary call, also of those that finish later on another thread.
  void FinishRpc(grpc::ServerUnaryReactor* reactor, const char* method,
                 std::chrono::steady_clock::time_point start, const absl::Status& status);
  // FAILED_PRECONDITION unless tiers are configured (and, with `disk`, a disk tier).
  absl::Status RequireTiers(bool disk) const;
  // Publish, or with dry_run its prediction Keeps: the same checks and conversions.
  grpc::ServerUnaryReactor* PublishOrKeeps(grpc::CallbackServerContext* ctx, const char* method,
                                           const v1::PublishRequest* req,
                                           v1::PublishResponse* resp, bool dry_run);
  // Admit of a resume whose request id is still live under another worker, which is usually one
  // that just died and whose death kvd has not processed yet: retries until that request ends,
  // for up to kResumeWait or the client's deadline, then answers what Admit answers. At most
  // kMaxResumeWaiters calls wait at once (each holds a callback thread); the rest answer at once.
  absl::StatusOr<AdmitResult> AdmitAfterOwnerGone(const grpc::CallbackServerContext* ctx,
                                                  const RequestSpec& spec);
  // The wait of AdmitAfterOwnerGone, then the lift of ended writers' fences (ended_writers.h).
  void WaitOwnerGone(const grpc::CallbackServerContext* ctx, const RequestSpec& spec);
  // Acquire, with promotion from lower tiers, then a pull from `peer` (empty: none); fills `resp`
  // and calls `done` exactly once, maybe on another thread (a promotion's or a pull's). On a
  // hybrid pool the tiers' units come back into G1 first (TierStore::InstallUnits), then this
  // runs again with `units_in_g1`. `defer` set (a start that asked to wait for blocks in flight
  // and has not waited): when the lookup stops at blocks another live request of the namespace
  // computes, nothing is acquired and `defer` runs with them in place of `done`; the request is
  // still admitted (KvCache::Acquire, OnInFlight::kDefer).
  void AcquireThen(const RequestId& id, v1::AcquireResponse* resp, std::function<void(absl::Status)> done,
                   const std::string& peer = "", std::function<void(InFlightInfo)> defer = nullptr,
                   bool units_in_g1 = false);
  // After promotion: the pull from `peer`, then done(OK) (a failed pull leaves `resp` as it was).
  void PullThen(const RequestId& id, const std::string& peer, v1::AcquireResponse* resp,
                std::function<void(absl::Status)> done);
  // Start's and step start's wait for blocks in flight (StartRequest.wait_for_in_flight_ms;
  // docs/architecture.md, "Prefixes in flight"). CheckInflightWait: INVALID_ARGUMENT for a bad
  // bound. InFlightToWait: before admission, the blocks in flight a start asking to wait for
  // `wait_ms` would wait for (nullopt: none, or no wait asked, or a resume). WaitFor: waits for
  // `found` (InFlightToWait's, or a deferred Acquire's) holding nothing; `then` runs once it ends,
  // maybe on kvd-inflight's thread. It ends early when `cancelled` (the caller's wish) says so, or
  // FAILED_PRECONDITION once the worker (`spec.owner`, attached by `key`) detached.
  using InFlightThen = std::function<void(absl::StatusOr<InflightWaits::Outcome>, absl::Duration)>;
  absl::Status CheckInflightWait(int64_t wait_ms) const;
  std::optional<InFlightInfo> InFlightToWait(const RequestSpec& spec, int64_t wait_ms) const;
  void WaitFor(const RequestSpec& spec, const std::string& key, InFlightInfo found, int64_t wait_ms,
               absl::Time deadline, std::function<absl::Status()> cancelled, InFlightThen then);
  // One unary Start through its phases: the wait for blocks in flight, admission, acquire. An
  // acquire that finds blocks in flight it did not wait for (another start of the prefix was
  // admitted and acquired first) gives its admission back and waits: at most once per Start.
  struct StartCall;
  void StartWait(std::shared_ptr<StartCall> call, InFlightInfo found);
  void StartAdmit(std::shared_ptr<StartCall> call, bool may_defer);
  // OK for no peer or a configured one; Start's and step start's check before admission.
  absl::Status CheckPeer(const std::string& peer) const;
  static constexpr absl::Duration kDefaultStartWait = absl::Seconds(30);
  // The longest a Start may ask to wait for admission (max_wait_ms); longer is INVALID_ARGUMENT.
  static constexpr absl::Duration kMaxStartWait = absl::Minutes(10);
  static constexpr absl::Duration kResumeWait = absl::Seconds(2);
  static constexpr int kMaxResumeWaiters = 16;

  // What kvd keeps per worker between its steps: the last applied seq and its answer (a retry
  // gets it back), whether a step is being applied, and the starts waiting in the admission queue.
  struct ParkedStart;
  struct StepLog;
  static void Withdraw(ParkedStart& park);
  static void Park(StepLog& log, const std::string& id, const std::shared_ptr<ParkedStart>& park);
  static constexpr int kMaxStepItems = 16384;
  std::shared_ptr<StepLog> StepLogOf(const WorkerId& worker);
  void ForgetSteps(const WorkerId& worker);  // its worker is gone: parked starts withdrawn
  // Parts of Step (step_service.cc): the checks that refuse a whole step, the starts, the end.
  absl::Status CheckStep(const v1::StepRequest& req) const;
  void StartStepItem(const std::shared_ptr<StepLog>& log, const WorkerId& worker, const Caller& caller,
                     const v1::StepItem& item, v1::StepResult* result, std::function<void()> done);
  // A step start's admission (answer kept in `park` for the step that sends it again), and its
  // wait for blocks in flight, then admission.
  void ParkAdmit(std::shared_ptr<ParkedStart> park);
  void ParkWait(std::shared_ptr<ParkedStart> park, InFlightInfo found);

  // The worker is attached by this caller and, when `request_id` is set, holds that request.
  // Returns the caller.
  absl::StatusOr<Caller> CheckWorker(const grpc::CallbackServerContext* ctx, const std::string& worker_id,
                                     const std::string& request_id) const;
  absl::Status CheckWorker(const Caller& caller, const std::string& worker_id) const;

  KvCache* const cache_;
  TierStore* const tiers_;
  PeerPuller* const puller_;  // null without transfer
  AttachmentRegistry* const workers_;
  const DeviceArena* const arena_;
  Metrics* const metrics_;
  const std::string side_socket_;
  const absl::Duration lease_ttl_;
  std::atomic<bool> draining_{false};
  std::atomic<int> resume_waiters_{0};
  std::unique_ptr<AdmissionQueue> admission_;  // Start's waits
  std::unique_ptr<InflightWaits> inflight_;    // Start's waits for blocks in flight (before admission)
  const AccessPolicy* policy_ = nullptr;
  const PeerListener* peers_ = nullptr;
  std::function<void(bool)> on_serving_;
  std::atomic<bool> final_drain_{false};
  std::atomic<bool> handing_off_{false};
  absl::Mutex steps_mu_;
  absl::flat_hash_map<WorkerId, std::shared_ptr<StepLog>> steps_ ABSL_GUARDED_BY(steps_mu_);
};

}  // namespace kvd
