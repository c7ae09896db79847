#include "server/rpc/roles.h"

#include "absl/container/flat_hash_set.h"

namespace kvd {

Role RequiredRole(absl::string_view method) {
  static const auto* const kOperatorOnly = new absl::flat_hash_set<absl::string_view>{
      "WatchEvents", "SavedPrefixes", "ListHandles", "GetHandle", "ListSessions", "GetSession",
      "CloseSession", "Drain", "Boundary", "Gc", "Flush", "Close", "StopIdleDemotion"};
  return kOperatorOnly->contains(method) ? Role::kOperator : Role::kWorker;
}

}  // namespace kvd
