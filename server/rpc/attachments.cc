#include "server/rpc/attachments.h"

#include <unistd.h>

#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace kvd {
namespace {

std::string RandomToken() {
  std::random_device rd;  // /dev/urandom
  std::string out;
  for (int i = 0; i < 4; ++i) {
    uint64_t v = (static_cast<uint64_t>(rd()) << 32) | rd();
    out += absl::StrFormat("%016x", v);
  }
  return out;
}

}  // namespace

AttachmentRegistry::AttachmentRegistry(const Clock* clock, absl::Duration lease_ttl)
    : clock_(clock), lease_ttl_(lease_ttl) {}

AttachmentRegistry::Attached AttachmentRegistry::Register(const std::string& name, pid_t pid,
                                                          std::string caller,
                                                          std::string event_handle) {
  absl::MutexLock lock(&mu_);
  WorkerId id(absl::StrCat("w", next_id_++, "-", pid, "-", ::getpid()));
  Entry& e = workers_[id];
  e.name = name;
  e.pid = pid;
  e.caller = std::move(caller);
  e.event_handle = std::move(event_handle);
  e.slab_token = RandomToken();
  e.lease_expires = clock_->Now() + lease_ttl_;
  return Attached{id, e.slab_token};
}

std::string AttachmentRegistry::EventHandle(const WorkerId& id) const {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(id);
  return it == workers_.end() ? std::string() : it->second.event_handle;
}

absl::Status AttachmentRegistry::Renew(const WorkerId& id) {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(id);
  if (it == workers_.end()) {
    return absl::FailedPreconditionError(absl::StrCat("worker '", id.value(), "' is not attached"));
  }
  it->second.lease_expires = clock_->Now() + lease_ttl_;
  return absl::OkStatus();
}

absl::Status AttachmentRegistry::Check(const WorkerId& id, const std::string& caller) const {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(id);
  if (it == workers_.end()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "worker '", id.value(), "' is not attached (Attach first; a lapsed lease ends it)"));
  }
  if (it->second.caller != caller) {
    return absl::PermissionDeniedError(absl::StrCat(
        "worker '", id.value(), "' was attached by another process or connection; attach your own"));
  }
  return absl::OkStatus();
}

bool AttachmentRegistry::Remove(const WorkerId& id) {
  absl::MutexLock lock(&mu_);
  return workers_.erase(id) > 0;
}

std::vector<WorkerId> AttachmentRegistry::TakeLapsed() {
  absl::MutexLock lock(&mu_);
  const absl::Time now = clock_->Now();
  std::vector<WorkerId> out;
  for (const auto& [id, e] : workers_) {
    if (e.lease_expires <= now) out.push_back(id);
  }
  for (const WorkerId& id : out) workers_.erase(id);
  return out;
}

absl::Status AttachmentRegistry::RedeemToken(const std::string& token, const PeerCredentials& peer,
                                             bool allow_listed) {
  absl::MutexLock lock(&mu_);
  for (auto& [id, e] : workers_) {
    if (e.slab_token != token) continue;
    if (e.token_used) return absl::PermissionDeniedError("slab token was already used");
    if (peer.pid != e.pid) {
      return absl::PermissionDeniedError(absl::StrCat(
          "slab token belongs to pid ", e.pid, ", presented by pid ", peer.pid,
          " (a worker in another PID namespace needs hostPID or shareProcessNamespace)"));
    }
    if (peer.uid != geteuid() && peer.uid != 0 && !allow_listed) {
      return absl::PermissionDeniedError(absl::StrCat("peer uid ", peer.uid, " may not map slabs"));
    }
    e.token_used = true;
    return absl::OkStatus();
  }
  return absl::PermissionDeniedError("unknown slab token");
}

int64_t AttachmentRegistry::size() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(workers_.size());
}

absl::flat_hash_map<WorkerId, uint32_t> AttachmentRegistry::Pids() const {
  absl::MutexLock lock(&mu_);
  absl::flat_hash_map<WorkerId, uint32_t> out;
  for (const auto& [id, e] : workers_) out.emplace(id, e.pid > 0 ? static_cast<uint32_t>(e.pid) : 0);
  return out;
}

}  // namespace kvd
