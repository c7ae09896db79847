// KvdService's streaming RPCs: Attach (a worker's lifetime), WatchEvents and WatchPressure.
//
// Reactors delete themselves in OnDone. Listeners registered with KvCache may still run briefly
// after RemoveListener returns (delivery happens outside the cache lock), so they reach their
// reactor only through a shared Link that OnDone severs under its mutex.
#include <memory>
#include <optional>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "proto/convert.h"
#include "proto/grpc_status.h"
#include "proto/vocab/status_macros.h"
#include "server/obs/log_safe.h"
#include "server/rpc/kvd_service.h"
#include "spdlog/spdlog.h"

namespace kvd {
namespace {

class AttachReactor final : public grpc::ServerBidiReactor<v1::AttachRequest, v1::AttachResponse> {
 public:
  // `ctx` is gRPC's and outlives the reactor's OnDone.
  AttachReactor(KvdService* service, KvdService::Caller caller, grpc::CallbackServerContext* ctx)
      : service_(service), caller_(std::move(caller)), ctx_(ctx) {
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    if (!ok) {  // the worker closed the stream or died
      FinishLocked(grpc::Status::OK);
      return;
    }
    if (worker_.empty()) {
      if (!request_.has_hello()) {
        FinishLocked(ToGrpcStatus(absl::InvalidArgumentError("the first Attach message must be hello")));
        return;
      }
      if (service_->draining()) {
        FinishLocked(ToGrpcStatus(absl::UnavailableError("kvd is draining: no new workers")));
        return;
      }
      const v1::Hello& hello = request_.hello();
      if (hello.cuda_event_handle().size() > 64) {
        FinishLocked(ToGrpcStatus(absl::InvalidArgumentError("cuda_event_handle is longer than 64 bytes")));
        return;
      }
      if (absl::Status bad = CheckWorkerName(hello.worker_name()); !bad.ok()) {
        FinishLocked(ToGrpcStatus(bad));
        return;
      }
      if (absl::Status bad = CheckExpectations(hello, service_->cache()->pools()); !bad.ok()) {
        spdlog::warn("worker '{}' refused: {}", LogSafe(hello.worker_name()), LogSafe(bad.message()));
        FinishLocked(ToGrpcStatus(bad));
        return;
      }
      // The kernel's word for the pid when kvd has it: a worker cannot claim another process.
      pid_t pid = hello.pid();
      if (caller_.creds.has_value()) {
        if (pid != 0 && pid != caller_.creds->pid) {
          spdlog::warn("worker '{}' says it is pid {}, the kernel says pid {}: using the kernel's",
                       LogSafe(hello.worker_name()), hello.pid(), caller_.creds->pid);
        }
        pid = caller_.creds->pid;
      }
      auto attached = service_->workers()->Register(hello.worker_name(), pid, caller_.key,
                                                    hello.cuda_event_handle());
      worker_ = attached.id;
      // Fences are lifted by a pid's re-attach or death only on the kernel's word: a pid a worker
      // over TCP names may be anyone's here (its fences go by time).
      pid_ = caller_.creds.has_value() && pid > 0 ? static_cast<uint32_t>(pid) : 0;
      v1::Attached* a = response_.mutable_attached();
      a->set_worker_id(attached.id.value());
      a->set_side_socket(service_->side_socket());
      a->set_slab_token(attached.slab_token);
      a->set_lease_ttl_ms(absl::ToInt64Milliseconds(service_->lease_ttl()));
      a->set_backend(service_->arena()->backend());
      spdlog::info("worker {} attached (name '{}', pid {})", worker_.value(), LogSafe(hello.worker_name()),
                   pid);
      // An attachment its own process says writes nothing more gets back what kvd fenced for it,
      // on the kernel's word for the pid only (docs/security.md, "Leases and fencing").
      if (hello.quiesced() && !hello.previous_worker_id().empty() && caller_.creds.has_value() && pid > 0) {
        service_->LiftFences(WorkerId(hello.previous_worker_id()), static_cast<uint32_t>(pid));
      }
      writing_ = true;
      StartWrite(&response_);
    } else if (absl::Status renewed = service_->workers()->Renew(worker_); !renewed.ok()) {
      FinishLocked(ToGrpcStatus(renewed));
      return;
    } else if (request_.has_heartbeat() && request_.heartbeat().seq() > 0 && !writing_) {
      // The worker's proof that its lease ran from no earlier than this heartbeat's sending. A
      // beat that finds a write in flight goes unanswered; the next one is.
      response_.Clear();
      response_.mutable_heartbeat_ack()->set_seq(request_.heartbeat().seq());
      writing_ = true;
      StartWrite(&response_);
    }
    StartRead(&request_);
  }

