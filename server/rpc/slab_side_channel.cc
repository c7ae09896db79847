#include "server/rpc/slab_side_channel.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "server/core/clock.h"
#include "spdlog/spdlog.h"

namespace kvd {

absl::StatusOr<std::unique_ptr<SlabSideChannel>> SlabSideChannel::Start(
    const std::string& path, const DeviceArena* arena, AttachmentRegistry* registry,
    const AccessPolicy* policy, UniqueFd adopted) {
  const bool adopting = adopted.valid();
  absl::StatusOr<UniqueFd> listen_fd = adopting ? std::move(adopted) : ListenUnix(path, 0660);
  if (!listen_fd.ok()) return listen_fd.status();
  int pipe_fds[2];
  if (pipe2(pipe_fds, O_CLOEXEC) != 0) return absl::InternalError("pipe2 failed");
  std::unique_ptr<SlabSideChannel> channel(new SlabSideChannel(
      path, std::move(*listen_fd), UniqueFd(pipe_fds[0]), UniqueFd(pipe_fds[1]), arena, registry,
      policy));
  channel->released_ = adopting;  // a predecessor bound the file: it is not this channel's to remove
  return channel;
}

SlabSideChannel::SlabSideChannel(std::string path, UniqueFd listen_fd, UniqueFd wake_read,
                                 UniqueFd wake_write, const DeviceArena* arena,
                                 AttachmentRegistry* registry, const AccessPolicy* policy)
    : path_(std::move(path)),
      listen_fd_(std::move(listen_fd)),
      wake_read_(std::move(wake_read)),
      wake_write_(std::move(wake_write)),
      arena_(arena),
      registry_(registry),
      policy_(policy) {
  thread_ = std::thread([this] { Loop(); });
}

SlabSideChannel::~SlabSideChannel() {
  UniqueFd listening = Release();
  if (!released_) ::unlink(path_.c_str());
}

void SlabSideChannel::set_lane_handler(LaneHandler handler) {
  absl::MutexLock lock(&mu_);
  lane_handler_ = std::move(handler);
}

UniqueFd SlabSideChannel::Release() {
  stopping_ = true;
  const char b = 'x';
  (void)!::write(wake_write_.get(), &b, 1);
  if (thread_.joinable()) thread_.join();
  Reap(/*all=*/true);
  if (listen_fd_.valid()) released_ = true;
  return std::move(listen_fd_);
}

absl::Duration SlabSideChannel::ExpireConnections() {
  const absl::Time now = SystemClock::Get()->Now();
  absl::Duration next = absl::InfiniteDuration();
  absl::MutexLock lock(&mu_);
  for (auto& c : connections_) {
    if (c->done || c->expired || c->lane) continue;
    if (now >= c->deadline) {
      c->expired = true;
      ::shutdown(c->fd.get(), SHUT_RDWR);  // ends the blocked send or receive of its thread
    } else {
      next = std::min(next, c->deadline - now);
    }
  }
  return next;
}

void SlabSideChannel::Reap(bool all) {
  std::list<std::unique_ptr<Connection>> finished;
  {
    absl::MutexLock lock(&mu_);
    for (auto it = connections_.begin(); it != connections_.end();) {
      if (all && !(*it)->done) ::shutdown((*it)->fd.get(), SHUT_RDWR);
      if (all || (*it)->done) {
        finished.splice(finished.end(), connections_, it++);
      } else {
        ++it;
      }
    }
  }
  for (auto& c : finished) {
    if (c->thread.joinable()) c->thread.join();
  }
}

void SlabSideChannel::Loop() {
  for (;;) {
    Reap(/*all=*/false);
    const absl::Duration next = ExpireConnections();
    const int timeout_ms = next == absl::InfiniteDuration()
                               ? -1
                               : static_cast<int>(std::max<int64_t>(1, absl::ToInt64Milliseconds(absl::Ceil(next, absl::Milliseconds(1)))));
    pollfd fds[2] = {{listen_fd_.get(), POLLIN, 0}, {wake_read_.get(), POLLIN, 0}};
    const int ready = ::poll(fds, 2, timeout_ms);
    if (ready < 0) {
      if (errno == EINTR) continue;
      spdlog::error("side socket: poll failed: {}", std::strerror(errno));
      return;
    }
    if (fds[1].revents != 0) return;
    if ((fds[0].revents & POLLIN) == 0) continue;
    UniqueFd conn(::accept4(listen_fd_.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (!conn.valid()) {
      if (errno == EMFILE || errno == ENFILE) {
        // Out of descriptors: the pending connection stays queued; back off instead of spinning.
        spdlog::warn("side socket: accept: {}; retrying in 100 ms", std::strerror(errno));
        ::poll(nullptr, 0, 100);
      }
      continue;
    }
    bool busy = false;
    {
      absl::MutexLock lock(&mu_);
      busy = std::count_if(connections_.begin(), connections_.end(), [](const auto& c) { return !c->lane; }) >=
             kMaxConnections;
    }
    if (busy) {  // only this thread adds connections: the count cannot grow meanwhile
      const timeval brief{0, 100'000};
      setsockopt(conn.get(), SOL_SOCKET, SO_SNDTIMEO, &brief, sizeof(brief));
      (void)SendMessage(conn.get(), "ERR busy: too many side-socket connections at once; retry", {});
      continue;
    }
    absl::MutexLock lock(&mu_);
    auto c = std::make_unique<Connection>();
    c->fd = std::move(conn);
    c->deadline = SystemClock::Get()->Now() + kConnectionDeadline;
    Connection* raw = c.get();
    c->thread = std::thread([this, raw] {
      Serve(raw);
      // The peer sees the end now, not when the accept thread next reaps (a lane kvd closed on
      // bad input, or any connection once served; what was sent stays readable).
      ::shutdown(raw->fd.get(), SHUT_RDWR);
      absl::MutexLock lock(&mu_);
      if (raw->expired) {
        spdlog::warn("side socket: a peer did not finish within {}s; its connection was closed",
                     absl::ToInt64Seconds(kConnectionDeadline));
      }
      raw->done = true;
    });
    connections_.push_back(std::move(c));
  }
}

void SlabSideChannel::Serve(Connection* c) {
  const int conn = c->fd.get();
  auto refuse = [conn](const absl::Status& why) {
    spdlog::warn("side socket: refused a peer: {}", why.ToString());
    (void)SendMessage(conn, absl::StrCat("ERR ", why.message()), {});
  };
  auto peer = GetPeerCredentials(conn);
  if (!peer.ok()) return refuse(peer.status());
  // kvd's own user and root may map slabs; with an allow-list, its users too; without one, the
  // members of the sockets' group (whom the 0660 socket mode already lets in).
  bool allow_listed = false;
  if (policy_ != nullptr && policy_->enabled()) {
    if (absl::Status allowed = policy_->Check(*peer); !allowed.ok()) return refuse(allowed);
    allow_listed = true;
  } else if (policy_ != nullptr) {
    allow_listed = policy_->InSocketGroup(*peer);
  }
  auto token = ReceiveMessage(conn, /*max_payload=*/256, /*max_fds=*/0);
  if (!token.ok()) return refuse(token.status());
  if (absl::StartsWith(token->payload, "STEP ")) {
    LaneHandler handler;
    {
      absl::MutexLock lock(&mu_);
      int64_t lanes = 0, mine = 0;
      for (const auto& o : connections_) {  // open ones (a closed lane may wait to be reaped)
        const bool open_lane = o->lane && !o->done;
        lanes += open_lane;
        mine += open_lane && o->lane_pid == peer->pid;
      }
      if (lanes >= kMaxLanes || mine >= kMaxLanesPerProcess) {
        return refuse(absl::ResourceExhaustedError(
            lanes >= kMaxLanes ? absl::StrCat("busy: ", kMaxLanes, " step lanes are open")
                               : absl::StrCat("busy: pid ", peer->pid, " has ", kMaxLanesPerProcess, " step lanes open")));
      }
      if (lane_handler_ == nullptr) return refuse(absl::UnavailableError("kvd serves no step lanes yet"));
      handler = lane_handler_;
      c->lane = true;  // from here on no deadline cuts it
      c->lane_pid = peer->pid;
    }
    return handler(conn, *peer, token->payload.substr(5), stopping_);
  }
  absl::Status redeemed = registry_->RedeemToken(token->payload, *peer, allow_listed);
  if (!redeemed.ok()) return refuse(redeemed);
  const auto& slabs = arena_->slabs();
  if (!SendMessage(conn, absl::StrCat("OK ", slabs.size()), {}).ok()) return;
  for (const SlabDescriptor& s : slabs) {
    std::vector<int> fds;
    if (s.fd >= 0) fds.push_back(s.fd);
    if (!SendMessage(conn, absl::StrCat(s.pool, " ", s.shard, " ", s.size_bytes), fds).ok()) return;
  }
  spdlog::info("side socket: sent {} slab fds to pid {}", slabs.size(), peer->pid);
}

}  // namespace kvd
