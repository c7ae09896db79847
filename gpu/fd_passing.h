// Passing file descriptors between processes over a Unix stream socket (SCM_RIGHTS), and
// reading the peer's credentials (SO_PEERCRED). Blocking calls; use on dedicated threads.
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "gpu/unique_fd.h"

namespace kvd {

struct PeerCredentials {
  pid_t pid = 0;
  uid_t uid = 0;
  gid_t gid = 0;
};

// The credentials of the process at the other end of a connected Unix socket.
absl::StatusOr<PeerCredentials> GetPeerCredentials(int socket_fd);

// Sends one message: a 4-byte length, `payload`, and `fds` attached to the first byte.
absl::Status SendMessage(int socket_fd, absl::string_view payload, absl::Span<const int> fds);

struct ReceivedMessage {
  std::string payload;
  std::vector<UniqueFd> fds;
};
// Receives one message sent by SendMessage. At most `max_payload` bytes and `max_fds` fds;
// INVALID_ARGUMENT past either, UNAVAILABLE when the peer closed first.
absl::StatusOr<ReceivedMessage> ReceiveMessage(int socket_fd, size_t max_payload, size_t max_fds);

// Connects a Unix stream socket to `path`.
absl::StatusOr<UniqueFd> ConnectUnix(const std::string& path);
// Binds and listens on `path` with mode `mode`, with the system's largest backlog (SOMAXCONN: a
// burst of workers connecting at start is queued, not refused). A dead socket file left there (a
// crashed process) is replaced; ALREADY_EXISTS when a process accepts connections on `path`, and
// FAILED_PRECONDITION when `path` is anything but a socket: never take a live listener's name,
// unless `replace_live` (a successor taking over from the listener).
absl::StatusOr<UniqueFd> ListenUnix(const std::string& path, mode_t mode, bool replace_live = false);
// Whether a process accepts connections on the Unix socket `path` now.
bool UnixSocketAnswers(const std::string& path);

}  // namespace kvd
