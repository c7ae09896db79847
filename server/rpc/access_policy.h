// AccessPolicy: which local users may use kvd, by uid and gid, on top of the sockets' 0660 mode.
// Root and the daemon's own user are always allowed; with both lists empty, everyone who can open
// the sockets is. A peer's groups are its primary gid (SO_PEERCRED) and its supplementary groups
// (read from /proc/<pid>/status), so workers can be allowed by joining a group.
//
// The sockets' group (socket_group, or kvd's own group when unset) already reaches kvd through
// the 0660 socket mode; without an allow-list its members may also map slabs (InSocketGroup), so
// "put worker users in the kvd group" works as the unit and the manifests say.
#pragma once

#include <sys/types.h>

#include <vector>

#include "absl/status/status.h"
#include "gpu/fd_passing.h"

namespace kvd {

class AccessPolicy {
 public:
  AccessPolicy() = default;
  AccessPolicy(std::vector<uid_t> uids, std::vector<gid_t> gids, gid_t socket_gid)
      : uids_(std::move(uids)), gids_(std::move(gids)), socket_gid_(socket_gid), has_socket_gid_(true) {}
  bool enabled() const { return !uids_.empty() || !gids_.empty(); }
  // OK, or PERMISSION_DENIED naming the peer's uid and gid.
  absl::Status Check(const PeerCredentials& peer) const;
  // Whether the peer's primary or a supplementary group is the sockets' group.
  bool InSocketGroup(const PeerCredentials& peer) const;

 private:
  std::vector<uid_t> uids_;
  std::vector<gid_t> gids_;
  gid_t socket_gid_ = 0;
  bool has_socket_gid_ = false;
};

}  // namespace kvd
