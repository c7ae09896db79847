#include "gpu/fd_passing.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace kvd {
namespace {

absl::Status Errno(absl::string_view what) {
  return absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(errno)));
}

absl::Status WriteAll(int fd, const char* data, size_t n) {
  while (n > 0) {
    ssize_t w = ::send(fd, data, n, MSG_NOSIGNAL);
    if (w < 0) {
      if (errno == EINTR) continue;
      return Errno("send");
    }
    data += w;
    n -= static_cast<size_t>(w);
  }
  return absl::OkStatus();
}

absl::Status ReadAll(int fd, char* data, size_t n) {
  while (n > 0) {
    ssize_t r = ::recv(fd, data, n, 0);
    if (r == 0) return absl::UnavailableError("peer closed the socket");
    if (r < 0) {
      if (errno == EINTR) continue;
      return Errno("recv");
    }
    data += r;
    n -= static_cast<size_t>(r);
  }
  return absl::OkStatus();
}

absl::StatusOr<sockaddr_un> UnixAddress(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("socket path too long: ", path));
  }
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  return addr;
}

}  // namespace

absl::StatusOr<PeerCredentials> GetPeerCredentials(int socket_fd) {
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (getsockopt(socket_fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) return Errno("SO_PEERCRED");
  return PeerCredentials{cred.pid, cred.uid, cred.gid};
}

absl::Status SendMessage(int socket_fd, absl::string_view payload, absl::Span<const int> fds) {
  const uint32_t len = static_cast<uint32_t>(payload.size());
  iovec iov{const_cast<uint32_t*>(&len), sizeof(len)};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  std::vector<char> control;
  if (!fds.empty()) {
    control.resize(CMSG_SPACE(sizeof(int) * fds.size()));
    msg.msg_control = control.data();
    msg.msg_controllen = control.size();
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
  }
  ssize_t w;
  do {
    w = ::sendmsg(socket_fd, &msg, MSG_NOSIGNAL);
  } while (w < 0 && errno == EINTR);
  if (w < 0) return Errno("sendmsg");
  if (static_cast<size_t>(w) < sizeof(len)) {
    auto rest = WriteAll(socket_fd, reinterpret_cast<const char*>(&len) + w, sizeof(len) - w);
    if (!rest.ok()) return rest;
  }
  return WriteAll(socket_fd, payload.data(), payload.size());
}

absl::StatusOr<ReceivedMessage> ReceiveMessage(int socket_fd, size_t max_payload, size_t max_fds) {
  uint32_t len = 0;
  iovec iov{&len, sizeof(len)};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  std::vector<char> control(CMSG_SPACE(sizeof(int) * (max_fds == 0 ? 1 : max_fds)));
  msg.msg_control = control.data();
  msg.msg_controllen = control.size();
  ssize_t r;
  do {
    r = ::recvmsg(socket_fd, &msg, MSG_CMSG_CLOEXEC);
  } while (r < 0 && errno == EINTR);
  if (r == 0) return absl::UnavailableError("peer closed the socket");
  if (r < 0) return Errno("recvmsg");
  ReceivedMessage out;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < n; ++i) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
      out.fds.emplace_back(fd);
    }
  }
  if (msg.msg_flags & MSG_CTRUNC) return absl::InvalidArgumentError("too many file descriptors");
  if (out.fds.size() > max_fds) return absl::InvalidArgumentError("too many file descriptors");
  if (static_cast<size_t>(r) < sizeof(len)) {
    auto rest = ReadAll(socket_fd, reinterpret_cast<char*>(&len) + r, sizeof(len) - r);
    if (!rest.ok()) return rest;
  }
  if (len > max_payload) {
    return absl::InvalidArgumentError(absl::StrCat("message of ", len, " bytes exceeds ", max_payload));
  }
  out.payload.resize(len);
  auto body = ReadAll(socket_fd, out.payload.data(), len);
  if (!body.ok()) return body;
  return out;
}

absl::StatusOr<UniqueFd> ConnectUnix(const std::string& path) {
  auto addr = UnixAddress(path);
  if (!addr.ok()) return addr.status();
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return Errno("socket");
  if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&*addr), sizeof(*addr)) != 0) {
    return Errno(absl::StrCat("connect ", path));
  }
  return fd;
}

bool UnixSocketAnswers(const std::string& path) { return ConnectUnix(path).ok(); }

absl::StatusOr<UniqueFd> ListenUnix(const std::string& path, mode_t mode, bool replace_live) {
  auto addr = UnixAddress(path);
  if (!addr.ok()) return addr.status();
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return Errno("socket");
  struct stat st;
  if (::lstat(path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) {
      return absl::FailedPreconditionError(absl::StrCat(path, " exists and is not a socket; not replaced"));
    }
    if (!replace_live && UnixSocketAnswers(path)) {
      return absl::AlreadyExistsError(absl::StrCat("a process is listening on ", path));
    }
    ::unlink(path.c_str());  // left by a process that is gone
  }
  // The socket file gets `mode` from the start: no window with wider permissions before chmod.
  const mode_t old_umask = ::umask(~mode & 0777);
  const int bound = ::bind(fd.get(), reinterpret_cast<const sockaddr*>(&*addr), sizeof(*addr));
  ::umask(old_umask);
  if (bound != 0) return Errno(absl::StrCat("bind ", path));
  if (::chmod(path.c_str(), mode) != 0) return Errno(absl::StrCat("chmod ", path));
  if (::listen(fd.get(), SOMAXCONN) != 0) return Errno("listen");
  return fd;
}

}  // namespace kvd