  void OnWriteDone(bool) override {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    if (pending_finish_) Finish(*pending_finish_);
  }

  void OnDone() override {
    // A worker that ended its stream (half-close) is done with its blocks. A stream that broke
    // (the connection dropped, or the client cancelled it when acks were late) may leave writes in
    // flight: the worker quiesces only once it notices, so what it held stays fenced.
    if (!worker_.empty()) {
      if (ctx_->IsCancelled()) {
        service_->WorkerLost(worker_, pid_);
      } else {
        service_->WorkerGone(worker_, "attach stream ended");
      }
    }
    delete this;
  }

 private:
  // Finish waits for an outstanding write to complete first.
  void FinishLocked(grpc::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_) return;
    finished_ = true;
    if (writing_) {
      pending_finish_ = std::move(status);
    } else {
      Finish(std::move(status));
    }
  }

  // Names are for people reading logs and kvdctl: bounded, printable.
  static absl::Status CheckWorkerName(const std::string& name) {
    constexpr size_t kMaxNameBytes = 256;
    if (name.size() > kMaxNameBytes) {
      return absl::InvalidArgumentError(absl::StrCat("worker_name is ", name.size(), " bytes; at most ",
                                                     kMaxNameBytes, " are allowed"));
    }
    for (unsigned char c : name) {
      if (c < 0x20 || c == 0x7f) {
        return absl::InvalidArgumentError("worker_name contains a control character");
      }
    }
    return absl::OkStatus();
  }

  // Each pool the worker expects exists and has the format, block size and layout it assumes.
  static absl::Status CheckExpectations(const v1::Hello& hello, const std::vector<PoolGeometry>& pools) {
    constexpr int kMaxExpectations = 64;
    if (hello.expect_pools_size() > kMaxExpectations) {
      return absl::InvalidArgumentError(absl::StrCat("expect_pools has ", hello.expect_pools_size(),
                                                     " entries; at most ", kMaxExpectations, " are allowed"));
    }
    for (const v1::PoolExpectation& e : hello.expect_pools()) {
      if (e.pool().empty()) return absl::InvalidArgumentError("expect_pools[].pool is required");
      const PoolGeometry* g = nullptr;
      for (const PoolGeometry& p : pools) {
        if (p.name == e.pool()) g = &p;
      }
      if (g == nullptr) return absl::NotFoundError(absl::StrCat("expected pool '", e.pool(), "' does not exist"));
      KVD_RETURN_IF_ERROR(CheckKvFormat(
          g->name, g->kv, KvFormat{e.dtype().substr(0, 64), e.kv_heads(), e.head_dim(), e.kv_arrangement().substr(0, 64)}));
      if (e.block_tokens() != 0 && e.block_tokens() != g->block_tokens) {
        return absl::FailedPreconditionError(absl::StrCat("pool '", g->name, "' holds block_tokens ",
                                                          g->block_tokens, ", the worker expects ", e.block_tokens()));
      }
      KVD_RETURN_IF_ERROR(CheckExpectedModel(*g, e.model_fingerprint()));
      if (e.groups_size() > kMaxKvGroups) {
        return absl::InvalidArgumentError(absl::StrCat("expect_pools[] for pool '", g->name, "' declares ",
                                                       e.groups_size(), " groups; at most ", kMaxKvGroups));
      }
      std::vector<KvGroup> groups;
      for (const v1::GroupInfo& k : e.groups()) {
        KvGroupKind kind;
        if (!ParseKvGroupKind(k.kind(), &kind)) {
          return absl::InvalidArgumentError(absl::StrCat("expect_pools[] for pool '", g->name, "': group kind '",
                                                         k.kind().substr(0, 64), "' is not full, sliding_window, chunked_local or state"));
        }
        groups.push_back(GroupFromProto(k));
      }
      KVD_RETURN_IF_ERROR(CheckExpectedGroups(*g, groups));
      if (!e.layout().empty() && e.layout() != PoolLayoutName(g->layout)) {
        return absl::FailedPreconditionError(absl::StrCat("pool '", g->name, "' has layout ",
                                                          PoolLayoutName(g->layout), ", the worker expects ",
                                                          e.layout().substr(0, 64)));
      }
    }
    return absl::OkStatus();
  }

