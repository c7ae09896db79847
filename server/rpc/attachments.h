// AttachmentRegistry tracks the workers attached to the daemon: who they are (id, name, pid),
// their lease, and the one-time token that lets exactly that process fetch slab fds from the side
// socket. Every request a worker makes names its worker id; Check() refuses ids that are not live,
// and ids that another caller attached: a worker id is bound to the caller that attached it
// (its process on the Unix socket, its connection on TCP), so knowing an id is not enough to act
// as that worker. Thread-safe.
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "gpu/fd_passing.h"
#include "server/core/clock.h"
#include "proto/vocab/types.h"

namespace kvd {

class AttachmentRegistry {
 public:
  struct Attached {
    WorkerId id;
    std::string slab_token;
  };
  // `clock` is borrowed and must outlive the registry.
  AttachmentRegistry(const Clock* clock, absl::Duration lease_ttl);

  // Registers a worker (with its optional interprocess event handle) attached by `caller` (the
  // key of KvdService::Caller) and issues its id and one-time slab token. `pid` is the kernel's
  // when known (SO_PEERCRED), else the worker's own word. Ids are "w<n>-<pid>-<kvd's pid>": never
  // reused by a later kvd process (after a restart or handoff a call that still carries the old
  // id is told the worker is not attached, instead of acting for its new attachment).
  Attached Register(const std::string& name, pid_t pid, std::string caller,
                    std::string event_handle = "") ABSL_LOCKS_EXCLUDED(mu_);
  // The worker's interprocess event handle; empty when it registered none or is gone.
  std::string EventHandle(const WorkerId& id) const ABSL_LOCKS_EXCLUDED(mu_);
  // Extends the lease. FAILED_PRECONDITION when the attachment is gone (e.g. its lease lapsed).
  absl::Status Renew(const WorkerId& id) ABSL_LOCKS_EXCLUDED(mu_);
  // OK when `id` is a live attachment made by `caller`; FAILED_PRECONDITION when it is not live,
  // PERMISSION_DENIED when another caller attached it.
  absl::Status Check(const WorkerId& id, const std::string& caller) const ABSL_LOCKS_EXCLUDED(mu_);
  // Forgets the worker. Returns false when it was not registered.
  bool Remove(const WorkerId& id) ABSL_LOCKS_EXCLUDED(mu_);
  // Removes and returns workers whose lease has lapsed.
  std::vector<WorkerId> TakeLapsed() ABSL_LOCKS_EXCLUDED(mu_);
  // Consumes a slab token presented on the side socket. PERMISSION_DENIED unless the token is live
  // and unused and the peer is the process that attached (same pid) under the daemon's uid or root,
  // or `allow_listed` (the access policy admitted it).
  absl::Status RedeemToken(const std::string& token, const PeerCredentials& peer,
                           bool allow_listed = false)
      ABSL_LOCKS_EXCLUDED(mu_);

  int64_t size() const ABSL_LOCKS_EXCLUDED(mu_);
  // Every live attachment's pid (0 when unknown).
  absl::flat_hash_map<WorkerId, uint32_t> Pids() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Entry {
    std::string name;
    pid_t pid = 0;
    std::string caller;
    std::string slab_token;
    std::string event_handle;
    bool token_used = false;
    absl::Time lease_expires;
  };

  const Clock* const clock_;
  const absl::Duration lease_ttl_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<WorkerId, Entry> workers_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
};

}  // namespace kvd
