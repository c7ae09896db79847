#include "server/rpc/inflight_waits.h"

#include <pthread.h>

#include <utility>

#include "absl/strings/str_cat.h"

namespace kvd {

InflightWaits::InflightWaits(KvCache* cache) : cache_(cache), thread_([this] { Run(); }) {}

InflightWaits::~InflightWaits() {
  Close();
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

void InflightWaits::Wait(const WorkerId& limit_key, InFlightInfo what, Namespace ns, std::vector<Token> prompt,
                         absl::Time deadline, std::function<absl::Status()> cancelled, Done done) {
  absl::StatusOr<Outcome> now;
  {
    absl::MutexLock lock(&mu_);
    const absl::Time t = absl::Now();
    deadline = std::min(deadline, t + kMaxWait);
    int64_t& mine = waiting_by_worker_[limit_key];
    if (!closed_.ok()) {
      now = closed_;
    } else if (mine >= kMaxWaitersPerWorker || t >= deadline) {
      now = Outcome::kTimedOut;  // no room to wait (or no time): it computes them itself
    } else {
      ++mine;
      waiters_.push_back(Waiter{limit_key, std::move(what), std::move(ns), std::move(prompt), t, deadline,
                                std::move(cancelled), std::move(done)});
      poked_ = true;  // it may have been published between the probe and now
      return;
    }
    if (mine == 0) waiting_by_worker_.erase(limit_key);
  }
  done(std::move(now), absl::ZeroDuration());
}

void InflightWaits::Poke() {
  absl::MutexLock lock(&mu_);
  poked_ = true;
}

void InflightWaits::Reopen() {
  absl::MutexLock lock(&mu_);
  closed_ = absl::OkStatus();
}

void InflightWaits::Close(absl::Status why) {
  std::list<Waiter> ended;
  absl::Status closed;
  {
    absl::MutexLock lock(&mu_);
    if (closed_.ok()) closed_ = why.ok() ? absl::UnavailableError("kvd is draining") : why;
    closed = closed_;
    ended.swap(waiters_);
    waiting_by_worker_.clear();
  }
  const absl::Time now = absl::Now();
  for (Waiter& w : ended) w.done(closed, now - w.queued_at);
}

int64_t InflightWaits::waiting() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(waiters_.size());
}

InflightWaits::Outcome InflightWaits::EndedOutcomeLocked(const Waiter& w) const {
  // Published: the namespace's prefix now reaches past where the wait began.
  absl::StatusOr<int64_t> served = cache_->PeekPrefixLen(w.ns, w.prompt);
  const PoolGeometry* geo = nullptr;
  if (absl::StatusOr<PoolId> p = cache_->FindPool(w.ns.pool); p.ok()) geo = &cache_->pools()[*p];
  if (served.ok() && geo != nullptr && *served > w.what.first_block * geo->block_tokens) return Outcome::kPublished;
  return Outcome::kReleased;
}

void InflightWaits::SweepLocked(absl::Time now, std::vector<Answer>* out) {
  for (auto it = waiters_.begin(); it != waiters_.end();) {
    absl::StatusOr<Outcome> answer;
    bool answered = true;
    if (absl::Status c = it->cancelled ? it->cancelled() : absl::OkStatus(); !c.ok()) {
      answer = c;
    } else if (!cache_->InFlightHeld(it->what)) {
      answer = EndedOutcomeLocked(*it);
    } else if (now >= it->deadline) {
      answer = Outcome::kTimedOut;
    } else {
      answered = false;
    }
    if (!answered) {
      ++it;
      continue;
    }
    auto w = waiting_by_worker_.find(it->limit_key);
    if (w != waiting_by_worker_.end() && --w->second <= 0) waiting_by_worker_.erase(w);
    out->emplace_back(std::move(*it), std::move(answer));
    it = waiters_.erase(it);
  }
}

void InflightWaits::Run() {
  pthread_setname_np(pthread_self(), "kvd-inflight");
  std::vector<Answer> answers;
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      if (waiters_.empty()) {
        mu_.Await(absl::Condition(this, &InflightWaits::HasWaiters));  // idle: no timer, pokes ignored
      } else {
        mu_.AwaitWithTimeout(absl::Condition(this, &InflightWaits::Woken), kRetryInterval);
      }
      if (stop_) return;
      poked_ = false;
      if (!waiters_.empty()) SweepLocked(absl::Now(), &answers);
    }
    const absl::Time now = absl::Now();
    for (auto& [w, r] : answers) w.done(std::move(r), now - w.queued_at);
    answers.clear();
  }
}

}  // namespace kvd
