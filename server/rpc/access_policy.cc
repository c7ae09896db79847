#include "server/rpc/access_policy.h"

#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"

namespace kvd {
namespace {

std::vector<gid_t> SupplementaryGroups(pid_t pid) {
  std::vector<gid_t> out;
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("Groups:", 0) != 0) continue;
    std::istringstream groups(line.substr(7));
    gid_t g;
    while (groups >> g) out.push_back(g);
  }
  return out;
}

}  // namespace

absl::Status AccessPolicy::Check(const PeerCredentials& peer) const {
  if (!enabled() || peer.uid == 0 || peer.uid == geteuid()) return absl::OkStatus();
  const auto has = [](const auto& v, auto x) { return std::find(v.begin(), v.end(), x) != v.end(); };
  if (has(uids_, peer.uid) || has(gids_, peer.gid)) return absl::OkStatus();
  for (gid_t g : SupplementaryGroups(peer.pid)) {
    if (has(gids_, g)) return absl::OkStatus();
  }
  return absl::PermissionDeniedError(absl::StrCat("uid ", peer.uid, " (gid ", peer.gid,
                                                  ") is not in kvd's allowed_uids / allowed_gids"));
}

bool AccessPolicy::InSocketGroup(const PeerCredentials& peer) const {
  if (!has_socket_gid_) return false;
  if (peer.gid == socket_gid_) return true;
  const std::vector<gid_t> groups = SupplementaryGroups(peer.pid);
  return std::find(groups.begin(), groups.end(), socket_gid_) != groups.end();
}

}  // namespace kvd
