#include "server/rpc/peer_listener.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>

#include <grpcpp/server_posix.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"

namespace kvd {

absl::StatusOr<std::unique_ptr<PeerListener>> PeerListener::Bind(const std::string& path) {
  absl::StatusOr<UniqueFd> fd = ListenUnix(path, 0660);
  if (!fd.ok()) return fd.status();
  return Adopt(std::move(*fd));
}

absl::StatusOr<std::unique_ptr<PeerListener>> PeerListener::Adopt(UniqueFd fd) {
  int pipe_fds[2];
  if (pipe2(pipe_fds, O_CLOEXEC) != 0) return absl::InternalError("pipe2 failed");
  auto listener = std::unique_ptr<PeerListener>(
      new PeerListener(std::move(fd), UniqueFd(pipe_fds[0]), UniqueFd(pipe_fds[1])));
  for (UniqueFd& spare : listener->spare_fds_) spare = UniqueFd(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  return listener;
}

PeerListener::~PeerListener() { Release(); }

UniqueFd PeerListener::Release() {
  const char b = 'x';
  (void)!::write(wake_write_.get(), &b, 1);
  if (thread_.joinable()) thread_.join();
  return std::move(listen_fd_);
}

void PeerListener::Start(grpc::Server* server) {
  thread_ = std::thread([this, server] { Loop(server); });
}

void PeerListener::Loop(grpc::Server* server) {
  for (;;) {
    pollfd fds[2] = {{listen_fd_.get(), POLLIN, 0}, {wake_read_.get(), POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      spdlog::error("grpc socket: poll failed: {}", std::strerror(errno));
      return;
    }
    if (fds[1].revents != 0) return;
    if ((fds[0].revents & POLLIN) == 0) continue;
    const int conn = ::accept4(listen_fd_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (conn < 0) {
      if (errno == EMFILE || errno == ENFILE) ShedOneConnection();
      continue;
    }
    absl::StatusOr<PeerCredentials> peer = GetPeerCredentials(conn);
    if (!peer.ok()) {
      ::close(conn);
      continue;
    }
    {
      absl::MutexLock lock(&mu_);
      peers_[conn] = *peer;
    }
    grpc::AddInsecureChannelFromFd(server, conn);  // gRPC owns the fd from here on
  }
}

void PeerListener::ShedOneConnection() {
  // Out of descriptors: the pending connection would keep poll() ready and this loop spinning.
  // Give up the spare descriptors, accept the connection into one and close it (the peer sees
  // its connection closed and may retry), log while a descriptor is still free (writing a log
  // line may need one), then take the spares back and pause briefly.
  const std::string why = std::strerror(errno);
  for (UniqueFd& spare : spare_fds_) spare.Reset();
  UniqueFd(::accept4(listen_fd_.get(), nullptr, nullptr, SOCK_CLOEXEC));
  const auto now = std::chrono::steady_clock::now();
  if (now - last_shed_log_ > std::chrono::seconds(10)) {
    spdlog::warn("grpc socket: out of file descriptors ({}); closing new connections until some "
                 "are released (raise LimitNOFILE?)", why);
    last_shed_log_ = now;
  }
  for (UniqueFd& spare : spare_fds_) spare = UniqueFd(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  ::poll(nullptr, 0, 10);
}

std::optional<PeerCredentials> PeerListener::PeerOf(const std::string& grpc_peer) const {
  int fd = -1;
  if (grpc_peer.rfind("fd:", 0) != 0 || !absl::SimpleAtoi(grpc_peer.substr(3), &fd)) return std::nullopt;
  absl::MutexLock lock(&mu_);
  auto it = peers_.find(fd);
  if (it == peers_.end()) return std::nullopt;
  return it->second;
}

}  // namespace kvd
