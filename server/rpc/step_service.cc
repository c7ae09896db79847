// KvdService::Step: one scheduler step of one worker in one round trip (kvd.proto, "Step";
// docs/api.md, "Steps").
//
// A step runs in three parts: the items on running requests, in order, in one KvCache::Step (one
// acquisition of the cache lock); the starts, in order, each through the admission queue (FIFO
// per pool) and Acquire, which may finish on a promotion's thread; then the credit, with the
// first part when the step has no start, else in a second KvCache::Step once every start is done.
//
// Locking: StepLog::mu guards a worker's last seq and answer, the step being applied and the
// retries of it that wait for its answer, and its parked starts; ParkedStart::mu guards one
// start's answer from the admission queue and whether it was withdrawn (so that a withdrawal and
// an admission decide under one lock who gives the reservation back). Each is held only to read
// or write those fields: never while calling KvCache, the admission queue or gRPC, and never one
// inside the other.
#include <atomic>
#include <memory>

#include <google/protobuf/util/message_differencer.h>

#include "absl/strings/str_cat.h"
#include "proto/convert.h"
#include "proto/vocab/status_macros.h"
#include "server/rpc/ended_writers.h"
#include "server/rpc/kvd_service.h"
#include "server/rpc/kvd_service_unary.h"

namespace kvd {

struct KvdService::ParkedStart {
  absl::Mutex mu;
  bool answered ABSL_GUARDED_BY(mu) = false;
  absl::StatusOr<AdmitResult> result ABSL_GUARDED_BY(mu);
  bool withdrawn ABSL_GUARDED_BY(mu) = false;  // ended in a step, or its worker is gone
  std::atomic<bool> cancelled{false};          // `withdrawn`, as the admission queue reads it
  v1::StartRequest start;  // as first sent, without its ids and waits: a resend must match it
  // Its wait for blocks in flight, before admission or after a deferred acquire
  // (StartRequest.wait_for_in_flight_ms): what it found, and how the wait ended (0 while it
  // waits, or when it did not).
  v1::InFlight in_flight ABSL_GUARDED_BY(mu);
  int in_flight_wait ABSL_GUARDED_BY(mu) = 0;
  // Set once at the first send, read-only after: what admission and a wait need.
  RequestSpec spec;
  std::string key;  // the caller
  absl::Time deadline;
  int64_t wait_ms = 0;
  // Its acquire may still defer to blocks in flight (it asked to wait and has not waited). Read
  // and written only by the worker's steps, which run one at a time.
  bool may_defer = false;
};

struct KvdService::StepLog {
  // A retry of the step being applied: answered with its answer once it is done.
  struct Waiter {
    v1::StepResponse* resp;
    StepDone done;
  };
  absl::Mutex mu;
  uint64_t last_seq ABSL_GUARDED_BY(mu) = 0;
  bool busy ABSL_GUARDED_BY(mu) = false;
  uint64_t busy_seq ABSL_GUARDED_BY(mu) = 0;  // the step being applied when busy
  std::vector<Waiter> waiters ABSL_GUARDED_BY(mu);
  v1::StepResponse last ABSL_GUARDED_BY(mu);
  absl::flat_hash_map<std::string, std::shared_ptr<ParkedStart>> parked ABSL_GUARDED_BY(mu);
  bool forgotten ABSL_GUARDED_BY(mu) = false;  // its worker is gone (ForgetSteps): nothing parks here
};

// A start leaves the admission queue and any wait for blocks in flight (both poll `cancelled`);
// one admitted meanwhile gives its reservation back (the admission callback decides under mu).
void KvdService::Withdraw(ParkedStart& park) {
  absl::MutexLock lock(&park.mu);
  park.withdrawn = true;
  park.cancelled = true;
}

// Parks `park` under `id` until a later step sends it again; withdrawn instead when the worker's
// steps were forgotten (its worker gone) while it was being answered, maybe on another thread.
void KvdService::Park(StepLog& log, const std::string& id, const std::shared_ptr<ParkedStart>& park) {
  {
    absl::MutexLock lock(&log.mu);
    if (!log.forgotten) {
      log.parked[id] = park;
      return;
    }
  }
  Withdraw(*park);
}

namespace {

void SetStatus(const absl::Status& s, v1::StepResult* r) {
  r->set_code(static_cast<int32_t>(s.code()));
  r->set_message(std::string(s.message()));
}

// A start as compared between sends: what it asks for, not the ids the step carries or its wait.
v1::StartRequest Comparable(const v1::StartRequest& sr) {
  v1::StartRequest c = sr;
  c.mutable_admit()->clear_worker_id();
  c.mutable_admit()->clear_request_id();
  c.clear_max_wait_ms();
  c.clear_wait_for_in_flight_ms();
  return c;
}

// The item as the cache applies it. REQUIRES: a running-request op (not start, not empty).
StepOp OpFromProto(const v1::StepItem& item) {
  StepOp op;
  op.id = RequestId(item.request_id());
  switch (item.op_case()) {
    case v1::StepItem::kGrow:
      op.kind = StepOpKind::kGrow;
      op.tokens = item.grow().tokens();
      op.credit_blocks.assign(item.grow().credit_blocks().begin(), item.grow().credit_blocks().end());
      for (const v1::CreditEntry& e : item.grow().credit()) {  // a hybrid pool's {group, block} entries
        op.credit_blocks.push_back(e.block());
        op.credit_groups.push_back(e.group());
      }
      if (!op.credit_groups.empty() && item.grow().credit_blocks_size() > 0) {
        op.credit_groups.push_back(-1);  // both named: KvCache refuses the mismatch, naming credit_blocks
      }
      op.computed_tokens = item.grow().computed_tokens();
      break;
    case v1::StepItem::kPublish:
      op.kind = StepOpKind::kPublish;
      op.token_ids = TokensFromProto(item.publish().tokens());
      op.num_blocks = item.publish().num_blocks();
      op.state_checkpoints = FromProto(item.publish().state_checkpoints());
      break;
    case v1::StepItem::kCheckpoint:
      op.kind = StepOpKind::kCheckpoint;
      op.token_ids = TokensFromProto(item.checkpoint().tokens());
      op.engine_state = item.checkpoint().engine_state();
      op.state_checkpoints = FromProto(item.checkpoint().state_checkpoints());
      break;
    case v1::StepItem::kEnd:
      op.kind = StepOpKind::kEnd;
      op.num_blocks = item.end().publish_blocks();
      op.token_ids = TokensFromProto(item.end().more_tokens());
      op.completed = item.end().completed();
      op.state_checkpoints = FromProto(item.end().state_checkpoints());
      break;
    case v1::StepItem::kPreempt:
      op.kind = StepOpKind::kPreempt;
      op.token_ids = TokensFromProto(item.preempt().tokens());
      op.engine_state = item.preempt().engine_state();
      op.state_checkpoints = FromProto(item.preempt().state_checkpoints());
      break;
    default:
      break;
  }
  return op;
}

void ResultToProto(const StepOpResult& r, v1::StepResult* p) {
  SetStatus(r.status, p);
  p->mutable_blocks()->Add(r.blocks.begin(), r.blocks.end());
  for (const GroupTable& t : r.group_tables) ToProto(t, p->add_group_tables());
  for (PublishOutcome o : r.publish.outcomes) {
    switch (o) {
      case PublishOutcome::kKept: p->set_kept(p->kept() + 1); break;
      case PublishOutcome::kAlreadyCached: p->set_already_cached(p->already_cached() + 1); break;
      case PublishOutcome::kDuplicate: p->set_duplicates(p->duplicates() + 1); break;
      case PublishOutcome::kNoParent: p->set_no_parent(p->no_parent() + 1); break;
    }
  }
  for (CheckpointOutcome o : r.publish.checkpoint_outcomes) {
    p->add_checkpoint_outcomes(static_cast<v1::CheckpointOutcome>(o));
  }
  p->mutable_fresh_slots()->Add(r.publish.fresh_slots.begin(), r.publish.fresh_slots.end());
}

}  // namespace

std::shared_ptr<KvdService::StepLog> KvdService::StepLogOf(const WorkerId& worker) {
  absl::MutexLock lock(&steps_mu_);
  std::shared_ptr<StepLog>& log = steps_[worker];
  if (log == nullptr) log = std::make_shared<StepLog>();
  return log;
}

void KvdService::ForgetSteps(const WorkerId& worker) {
  std::shared_ptr<StepLog> log;
  {
    absl::MutexLock lock(&steps_mu_);
    auto it = steps_.find(worker);
    if (it == steps_.end()) return;
    log = std::move(it->second);
    steps_.erase(it);
  }
  absl::flat_hash_map<std::string, std::shared_ptr<ParkedStart>> parked;
  {
    absl::MutexLock lock(&log->mu);
    parked = std::exchange(log->parked, {});
    log->forgotten = true;
  }
  for (auto& [id, park] : parked) Withdraw(*park);  // the queue drops them; one admitted meanwhile goes back
}

absl::Status KvdService::CheckStep(const v1::StepRequest& req) const {
  if (req.seq() == 0) return absl::InvalidArgumentError("step seq must be > 0");
  if (req.items_size() > kMaxStepItems) {
    return absl::InvalidArgumentError(
        absl::StrCat("step has ", req.items_size(), " items; at most ", kMaxStepItems));
  }
  absl::flat_hash_map<std::pair<std::string, int>, int> seen;
  for (int i = 0; i < req.credit_size(); ++i) {
    const v1::CreditWant& c = req.credit(i);
    KVD_ASSIGN_OR_RETURN(const PoolId pool, cache_->FindPool(c.pool()));
    // Credit is per (pool, group) on a hybrid pool; a pool without groups is group 0.
    const int num_groups = std::max<int>(1, static_cast<int>(cache_->pools()[pool].groups.size()));
    if (c.group() < 0 || c.group() >= num_groups) {
      return absl::InvalidArgumentError(absl::StrCat("credit for pool '", c.pool(), "' names group ", c.group(),
                                                     "; the pool has ", num_groups));
    }
    if (c.returned_size() > cache_->pools()[pool].capacity_blocks) {
      return absl::InvalidArgumentError(absl::StrCat("credit for pool '", c.pool(), "' returns ", c.returned_size(),
                                                     " blocks, more than the pool has"));
    }
    if (c.blocks() < 0) {
      return absl::InvalidArgumentError(absl::StrCat("credit for pool '", c.pool(), "' asks for ", c.blocks(), " blocks"));
    }
    if (!seen.emplace(std::make_pair(c.pool(), c.group()), i).second) {
      return absl::InvalidArgumentError(num_groups > 1 ? absl::StrCat("credit names group ", c.group(), " of pool '",
                                                                      c.pool(), "' twice")
                                                       : absl::StrCat("credit names pool '", c.pool(), "' twice"));
    }
  }
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* KvdService::Step(grpc::CallbackServerContext* ctx, const v1::StepRequest* req,
                                           v1::StepResponse* resp) {
  const auto start = std::chrono::steady_clock::now();
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  absl::StatusOr<Caller> caller = [&]() -> absl::StatusOr<Caller> {
    KVD_RETURN_IF_ERROR(Authorize(ctx, "Step"));
    return Identify(ctx);
  }();
  RunStep(std::move(caller), *req, resp,
          [this, reactor, start](const absl::Status& s) { FinishRpc(reactor, "Step", start, s); });
  return reactor;
}

void KvdService::RunStep(absl::StatusOr<Caller> who, const v1::StepRequest& req, v1::StepResponse* resp,
                         StepDone done) {
  absl::StatusOr<Caller> caller = [&]() -> absl::StatusOr<Caller> {
    KVD_RETURN_IF_ERROR(who.status());
    absl::Status checked = CheckStep(req);
    if (absl::IsNotFound(checked)) return absl::InvalidArgumentError(checked.message());
    KVD_RETURN_IF_ERROR(checked);
    KVD_RETURN_IF_ERROR(CheckWorker(*who, req.worker_id()));
    return std::move(who);
  }();
  if (!caller.ok()) {
    done(caller.status());
    return;
  }
  const WorkerId worker(req.worker_id());
  const WorkerId principal(caller->key);
  std::shared_ptr<StepLog> log = StepLogOf(worker);
  {
    absl::MutexLock lock(&log->mu);
    absl::Status refused;
    if (log->busy && req.seq() == log->busy_seq) {
      // A retry of the step being applied (its first attempt's connection broke, or timed out):
      // it gets that step's answer once it is done, never a refusal of a step kvd then applies.
      log->waiters.push_back(StepLog::Waiter{resp, std::move(done)});
      return;
    } else if (log->busy) {
      refused = absl::FailedPreconditionError(absl::StrCat(
          "step ", req.seq(), " arrived while step ", log->busy_seq, " of worker ", worker.value(),
          " is being applied"));
    } else if (req.seq() == log->last_seq) {
      *resp = log->last;
      resp->set_replayed(true);
    } else if (req.seq() < log->last_seq) {
      refused = absl::InvalidArgumentError(
          absl::StrCat("step seq ", req.seq(), " goes backwards: the last applied step is ", log->last_seq));
    } else {
      log->busy = true;
      log->busy_seq = req.seq();
    }
    if (!refused.ok() || resp->replayed()) {
      done(refused);
      return;
    }
  }

  // What is refused per item before anything is applied; the running-request ops; the starts.
  resp->set_seq(req.seq());
  for (int i = 0; i < req.items_size(); ++i) resp->add_results();
  absl::flat_hash_map<absl::string_view, int> first;
  std::vector<StepOp> ops;
  std::vector<int> op_items;
  std::vector<int> starts;
  bool frees = false;  // an end or preempt may let a waiting start in
  for (int i = 0; i < req.items_size(); ++i) {
    const v1::StepItem& item = req.items(i);
    v1::StepResult* result = resp->mutable_results(i);
    if (item.request_id().empty()) {
      SetStatus(absl::InvalidArgumentError(absl::StrCat("item ", i, ": request_id is required")), result);
      continue;
    }
    if (item.op_case() == v1::StepItem::OP_NOT_SET) {
      SetStatus(absl::InvalidArgumentError(absl::StrCat("item ", i, ": no operation")), result);
      continue;
    }
    // A request has several items in a step (grown, then published), but a start is its only one.
    const bool is_start = item.op_case() == v1::StepItem::kStart;
    if (auto [it, added] = first.emplace(item.request_id(), is_start ? i : -1 - i);
        !added && (is_start || it->second >= 0)) {
      SetStatus(absl::InvalidArgumentError(absl::StrCat(
                    "item ", i, ": request '", LogSafe(item.request_id(), 256), "' appears already in item ",
                    it->second >= 0 ? it->second : -1 - it->second, " (a start must be its request's only item)")),
                result);
      continue;
    }
    if (item.op_case() == v1::StepItem::kStart) {
      starts.push_back(i);
      continue;
    }
    const bool ending = item.op_case() == v1::StepItem::kEnd || item.op_case() == v1::StepItem::kPreempt;
    frees |= ending;
    if (ending) {  // a start still parked in the queue is withdrawn; an admitted one ends below
      std::shared_ptr<ParkedStart> park;
      {
        absl::MutexLock lock(&log->mu);
        if (auto p = log->parked.find(item.request_id()); p != log->parked.end()) {
          park = std::move(p->second);
          log->parked.erase(p);
        }
      }
      if (park != nullptr) {
        // Decided under park->mu, as the admission callback decides: either it sees the start
        // withdrawn and gives its reservation back, or it answered first and the request is
        // ended here like any admitted one.
        absl::MutexLock lock(&park->mu);
        park->withdrawn = true;
        park->cancelled = true;
        if (!park->answered || !park->result.ok()) continue;  // nothing was admitted: OK
      }
    }
    ops.push_back(OpFromProto(item));
    op_items.push_back(i);
  }
  // While starts wait for room, credit does not grow and what is held is asked back: it is
  // budget no request holds, and the room they wait for.
  const bool starts_waiting = admission_->waiting() > 0;
  std::vector<CreditWant> wants;
  for (const v1::CreditWant& c : req.credit()) {
    const PoolId pool = *cache_->FindPool(c.pool());
    wants.push_back(CreditWant{pool, starts_waiting ? 0 : c.blocks(),
                               std::vector<BlockIndex>(c.returned().begin(), c.returned().end()), c.group()});
  }
  const bool credit_now = starts.empty();
  auto held = std::make_shared<std::vector<CreditHeld>>();
  if (!ops.empty() || credit_now) {
    std::vector<StepOpResult> results = cache_->Step(worker, principal, std::move(ops),
                                                     credit_now ? absl::MakeConstSpan(wants) : absl::Span<const CreditWant>(),
                                                     held.get());
    for (size_t k = 0; k < results.size(); ++k) ResultToProto(results[k], resp->mutable_results(op_items[k]));
    if (frees) admission_->Poke();
  }
  auto finish = [this, done = std::move(done), resp, log, worker, principal, key = caller->key, wants = std::move(wants),
                 credit_now, held]() {
    if (!credit_now) {
      // After the starts, which may have waited past the worker's detach: what is granted to a
      // worker that is gone goes back (its detach released what it held before this grant, or
      // sees this grant: it removes the worker before it releases).
      if (workers_->Check(worker, key).ok()) cache_->Step(worker, principal, {}, wants, held.get());
      if (!workers_->Check(worker, key).ok()) {
        held->clear();
        (void)cache_->ReleaseWorker(worker);
        admission_->Poke();
      }
    }
    for (const CreditHeld& c : *held) {
      v1::StepCredit* out = resp->add_credit();
      out->set_pool(cache_->pools()[c.pool].name);
      out->set_pool_id(c.pool);
      out->mutable_blocks()->Add(c.blocks.begin(), c.blocks.end());
      out->set_wanted(c.wanted);
      out->set_group(c.group);  // 0 (not on the wire) on a pool without groups
    }
    std::vector<StepLog::Waiter> waiters;
    {
      absl::MutexLock lock(&log->mu);
      log->last = *resp;
      log->last_seq = resp->seq();
      log->busy = false;
      waiters = std::exchange(log->waiters, {});
    }
    for (const StepLog::Waiter& w : waiters) {
      *w.resp = *resp;
      w.resp->set_replayed(true);
      w.done(absl::OkStatus());
    }
    done(absl::OkStatus());
  };
  if (starts.empty()) {
    finish();
    return;
  }
  auto pending = std::make_shared<std::atomic<int>>(static_cast<int>(starts.size()) + 1);
  auto one_done = [pending, finish = std::move(finish)]() {
    if (pending->fetch_sub(1) == 1) finish();
  };
  for (int i : starts) StartStepItem(log, worker, *caller, req.items(i), resp->mutable_results(i), one_done);
  one_done();
}

void KvdService::StartStepItem(const std::shared_ptr<StepLog>& log, const WorkerId& worker, const Caller& caller,
                               const v1::StepItem& item, v1::StepResult* result, std::function<void()> done) {
  const RequestId id(item.request_id());
  auto fail = [&](const absl::Status& s) {
    SetStatus(s, result);
    done();
  };
  if (draining()) return fail(absl::UnavailableError("kvd is draining: no new work is admitted"));
  const v1::StartRequest& sr = item.start();
  if (sr.max_wait_ms() < 0 || sr.max_wait_ms() > absl::ToInt64Milliseconds(kMaxStartWait)) {
    return fail(absl::InvalidArgumentError(absl::StrCat("max_wait_ms must be between 0 and ",
                                                        absl::ToInt64Milliseconds(kMaxStartWait), ", not ",
                                                        sr.max_wait_ms())));
  }
  if (absl::Status peer = CheckPeer(sr.peer()); !peer.ok()) return fail(peer);
  if (absl::Status w = CheckInflightWait(sr.wait_for_in_flight_ms()); !w.ok()) return fail(w);
  std::shared_ptr<ParkedStart> park;
  {
    absl::MutexLock lock(&log->mu);
    if (auto p = log->parked.find(item.request_id()); p != log->parked.end()) park = p->second;
  }
  if (park != nullptr && !google::protobuf::util::MessageDifferencer::Equals(park->start, Comparable(sr))) {
    // Sent again with another spec: it keeps its place with the first (refused, not swapped:
    // what it asked for decided its place in the queue and its reservation).
    return fail(absl::FailedPreconditionError(absl::StrCat(
        "request '", LogSafe(item.request_id(), 256),
        "' is waiting with another start; end it in a step to withdraw it, then start it anew")));
  }
  if (park == nullptr) {
    park = std::make_shared<ParkedStart>();
    park->start = Comparable(sr);
    park->spec = SpecFromProto(sr.admit());
    park->spec.id = id;
    park->spec.owner = worker;
    park->spec.principal = WorkerId(caller.key);
    park->key = caller.key;
    park->deadline = absl::Now() + (sr.max_wait_ms() > 0 ? absl::Milliseconds(sr.max_wait_ms()) : kDefaultStartWait);
    park->wait_ms = sr.wait_for_in_flight_ms();
    park->may_defer = park->wait_ms > 0 && park->spec.resume_from.empty();
    // A resume takes its checkpoint's tail block once no writer may still write it (ended_writers.h).
    if (!park->spec.resume_from.empty()) LiftFencesOfEndedWriters(*cache_);
    // Blocks in flight first: the start waits holding nothing (parked, answered `waiting` with
    // what it waits for), then queues for admission.
    if (std::optional<InFlightInfo> found = InFlightToWait(park->spec, park->wait_ms)) {
      ParkWait(park, std::move(*found));
    } else {
      ParkAdmit(park);
    }
  }
  absl::StatusOr<AdmitResult> admitted;
  bool answered = false;
  {
    absl::MutexLock lock(&park->mu);
    answered = park->answered;
    if (answered) admitted = park->result;
    if (!answered && park->in_flight_wait == 0 && park->in_flight.blocks() > 0) {
      *result->mutable_in_flight() = park->in_flight;  // what it waits for
    }
    result->set_in_flight_wait(static_cast<v1::InFlightWait>(park->in_flight_wait));
  }
  if (!answered) {
    // Not answered yet: it keeps its place (in the queue, or its wait for blocks in flight)
    // until a later step sends it again.
    Park(*log, item.request_id(), park);
    result->set_waiting(true);
    return done();
  }
  {
    absl::MutexLock lock(&log->mu);
    log->parked.erase(item.request_id());
  }
  if (!admitted.ok()) return fail(admitted.status());
  auto finish = std::make_shared<std::function<void()>>(std::move(done));
  std::function<void(InFlightInfo)> defer;
  if (park->may_defer) {
    defer = [this, log, park, id, result, finish](InFlightInfo found) {
      // Another start of this prefix acquired first: the reservation goes back (a waiter holds
      // nothing), and it parks again, waiting as if it had found them before admission; a later
      // step sends it again.
      (void)cache_->Release(id, /*completed=*/false);
      admission_->Poke();
      {
        absl::MutexLock lock(&park->mu);
        park->answered = false;
      }
      Park(*log, id.value(), park);
      ParkWait(park, std::move(found));
      {
        absl::MutexLock lock(&park->mu);
        if (!park->answered && park->in_flight_wait == 0) *result->mutable_in_flight() = park->in_flight;
        result->set_in_flight_wait(static_cast<v1::InFlightWait>(park->in_flight_wait));
      }
      result->set_waiting(true);
      (*finish)();
    };
  }
  AcquireThen(
      id, result->mutable_acquired(),
      [this, id, result, finish](absl::Status s) {
        if (!s.ok()) {  // admitted but not acquired: the reservation goes back
          (void)cache_->Release(id, /*completed=*/false);
          admission_->Poke();
          SetStatus(s, result);
        }
        (*finish)();
      },
      sr.peer(), std::move(defer));
}

void KvdService::ParkAdmit(std::shared_ptr<ParkedStart> park) {
  admission_->Admit(
      park->spec, park->deadline, [park] { return park->cancelled.load(); },
      [this, park](absl::StatusOr<AdmitResult> admitted, absl::Duration) {
        const RequestId& id = park->spec.id;
        // Admitted after it was withdrawn or its worker went: the reservation goes back. Decided
        // under park->mu, where a withdrawal marks it: exactly one of the two gives it back.
        const bool worker_gone = !workers_->Check(park->spec.owner, park->key).ok();
        bool give_back = false;
        {
          absl::MutexLock lock(&park->mu);
          if (admitted.ok() && (park->withdrawn || worker_gone)) {
            give_back = true;
            admitted = absl::FailedPreconditionError(
                absl::StrCat("request '", id.value(), "' was withdrawn or its worker detached while it waited"));
          }
          park->answered = true;
          park->result = std::move(admitted);
        }
        if (give_back) {
          (void)cache_->Release(id, /*completed=*/false);
          admission_->Poke();
        }
      });
}

void KvdService::ParkWait(std::shared_ptr<ParkedStart> park, InFlightInfo found) {
  park->may_defer = false;  // waited once: its acquire computes what it then finds in flight
  {
    absl::MutexLock lock(&park->mu);
    ToProto(found, &park->in_flight);
    park->in_flight_wait = 0;
  }
  WaitFor(
      park->spec, park->key, std::move(found), park->wait_ms, park->deadline,
      [park]() -> absl::Status {
        return park->cancelled.load() ? absl::CancelledError("withdrawn in a step") : absl::OkStatus();
      },
      [this, park](absl::StatusOr<InflightWaits::Outcome> outcome, absl::Duration) {
        {
          absl::MutexLock lock(&park->mu);
          if (!outcome.ok()) {
            park->answered = true;
            park->result = outcome.status();
            return;
          }
          park->in_flight_wait = static_cast<int>(*outcome);
        }
        ParkAdmit(park);
      });
}

}  // namespace kvd