  // A worker that names the model it computes with is attached only to a pool holding that model's
  // KV. A pool without a fingerprint cannot say whose KV it holds, so it meets no such expectation.
  static absl::Status CheckExpectedModel(const PoolGeometry& g, const std::string& expected) {
    if (expected.empty() || expected == g.model_fingerprint) return absl::OkStatus();
    if (absl::Status s = CheckModelFingerprint(expected); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("expect_pools[] for pool '", g.name, "': ", s.message()));
    }
    return absl::FailedPreconditionError(absl::StrCat(
        "pool '", g.name, "' holds KV of model_fingerprint ",
        g.model_fingerprint.empty() ? "(none declared)" : absl::StrCat("'", g.model_fingerprint, "'"),
        ", the worker expects '", expected, "'"));
  }

  KvdService* const service_;
  const KvdService::Caller caller_;
  v1::AttachRequest request_;
  v1::AttachResponse response_;
  grpc::CallbackServerContext* const ctx_;
  WorkerId worker_;   // set once, on hello
  uint32_t pid_ = 0;  // the worker's, set with worker_: the kernel's word, 0 when kvd has none
  absl::Mutex mu_;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  std::optional<grpc::Status> pending_finish_ ABSL_GUARDED_BY(mu_);
};

// A reactor that writes one message at a time and is pumped whenever there may be more to
// write: at start, after each write, and from a KvCache listener.
template <typename Message>
class PumpedWriter : public grpc::ServerWriteReactor<Message> {
 public:
  // What a listener holds: the writer, until OnDone severs the link.
  struct Link {
    absl::Mutex mu;
    PumpedWriter* writer ABSL_GUARDED_BY(mu) = nullptr;
  };

  explicit PumpedWriter(KvCache* cache) : cache_(cache), link_(std::make_shared<Link>()) {
    absl::MutexLock lock(&link_->mu);
    link_->writer = this;
  }

  // Writes the next message unless one is in flight. REQUIRES: link()->mu held.
  void PumpLocked() {
    if (writing_ || finish_requested_) return;
    next_.Clear();
    if (!NextLocked(&next_)) return;
    writing_ = true;
    this->StartWrite(&next_);
  }

  void OnWriteDone(bool ok) override {
    absl::MutexLock lock(&link_->mu);
    writing_ = false;
    if (finish_requested_) {
      this->Finish(pending_status_);
      return;
    }
    if (!ok) {
      RequestFinishLocked(grpc::Status::CANCELLED);
      return;
    }
    PumpLocked();
  }

  void OnCancel() override {
    absl::MutexLock lock(&link_->mu);
    RequestFinishLocked(grpc::Status::CANCELLED);
  }

  void OnDone() override {
    cache_->RemoveListener(listener_);
    {
      absl::MutexLock lock(&link_->mu);
      link_->writer = nullptr;
    }
    delete this;
  }

 protected:
  // Fills `next` with the next message; false when there is nothing to send now.
  virtual bool NextLocked(Message* next) = 0;

  std::weak_ptr<Link> weak_link() const { return link_; }
  // Records the KvCache listener to remove in OnDone, then sends what there is.
  void Begin(int listener) {
    listener_ = listener;
    absl::MutexLock lock(&link_->mu);
    PumpLocked();
  }

 private:
  void RequestFinishLocked(grpc::Status status) {
    if (finish_requested_) return;
    finish_requested_ = true;
    if (writing_) {
      pending_status_ = std::move(status);  // finished in OnWriteDone
    } else {
      this->Finish(std::move(status));
    }
  }

