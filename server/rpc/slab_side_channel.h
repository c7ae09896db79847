// SlabSideChannel serves slab file descriptors to attached workers over a Unix socket next to
// the gRPC socket (the host backend's data-plane handshake).
//
// Protocol (messages framed by gpu/fd_passing.h): the worker sends its one-time slab token; the
// daemon checks the peer with SO_PEERCRED (AttachmentRegistry::RedeemToken) and answers
// "OK <n>", then n messages "<pool> <shard> <size_bytes>" each carrying one fd; or "ERR <reason>"
// and closes.
//
// A worker may instead open a step lane: its first message is "STEP <worker_id>", and the
// connection is handed to the lane handler (KvdService::ServeStepLane) for as long as the worker
// keeps it open. Lanes have no deadline and count against kMaxLanes (kMaxLanesPerProcess from one
// process), not kMaxConnections; Release cuts them (a successor serves new ones).
//
// Threads: one accept thread, and one short-lived thread per connection, so a silent or slow
// peer delays no one else. Each connection has a deadline (kConnectionDeadline from accept, for
// the whole exchange, however the peer drips its bytes); the accept thread shuts down the socket
// of a connection past it, which ends that connection's thread, and logs it. At most
// kMaxConnections are served at once; past that a new peer gets "ERR busy" at once.
#pragma once

#include <atomic>
#include <functional>
#include <list>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "gpu/device_arena.h"
#include "gpu/unique_fd.h"
#include "server/rpc/access_policy.h"
#include "server/rpc/attachments.h"

namespace kvd {

class SlabSideChannel {
 public:
  static constexpr absl::Duration kConnectionDeadline = absl::Seconds(5);
  static constexpr int kMaxConnections = 64;
  static constexpr int kMaxLanes = 512;
  static constexpr int kMaxLanesPerProcess = 16;  // one process cannot take every lane
  // Serves one step lane on `fd` until it closes or `stop` is set (KvdService::ServeStepLane).
  using LaneHandler = std::function<void(int fd, const PeerCredentials& peer, const std::string& worker_id,
                                         const std::atomic<bool>& stop)>;

  // Listens on `path` (mode 0660), or on `adopted` when given: a listening socket already bound
  // there, handed over by the previous kvd (server/handoff.h). `arena`, `registry` and `policy`
  // (may be null) are borrowed and must outlive this; peers `policy` refuses get "ERR" and
  // nothing else.
  static absl::StatusOr<std::unique_ptr<SlabSideChannel>> Start(const std::string& path,
                                                                const DeviceArena* arena,
                                                                AttachmentRegistry* registry,
                                                                const AccessPolicy* policy = nullptr,
                                                                UniqueFd adopted = UniqueFd());
  ~SlabSideChannel();  // stops the thread and removes the socket file (unless released or adopted)
  // Stops serving (connections in progress are cut) and returns the listening socket, which stays
  // bound: connections queue there until its new owner accepts them. The file is left in place.
  UniqueFd Release();
  // Serves step lanes with `handler` from now on (before: a lane's hello is refused). The handler
  // and what it calls must outlive this channel's Release or destruction.
  void set_lane_handler(LaneHandler handler) ABSL_LOCKS_EXCLUDED(mu_);
  const std::string& path() const { return path_; }

 private:
  SlabSideChannel(std::string path, UniqueFd listen_fd, UniqueFd wake_read, UniqueFd wake_write,
                  const DeviceArena* arena, AttachmentRegistry* registry, const AccessPolicy* policy);
  struct Connection {
    UniqueFd fd;
    absl::Time deadline;
    bool expired = false;  // its socket was shut down at the deadline
    bool done = false;     // Serve returned; the thread may be joined
    bool lane = false;     // a step lane: no deadline, counted against kMaxLanes
    pid_t lane_pid = 0;    // the process that opened it
    std::thread thread;
  };
  void Loop();
  void Serve(Connection* conn) ABSL_LOCKS_EXCLUDED(mu_);
  // Shuts down connections past their deadline; returns the time to the next deadline.
  absl::Duration ExpireConnections() ABSL_LOCKS_EXCLUDED(mu_);
  // Joins the threads of finished connections (all of them with `all`, after shutting them down).
  void Reap(bool all) ABSL_LOCKS_EXCLUDED(mu_);

  std::string path_;
  UniqueFd listen_fd_;
  UniqueFd wake_read_;
  UniqueFd wake_write_;
  const DeviceArena* arena_;
  AttachmentRegistry* registry_;
  const AccessPolicy* policy_;
  absl::Mutex mu_;
  std::list<std::unique_ptr<Connection>> connections_ ABSL_GUARDED_BY(mu_);
  // Release() gave the socket away, or it was adopted: its file is not this channel's to remove.
  bool released_ = false;
  LaneHandler lane_handler_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> stopping_{false};  // Release: lanes return
  std::thread thread_;  // declared last: started once everything above exists
};

}  // namespace kvd
