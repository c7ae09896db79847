// Which RPCs are for whom. kvd has two roles:
// - operators: root and kvd's own user on the Unix socket (SO_PEERCRED), and every caller that
//   passes TCP's transport security (use tls_client_ca_file to require client certificates);
// - workers: every other peer the allow-list admits (allowed_uids / allowed_gids).
// Workers get what serving a request needs; operators also get what sees across tenants or
// changes the whole node (tokens in events, saved prefixes, every handle and session, drain,
// gc, flush). docs/security.md states the trust model.
#pragma once

#include "absl/strings/string_view.h"

namespace kvd {

enum class Role { kWorker, kOperator };

// The role an RPC of kvd.v1.Kvd (by method name) requires.
Role RequiredRole(absl::string_view method);

}  // namespace kvd