  KvCache* const cache_;
  std::shared_ptr<Link> link_;
  int listener_ = 0;
  // Guarded by link_->mu.
  Message next_;
  bool writing_ = false;
  bool finish_requested_ = false;
  grpc::Status pending_status_;
};

class EventsReactor final : public PumpedWriter<v1::EventBatch> {
 public:
  EventsReactor(KvCache* cache, uint64_t after_sequence)
      : PumpedWriter(cache), events_(cache->events()), last_(after_sequence) {
    std::weak_ptr<Link> weak = weak_link();
    Begin(cache->AddEventListener([weak](const CacheEvent&) {
      if (auto link = weak.lock()) {
        absl::MutexLock lock(&link->mu);
        if (link->writer != nullptr) link->writer->PumpLocked();
      }
    }));
  }

 private:
  bool NextLocked(v1::EventBatch* batch) override {
    constexpr size_t kMaxBatch = 512;
    EventLog::ReadResult r = events_.ReadAfter(last_, kMaxBatch);
    if (r.resync) {
      batch->set_resync(true);
      last_ = events_.last_sequence();
      return true;
    }
    if (r.events.empty()) return false;
    for (const CacheEvent& e : r.events) ToProto(e, batch->add_events());
    last_ = r.events.back().sequence;
    return true;
  }

  const EventLog& events_;
  uint64_t last_;  // guarded by the link's mutex
};

class PressureReactor final : public PumpedWriter<v1::PressureUpdate> {
 public:
  explicit PressureReactor(KvCache* cache) : PumpedWriter(cache) {
    const CacheReport r = cache->Report();
    level_ = r.pressure;
    available_ = r.available_fraction;
    std::weak_ptr<Link> weak = weak_link();
    Begin(cache->AddPressureListener([weak](PressureLevel level, double available) {
      if (auto link = weak.lock()) {
        absl::MutexLock lock(&link->mu);
        if (link->writer == nullptr) return;
        auto* self = static_cast<PressureReactor*>(link->writer);
        self->level_ = level;
        self->available_ = available;
        self->dirty_ = true;
        self->PumpLocked();
      }
    }));
  }

 private:
  bool NextLocked(v1::PressureUpdate* update) override {
    if (!dirty_) return false;
    dirty_ = false;
    update->set_level(PressureLevelName(level_));
    update->set_available_fraction(available_);
    return true;
  }

  // Guarded by the link's mutex; only the latest level matters.
  PressureLevel level_ = PressureLevel::kNormal;
  double available_ = 1.0;
  bool dirty_ = true;
};

}  // namespace

// Streams refused before they start (the allow-list): finish at once with `status`.
template <typename Base>
class Refused final : public Base {
 public:
  explicit Refused(const absl::Status& status) { this->Finish(ToGrpcStatus(status)); }
  void OnDone() override { delete this; }
};

grpc::ServerBidiReactor<v1::AttachRequest, v1::AttachResponse>* KvdService::Attach(
    grpc::CallbackServerContext* ctx) {
  absl::StatusOr<Caller> caller = Identify(ctx);
  if (!caller.ok()) {
    return new Refused<grpc::ServerBidiReactor<v1::AttachRequest, v1::AttachResponse>>(caller.status());
  }
  return new AttachReactor(this, *std::move(caller), ctx);
}

grpc::ServerWriteReactor<v1::EventBatch>* KvdService::WatchEvents(
    grpc::CallbackServerContext* ctx, const v1::WatchEventsRequest* req) {
  if (absl::Status s = Authorize(ctx, "WatchEvents"); !s.ok()) return new Refused<grpc::ServerWriteReactor<v1::EventBatch>>(s);
  return new EventsReactor(cache_, req->after_sequence());
}

grpc::ServerWriteReactor<v1::PressureUpdate>* KvdService::WatchPressure(
    grpc::CallbackServerContext* ctx, const v1::WatchPressureRequest*) {
  if (absl::Status s = Authorize(ctx, "WatchPressure"); !s.ok()) return new Refused<grpc::ServerWriteReactor<v1::PressureUpdate>>(s);
  return new PressureReactor(cache_);
}

}  // namespace kvd
