// AccessPolicy: which local users may use kvd, by uid and gid, on top of the sockets' 0660 mode.
// Root and the daemon's own user are always allowed; with both lists empty, everyone who can open
// the sockets is. A peer's groups are its primary gid (SO_PEERCRED) and its supplementary groups
// (read from /proc/<pid>/status), so workers can be allowed by joining a group.
#pragma once

#include <sys/types.h>

#include <vector>

#include "absl/status/status.h"
#include "gpu/fd_passing.h"

namespace kvd {

class AccessPolicy {
 public:
  AccessPolicy() = default;
  AccessPolicy(std::vector<uid_t> uids, std::vector<gid_t> gids)
      : uids_(std::move(uids)), gids_(std::move(gids)) {}
  bool enabled() const { return !uids_.empty() || !gids_.empty(); }
  // OK, or PERMISSION_DENIED naming the peer's uid and gid.
  absl::Status Check(const PeerCredentials& peer) const;

 private:
  std::vector<uid_t> uids_;
  std::vector<gid_t> gids_;
};

}  // namespace kvd
