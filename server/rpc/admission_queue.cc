#include "server/rpc/admission_queue.h"

#include <pthread.h>

#include <utility>

#include "absl/strings/str_cat.h"

namespace kvd {

AdmissionQueue::AdmissionQueue(KvCache* cache) : cache_(cache), thread_([this] { Run(); }) {}

AdmissionQueue::~AdmissionQueue() {
  Close();
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

void AdmissionQueue::Admit(RequestSpec spec, absl::Time deadline, std::function<bool()> cancelled, Done done) {
  absl::StatusOr<AdmitResult> now;
  {
    absl::MutexLock lock(&mu_);
    if (!closed_.ok()) {
      now = closed_;
    } else {
      auto queue = queues_.find(spec.ns.pool);  // only pools someone waits for have one
      const bool others = queue != queues_.end() && !queue->second.empty();
      if (!others) now = cache_->Admit(spec);
      if (others || (now.ok() && now->decision == AdmitDecision::kWait)) {
        int64_t& mine = waiting_by_worker_[spec.limit_key()];
        if (mine >= kMaxWaitersPerWorker) {
          now = absl::ResourceExhaustedError(absl::StrCat("worker ", spec.limit_key().value(), " already has ", mine,
                                                          " Starts waiting for admission; at most ",
                                                          kMaxWaitersPerWorker, " may wait at once"));
        } else {
          ++mine;
          queues_[spec.ns.pool].push_back(
              Waiter{std::move(spec), absl::Now(), deadline, std::move(cancelled), std::move(done)});
          ++waiting_;
          return;
        }
      }
    }
  }
  done(std::move(now), absl::ZeroDuration());
}

void AdmissionQueue::Poke() {
  absl::MutexLock lock(&mu_);
  poked_ = true;
}

void AdmissionQueue::Reopen() {
  absl::MutexLock lock(&mu_);
  closed_ = absl::OkStatus();
}

void AdmissionQueue::Close(absl::Status why) {
  std::vector<Waiter> ended;
  absl::Status closed;
  {
    absl::MutexLock lock(&mu_);
    if (closed_.ok()) closed_ = why.ok() ? absl::UnavailableError("kvd is draining") : why;
    closed = closed_;
    for (auto& [pool, queue] : queues_) {
      for (Waiter& w : queue) ended.push_back(std::move(w));
      queue.clear();
    }
    waiting_ = 0;
    waiting_by_worker_.clear();
  }
  const absl::Time now = absl::Now();
  for (Waiter& w : ended) w.done(closed, now - w.queued_at);
}

int64_t AdmissionQueue::waiting() const {
  absl::MutexLock lock(&mu_);
  return waiting_;
}

void AdmissionQueue::SweepLocked(absl::Time now, std::vector<Answer>* out) {
  for (auto& [pool, queue] : queues_) {
    // Expired or abandoned waits leave from anywhere in the queue; only the head may be admitted.
    for (auto it = queue.begin(); it != queue.end();) {
      if (now >= it->deadline) {
        const absl::Duration waited = now - it->queued_at;
        out->emplace_back(std::move(*it), absl::ResourceExhaustedError(absl::StrCat(
                                              "not admitted within ", absl::FormatDuration(waited),
                                              ": the KV budget stayed full (", queue.size() - 1,
                                              " others waiting for pool '", pool, "')")));
        it = queue.erase(it);
      } else if (it->cancelled && it->cancelled()) {
        out->emplace_back(std::move(*it), absl::CancelledError("the caller gave up waiting"));
        it = queue.erase(it);
      } else {
        ++it;
      }
    }
    while (!queue.empty()) {
      absl::StatusOr<AdmitResult> r = cache_->Admit(queue.front().spec);
      if (r.ok() && r->decision == AdmitDecision::kWait) break;  // first come, first served
      out->emplace_back(std::move(queue.front()), std::move(r));
      queue.pop_front();
    }
  }
  for (auto it = queues_.begin(); it != queues_.end();) {
    if (it->second.empty()) {
      queues_.erase(it++);
    } else {
      ++it;
    }
  }
}

void AdmissionQueue::Run() {
  pthread_setname_np(pthread_self(), "kvd-admit");
  std::vector<Answer> answers;
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      if (waiting_ == 0) {
        mu_.Await(absl::Condition(this, &AdmissionQueue::HasWaiters));  // idle: no timer, pokes ignored
      } else {
        mu_.AwaitWithTimeout(absl::Condition(this, &AdmissionQueue::Woken), kRetryInterval);
      }
      if (stop_) return;
      poked_ = false;
      if (waiting_ > 0) SweepLocked(absl::Now(), &answers);
      waiting_ -= static_cast<int64_t>(answers.size());
      for (const auto& [w, r] : answers) {
        auto it = waiting_by_worker_.find(w.spec.limit_key());
        if (--it->second == 0) waiting_by_worker_.erase(it);
      }
    }
    const absl::Time now = absl::Now();
    for (auto& [w, r] : answers) w.done(std::move(r), now - w.queued_at);
    answers.clear();
  }
}

}  // namespace kvd
