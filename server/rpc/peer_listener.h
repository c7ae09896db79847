// PeerListener accepts the gRPC Unix socket's connections itself, so that kvd knows who is behind
// each call: it reads the peer's credentials (SO_PEERCRED) at accept, then hands the connected
// socket to the gRPC server (AddInsecureChannelFromFd), where ServerContext::peer() reads
// "fd:<n>". KvdService looks the credentials up by that name and answers PERMISSION_DENIED to
// peers its AccessPolicy refuses. Used on every Unix socket.
//
// Out of descriptors (EMFILE), accept fails and leaves the connection pending; the listener then
// sheds it with spare descriptors kept for the purpose (accept into one, close) and pauses 10 ms,
// so it neither spins nor stops: it serves again as soon as descriptors are free.
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include <grpcpp/server.h>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "gpu/fd_passing.h"
#include "gpu/unique_fd.h"

namespace kvd {

class PeerListener {
 public:
  // Binds `path` with mode 0660. The failing call named on error.
  static absl::StatusOr<std::unique_ptr<PeerListener>> Bind(const std::string& path);
  // Accepts on `listen_fd`, a listening Unix socket handed over by the previous kvd.
  static absl::StatusOr<std::unique_ptr<PeerListener>> Adopt(UniqueFd listen_fd);
  ~PeerListener();  // stops accepting (connections already handed over stay with gRPC)
  // Stops accepting and returns the listening socket, still bound: new connections queue there
  // until its next owner accepts them.
  UniqueFd Release();

  // Starts accepting; `server` (borrowed) must outlive this.
  void Start(grpc::Server* server);
  // The credentials behind a call whose ServerContext::peer() is `grpc_peer`; nullopt when the
  // call did not come through this listener.
  std::optional<PeerCredentials> PeerOf(const std::string& grpc_peer) const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  PeerListener(UniqueFd listen_fd, UniqueFd wake_read, UniqueFd wake_write)
      : listen_fd_(std::move(listen_fd)), wake_read_(std::move(wake_read)), wake_write_(std::move(wake_write)) {}
  void Loop(grpc::Server* server);
  void ShedOneConnection();

  UniqueFd listen_fd_;
  UniqueFd wake_read_;
  UniqueFd wake_write_;
  // /dev/null twice, given up to shed a connection when out of descriptors (one to accept it
  // into, one for whatever logging it needs).
  UniqueFd spare_fds_[2];
  std::chrono::steady_clock::time_point last_shed_log_;  // accept thread only
  std::thread thread_;
  mutable absl::Mutex mu_;
  // By fd number: a number is reused only after gRPC closed the old connection, and the new
  // entry is written before the new connection is handed over.
  absl::flat_hash_map<int, PeerCredentials> peers_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvd
